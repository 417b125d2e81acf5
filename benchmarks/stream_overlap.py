"""Speech steps beside a Z-Image transformer running on another CUDA stream (H200 only).

Why the engine shares the GPU between speech and diffusion by time, not by streams: this runs the
speech pipeline at real size (``speech_capacity.py``'s driver, CUDA graphs, N sessions speaking in
turns) while a thread keeps calling the Z-Image DiT (1024x1024, batch 1, branch ``cond``) on a
stream of its own, and prints the speech frame times and the DiT call time against each alone:

- ``alone``: the speech steps on a high-priority stream, nothing beside them;
- ``DiT thread, low priority``: the DiT on a low-priority stream, speech on a high-priority one;
- ``DiT thread, same priority``: both streams at the default priority;
- ``DiT inline``: the DiT launched from the speech thread after each speech step (no wait), on
  the low-priority stream, when the one before it has finished;
- ``DiT thread, green N SMs`` (``--green``): the DiT on a stream of a CUDA green context holding N
  of the GPU's SMs (``torch.cuda.green_contexts``), speech on a high-priority stream of the primary
  context (every SM: those outside the partition are always free for it); "DiT alone" is then
  also timed in each partition.

The speech levels are ``speech_capacity.py``'s (turns of 1 s of audio in, up to 16 thinker tokens
and 48 talker frames out), its device-wide sync replaced by a wait on the speech stream. On the
H200, 2026-12-03 (docs/benchmarks.md)::

    python benchmarks/stream_overlap.py --sessions 8 32
    python benchmarks/stream_overlap.py --sessions 8 --green 116 100 84 --skip-streams
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import speech_capacity as sc  # noqa: E402  (a sibling script, not a package)

MODELS = Path(__file__).resolve().parent / "models"


def _stream_sync(device: torch.device) -> None:
    torch.cuda.current_stream(device).synchronize()


class Background(threading.Thread):
    """Calls ``fn`` in a loop (``calls`` times, or until stopped) on a stream or in a green context,
    timing each call to its stream's end."""

    def __init__(
        self, fn: Callable[[], None], on: torch.cuda.Stream | Green, calls: int | None = None
    ) -> None:
        super().__init__(daemon=True)
        self.fn, self.on, self.calls, self.stop, self.times = fn, on, calls, False, []

    def run(self) -> None:
        if isinstance(self.on, Green):
            stream = self.on.enter()
        else:
            stream = self.on
            torch.cuda.set_stream(stream)
        while not self.stop and (self.calls is None or len(self.times) < self.calls):
            t0 = time.perf_counter()
            self.fn()
            stream.synchronize()
            self.times.append(time.perf_counter() - t0)


class Green:
    """A CUDA green context of ``sms`` SMs of the current device (``torch.cuda.green_contexts``):
    :meth:`enter` makes the context's own stream, whose kernels run on those SMs only, the calling
    thread's current stream (``GreenContext.Stream``: torch 2.11 on the device, 2.13 here)."""

    def __init__(self, sms: int) -> None:
        from torch.cuda.green_contexts import GreenContext

        self.sms = sms
        self.context = GreenContext.create(num_sms=sms, device_id=torch.cuda.current_device())

    def enter(self) -> torch.cuda.Stream:
        stream = self.context.Stream()
        torch.cuda.set_stream(stream)
        return stream


def p(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.array(values) * 1000, q)) if len(values) else float("nan")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--green", type=int, nargs="*", default=[], help="DiT green contexts of these SMs")
    parser.add_argument("--skip-streams", action="store_true", help="only alone and the green cases")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    sc._sync = _stream_sync  # the speech driver waits for its own stream only
    sargs = sc.parse_args([
        "--load-format", "dummy", "--model", str(MODELS / "qwen3-omni-30b-a3b-instruct"),
        "--sessions", *map(str, args.sessions), "--seconds", str(args.seconds), "--level-timeout", "30",
        "--max-output-tokens", "16", "--max-audio-frames", "48",
    ])
    pipe, _ = sc.build(sargs, max(args.sessions))
    from omnirt.stages.diffusion.factory import build_image_pipeline
    from omnirt.stages.diffusion.types import ImageRequest

    image = build_image_pipeline(
        str(MODELS / "z-image-turbo" / "z-image-turbo.components.json"),
        device="cuda",
        load_format="dummy",
        warm_up=False,
    )
    den = image.denoiser
    shape = den.check(ImageRequest("dit", "x"))
    latents = den.init_latents(shape, [torch.Generator("cpu").manual_seed(0)])
    sampler = den.sampler(shape, den.defaults.num_inference_steps)
    cond = den.encode(["a lighthouse on a cliff at dusk, oil painting"])
    torch.cuda.synchronize()

    @torch.no_grad()
    def dit() -> None:
        den.predict(latents, 0, sampler, cond, "cond")

    low, high, normal = torch.cuda.Stream(priority=0), torch.cuda.Stream(priority=-5), torch.cuda.Stream()
    print(f"stream priorities (lowest, highest): {torch.cuda.Stream.priority_range()}")
    with torch.cuda.stream(low):
        for _ in range(3):
            dit()
        alone = []
        for _ in range(10):
            t0 = time.perf_counter()
            dit()
            low.synchronize()
            alone.append(time.perf_counter() - t0)
    print(f"DiT call alone: p50 {p(alone, 50):.1f} ms")
    greens = [Green(sms) for sms in args.green]
    for green in greens:
        timed = Background(dit, green, calls=12)
        timed.start()
        timed.join()
        print(f"DiT call alone in a green context of {green.sms} SMs: p50 {p(timed.times[2:], 50):.1f} ms")
    print()
    driver = sc.Driver(pipe, sargs)
    print("| case | sessions | frame p50 (ms) | frame p99 (ms) | first audio p50 (ms) | first audio p99 (ms) "
          "| frame ticks | DiT calls: p50 (ms), count |")
    print("|---|---|---|---|---|---|---|---|")

    def level(name: str, n: int, speech: torch.cuda.Stream, dit_on: Any = None, inline: bool = False) -> None:
        original = pipe.step
        background, launched = None, []
        if dit_on is not None and not inline:
            background = Background(dit, dit_on)
            background.start()
            time.sleep(0.5)
        if inline:
            def step() -> Any:
                out = original()
                if not launched or launched[-1].query():
                    with torch.cuda.stream(dit_on):
                        dit()
                        event = torch.cuda.Event()
                        event.record()
                    launched.append(event)
                return out

            pipe.step = step
        torch.cuda.set_stream(speech)
        try:
            lv, _ = driver.run("graphs", n, args.seconds)
        finally:
            torch.cuda.set_stream(torch.cuda.default_stream())
            pipe.step = original
        calls = ""
        if background is not None:
            background.stop = True
            background.join()
            calls = f"{p(background.times[1:], 50):.1f}, {len(background.times)}"
        if inline:
            torch.cuda.synchronize()
            calls = f"-, {len(launched)}"
        print(
            f"| {name} | {n} | {p(lv.tick_walls, 50):.1f} | {p(lv.tick_walls, 99):.1f} | "
            f"{p(lv.first_audio, 50):.1f} | {p(lv.first_audio, 99):.1f} | {len(lv.tick_walls)} | {calls} |",
            flush=True,
        )

    for n in args.sessions:
        level("alone", n, high)
        if not args.skip_streams:
            level("DiT thread, low priority", n, high, low)
            level("DiT thread, same priority", n, normal, low)
            level("DiT inline, low priority", n, high, low, inline=True)
        for green in greens:
            level(f"DiT thread, green {green.sms} SMs", n, high, green)
        level("alone (again)", n, high)
    return 0


if __name__ == "__main__":
    sys.exit(main())
