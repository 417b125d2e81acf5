"""How much a host-bound engine step slows while a result is encoded beside it.

The speech pipeline's prompt pass is eager and bound by the host (thousands of kernel launches
and the Python around them); the diffusion runtime encodes PNGs and MP4s on media threads
(``MEDIA_WORKERS``) beside the engine thread, and libx264 starts threads of its own. This
script times a stand-in for such a step (``--launches`` small eager CUDA kernels in Python, one
sync) alone and beside an MP4 or PNG encode run in the ways the runtime could run it, and prints
the step's wall and CPU time (``time.thread_time``) per way, against the step alone measured in
the same run::

    python benchmarks/media_contention.py            # on a CUDA machine (CPU works, slowly)
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def step_fn(device: torch.device, launches: int) -> Callable[[], None]:
    """A host-bound step: ``launches`` tiny kernels launched from Python, then one sync."""
    x = torch.randn(64, 256, device=device)
    w = torch.randn(256, 256, device=device) / 16

    def step() -> None:
        y = x
        for _ in range(launches // 2):
            y = torch.nn.functional.linear(y, w).tanh_()
        float(y[0, 0])

    return step


def time_steps(
    step: Callable[[], None], seconds: float, busy: Callable[[], bool]
) -> tuple[np.ndarray, np.ndarray]:
    """Wall and CPU milliseconds of each step run while ``busy()`` (at least ``seconds``)."""
    walls, cpus = [], []
    end = time.perf_counter() + seconds
    while busy() or time.perf_counter() < end:
        w0, c0 = time.perf_counter(), time.thread_time()
        step()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.thread_time() - c0)
        if not busy() and time.perf_counter() >= end:
            break
    return np.array(walls) * 1000, np.array(cpus) * 1000


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--launches", type=int, default=2000)
    p.add_argument("--frames", type=int, default=81)
    p.add_argument("--size", default="832x480")
    args = p.parse_args(argv)
    from omnirt.stages.diffusion.media import png
    from omnirt.stages.diffusion.video_io import encode_mp4

    device = torch.device(args.device)
    width, height = (int(v) for v in args.size.split("x"))
    rng = np.random.default_rng(0)
    video = rng.integers(0, 255, (args.frames, height, width, 3), dtype=np.uint8)
    image = rng.integers(0, 255, (1024, 1024, 3), dtype=np.uint8)
    step = step_fn(device, args.launches)
    for _ in range(5):
        step()
    cpus = os.sched_getaffinity(0)
    print(f"# A host-bound step beside media encoding ({device}, {len(cpus)} CPUs, "
          f"{torch.get_num_threads()} torch threads, {args.launches} launches a step)\n")

    def nice() -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)

    engine_cpu = min(cpus)
    siblings = Path(f"/sys/devices/system/cpu/cpu{engine_cpu}/topology/thread_siblings_list")
    spared = {engine_cpu}
    if siblings.exists():
        for part in siblings.read_text().strip().split(","):
            lo, _, hi = part.partition("-")
            spared |= set(range(int(lo), int(hi or lo) + 1))

    def elsewhere() -> None:
        os.sched_setaffinity(0, (cpus - spared) or cpus)  # this thread (and what it starts)

    ways: list[tuple[str, Callable[[], object] | None, Callable[[], None] | None, bool]] = [
        ("alone", None, None, False),
        ("beside an MP4 encode (media thread, as today)", lambda: encode_mp4(video, 16), None, False),
        ("beside an MP4 encode, media thread at nice 10", lambda: encode_mp4(video, 16), nice, False),
        ("beside an MP4 encode, media thread off the engine's core", lambda: encode_mp4(video, 16), elsewhere,
         True),
        ("beside a PNG encode (media thread, as today)", lambda: [png(image) for _ in range(4)], None, False),
        ("beside a PNG encode, media thread at nice 10", lambda: [png(image) for _ in range(4)], nice, False),
    ]  # fmt: skip
    print("| way | steps | wall p50 / p99 (ms) | CPU p50 / p99 (ms) | wall p50 vs alone |")
    print("|---|---|---|---|---|")
    base = None
    for name, work, init, pin in ways:
        if pin:
            os.sched_setaffinity(0, spared)  # the engine thread on its own core
        pool = ThreadPoolExecutor(1, initializer=init) if work is not None else None
        future = pool.submit(work) if pool is not None else None
        wall, cpu = time_steps(step, 2.0, lambda f=future: f is not None and not f.done())
        if future is not None:
            future.result()
            pool.shutdown()
        if pin:
            os.sched_setaffinity(0, cpus)
        p50 = float(np.percentile(wall, 50))
        base = base or p50
        print(
            f"| {name} | {len(wall)} | {p50:.2f} / {np.percentile(wall, 99):.2f} | "
            f"{np.percentile(cpu, 50):.2f} / {np.percentile(cpu, 99):.2f} | {p50 / base:.2f}x |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
