"""Duplex capacity: the 80 ms tick of N full-duplex sessions at a given conversation length.

Builds the Moshi 7B LM (``MoshiConfig()`` defaults) with seeded random weights on the device
(bf16; ``stages/duplex/loader.py``'s ``dummy_weights``, shared by every LM built here) and a
Mimi pool (default ``MimiConfig``, 8 quantizers, fp32 as served, random weights, CUDA graphs
through ``capture_mimi``). For each KV storage (``--kv-dtypes``: ``auto`` = bf16, ``fp8``) and
each conversation length L (``--frames``), one ``DuplexLM`` is built whose window is L frames
(``--max-frames`` fixes one window for all: the serving option ``--duplex-max-frames``) with as
many slots as the largest ``--sessions`` level, or as fit in free memory beside the weights, the
Mimi pool and ``--reserve-gib`` (levels that do not fit are listed as such).

**Fast-forward.** Stepping 3000 ticks per level would cost minutes of GPU time, so each slot is
started and put straight at step L - 1 of its conversation (``DuplexLM.fast_forward``: position
and step count; the KV cache keeps what it holds, zeros here: attention costs the same whatever
the values). The timed ticks then attend to L entries per slot (the ring stays full), exactly the
work of a conversation L frames long.

**A tick** (all N rows active, random user audio): Mimi encode of N frames -> ``lm.step``
(temporal transformer, text sampling, the whole depth loop with its sampling) -> Mimi decode of
the N frames, ``torch.cuda.synchronize()`` at its end; ``--ticks`` timed ticks after
``--warmup``. Per row: LM and Mimi device time (CUDA events around each part), and the tick's
wall time (total), p50/p99, and the speed-up of the total p50 against ``eager`` at the same
level (the baseline, measured in the same run). Modes (``--modes``): ``graphs`` (the step
replayed from one CUDA graph, decode-attention kernel), ``eager`` (the same step launched op by
op), ``torch`` (graphs, attention by the masked matmul-softmax reference over the window instead
of the kernel; skipped where its temporaries would not fit).

``--attention-probe`` first times the decode-attention kernel alone on one layer's cache at the
config's shapes (N slots, L entries each, bf16 and fp8) for a few launch configurations (entries
per block, warps, pipeline stages) against the torch reference, with the bandwidth it reaches
(bytes of the valid keys, values and scales read once / time; the H200 peaks at 4.8 TB/s).

Then: peak GPU memory per LM; memory per session against conversation length (KV bytes per
session at 375/750/1500/3000 frames per storage, and how many sessions fit in ``--gpu-gib``
beside the weights and the reserve); at the end the largest N whose p99 total tick is under
80 ms, per storage, length and mode, against the goals (at least 128 sessions under 80 ms, 32
under 35 ms).

On the H200 (about 4 minutes; ``--time-budget`` skips what would not end in time)::

    python benchmarks/duplex_capacity.py --sessions 1 8 32 64 128 192 --frames 1500 3000 \\
        --kv-dtypes auto fp8 --modes graphs eager torch --ticks 30 --attention-probe --time-budget 240

Checked on CPU with a tiny config::

    python benchmarks/duplex_capacity.py --config tiny --device cpu --sessions 1 4 --frames 16 32 --ticks 3
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from omnirt.codecs.mimi import MimiCodecConfig, MimiSlotPool, build_mimi
from omnirt.codecs.mimi.reference import TINY_MIMI, random_reference_model
from omnirt.kernels import decode_attention as attention
from omnirt.stages.codec_graphs import capture_mimi
from omnirt.stages.duplex.lm import KV_DTYPES, DuplexLM, DuplexSampling
from omnirt.stages.duplex.loader import dummy_weights
from transformers import MoshiConfig

log = logging.getLogger("duplex_capacity")

MODES = ("graphs", "eager", "torch")
FRAME_MS = 80.0
#: Conversation lengths of the memory table (30 s, 1, 2 and 4 minutes).
MEMORY_FRAMES = (375, 750, 1500, 3000)
GOALS = ((128, 80.0), (32, 35.0))
GIB = 2**30


def moshi_config(name: str) -> MoshiConfig:
    """``moshi-7b``: ``MoshiConfig()`` (Moshi 7B); ``tiny``: a toy config for CPU smoke runs."""
    if name == "moshi-7b":
        return MoshiConfig()
    return MoshiConfig(
        vocab_size=96,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        ffn_dim=128,
        max_position_embeddings=64,
        sliding_window=64,
        num_codebooks=8,
        audio_encoder_config=dict(TINY_MIMI),
        depth_decoder_config={
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "ffn_dim": 64,
        },
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _p(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


@dataclass
class Level:
    kv: str
    frames: int
    window: int
    sessions: int
    mode: str
    lm_ms: list[float] = field(default_factory=list)
    mimi_ms: list[float] = field(default_factory=list)
    total_ms: list[float] = field(default_factory=list)
    note: str = ""

    @property
    def p99(self) -> float:
        return _p(self.total_ms, 99)


class Ticker:
    """Drives ticks of N sessions through a Mimi pool and an LM."""

    def __init__(self, lm: DuplexLM, pool: MimiSlotPool, sessions: int, seed: int) -> None:
        self.lm, self.pool, self.n = lm, pool, sessions
        device = lm.device
        generator = torch.Generator(device=device).manual_seed(seed)
        self.audio = 0.1 * torch.randn((sessions, pool.model.frame_size), generator=generator, device=device)
        self.exec = torch.ones(sessions, dtype=torch.bool, device=device)
        self.active = torch.ones(sessions, dtype=torch.bool)  # host mask, as the pipeline passes it
        self.timed = device.type == "cuda"

    def tick(self) -> tuple[float, float, float]:
        """One tick: (LM ms, Mimi ms, total wall ms)."""
        device = self.lm.device
        begin = time.perf_counter()
        if self.timed:
            events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            events[0].record()
        codes = self.pool.encode(self.audio, self.exec)  # [N, K, 1]
        if self.timed:
            events[1].record()
        else:
            lm_begin = time.perf_counter()
        step = self.lm.step(codes[:, :, 0], self.active)
        if self.timed:
            events[2].record()
        else:
            lm_end = time.perf_counter()
        self.pool.decode(step.audio[:, :, None], self.exec)
        if self.timed:
            events[3].record()
        _sync(device)
        total = (time.perf_counter() - begin) * 1e3
        if self.timed:
            lm = events[1].elapsed_time(events[2])
            mimi = events[0].elapsed_time(events[1]) + events[2].elapsed_time(events[3])
        else:
            lm = (lm_end - lm_begin) * 1e3
            mimi = total - lm
        return lm, mimi, total


def build_pool(
    args: argparse.Namespace, device: torch.device, max_slots: int, buckets: list[int]
) -> MimiSlotPool:
    kwargs = dict(TINY_MIMI) if args.config == "tiny" else {"num_quantizers": 8}
    reference = random_reference_model(seed=args.seed, **kwargs)
    config = MimiCodecConfig.from_dict(reference.config.to_dict())
    state = {k: v.detach() for k, v in reference.state_dict().items()}
    del reference
    mimi = build_mimi(config, state, num_quantizers=8, device=device)
    pool = MimiSlotPool(mimi, max_slots, buckets=buckets, check_codes=False)
    capture_mimi(pool)
    return pool


def fit_slots(per_slot: int, free: int, reserve: int) -> int:
    return max(0, (free - reserve) // per_slot)


def torch_attention_bytes(lm: DuplexLM, sessions: int, attend: int) -> int:
    """Temporaries of one layer's reference attention: the gathered (and, for fp8, widened)
    keys and values, the expanded mask, fp32 scores and probabilities."""
    config = lm.config
    elems = sessions * config.num_attention_heads * attend
    width = lm.dtype.itemsize
    return 2 * elems * config.head_dim * width * 2 + elems * (width + 8)


def _torch_fits(lm: DuplexLM, sessions: int, attend: int) -> bool:
    if lm.device.type != "cuda":
        return True
    return torch_attention_bytes(lm, sessions, attend) < torch.cuda.mem_get_info(lm.device)[0] - GIB


def run_level(lm: DuplexLM, pool: MimiSlotPool, level: Level, args: argparse.Namespace) -> None:
    n, frames = level.sessions, level.frames
    for slot in range(n):
        lm.fast_forward(slot, frames - 1)
    attend = min(frames, level.window)
    lm.set_attention_kernel(level.mode != "torch")
    lm.use_graphs(level.mode != "eager")
    if level.mode != "eager":
        lm.capture(batches=[n], lengths=[attend])
    ticker = Ticker(lm, pool, n, args.seed + n)
    for _ in range(args.warmup):
        ticker.tick()
    if lm.device.type == "cuda" and level.mode != "eager" and lm.last_path != "graph":
        raise RuntimeError(f"mode {level.mode}: the LM step did not replay a graph")
    for _ in range(args.ticks):
        lm_ms, mimi_ms, total = ticker.tick()
        level.lm_ms.append(lm_ms)
        level.mimi_ms.append(mimi_ms)
        level.total_ms.append(total)


HEADER = (
    "| KV | frames | window | N | mode | LM p50 | LM p99 | Mimi p50 | Mimi p99 | total p50 | total p99 "
    "| x eager (p50) |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def row(level: Level, eager: Level | None) -> str:
    head = f"| {level.kv} | {level.frames} | {level.window} | {level.sessions} | {level.mode} |"
    if level.note:
        return f"{head} {level.note} |||||||"
    ratio = ""
    if eager is not None and eager.total_ms:
        ratio = f"{_p(eager.total_ms, 50) / _p(level.total_ms, 50):.2f}"
    cells = [
        _p(level.lm_ms, 50),
        _p(level.lm_ms, 99),
        _p(level.mimi_ms, 50),
        _p(level.mimi_ms, 99),
        _p(level.total_ms, 50),
        _p(level.total_ms, 99),
    ]
    return head + "".join(f" {c:.1f} |" for c in cells) + f" {ratio} |"


def memory_table(config: MoshiConfig, dtype: torch.dtype, weights: int, total: int, reserve: int) -> str:
    name = str(dtype).removeprefix("torch.")
    lines = [
        f"Memory per session (window = conversation length; {total / GIB:.0f} GiB, weights "
        f"{weights / GIB:.1f} GiB, reserve {reserve / GIB:.0f} GiB):\n",
        f"| frames | minutes | {name} KV / session | fp8 KV / session | sessions fit ({name}) "
        "| sessions fit (fp8) |",
        "|---|---|---|---|---|---|",
    ]
    room = total - weights - reserve
    for frames in MEMORY_FRAMES:
        per = {kv: DuplexLM.kv_bytes_per_frame(config, kv, dtype) * (frames + 1) for kv in KV_DTYPES}
        lines.append(
            f"| {frames} | {frames * FRAME_MS / 60_000:.1f} | {per['auto'] / GIB:.3f} GiB | "
            f"{per['fp8'] / GIB:.3f} GiB | {max(0, room // per['auto'])} | {max(0, room // per['fp8'])} |"
        )
    return "\n".join(lines)


#: Launch configurations the probe times: (entries per block, warps, stages).
PROBE_LAUNCHES = ((64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 4, 2), (128, 4, 3), (128, 8, 3), (32, 4, 4))


def _cuda_ms(fn, iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def attention_probe(config: MoshiConfig, device: torch.device, sessions: list[int], frames: int) -> str:
    """The kernel alone on one layer's cache (module doc): a table of ms and GB/s."""
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    scale = 1 / math.sqrt(dim)
    lines = [
        f"Decode attention alone, one layer, {frames} entries per slot ({heads} heads of {dim}); "
        "ms and GB/s per launch (entries per block, warps, stages):\n",
        "| KV | N | torch | " + " | ".join(f"{b}/{w}/{s}" for b, w, s in PROBE_LAUNCHES) + " | best GB/s |",
        "|---|---|---|" + "---|" * len(PROBE_LAUNCHES) + "---|",
    ]
    generator = torch.Generator(device=device).manual_seed(0)
    for kv in KV_DTYPES:
        for n in sessions:
            shape = (n, kv_heads, frames + 1, dim)
            keys = torch.randn(shape, generator=generator, device=device, dtype=torch.bfloat16)
            values = torch.randn(shape, generator=generator, device=device, dtype=torch.bfloat16)
            k_scale = v_scale = None
            if kv == "fp8":
                keys, k_scale = attention.quantize_kv(keys)
                values, v_scale = attention.quantize_kv(values)
            q = torch.randn((n, heads, dim), generator=generator, device=device, dtype=torch.bfloat16)
            lengths = torch.full((n,), frames, device=device)
            per_entry = dim * keys.element_size() + (4 if kv == "fp8" else 0)
            read = 2 * n * kv_heads * frames * per_entry
            args = (q, keys, values, lengths, frames, scale, k_scale, v_scale)
            cells = []
            try:
                ref = _cuda_ms(lambda args=args: attention.decode_attention_reference(*args), iters=5)
                cells.append(f"{ref:.3f}")
            except torch.cuda.OutOfMemoryError:
                cells.append("OOM")
            best = 0.0
            for launch in PROBE_LAUNCHES:
                ms = _cuda_ms(
                    lambda launch=launch, args=args: attention.decode_attention_triton(*args, launch=launch)
                )
                best = max(best, read / ms / 1e6)
                cells.append(f"{ms:.3f} ({read / ms / 1e6:.0f})")
            lines.append(f"| {kv} | {n} | " + " | ".join(cells) + f" | {best:.0f} |")
            del keys, values, k_scale, v_scale, q
            torch.cuda.empty_cache()
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=("moshi-7b", "tiny"), default="moshi-7b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 8, 32, 64, 128, 192])
    parser.add_argument("--frames", type=int, nargs="+", default=[1500, 3000], help="conversation lengths")
    parser.add_argument("--max-frames", type=int, default=None, help="one window for all (default: L)")
    parser.add_argument("--kv-dtypes", nargs="+", choices=KV_DTYPES, default=list(KV_DTYPES))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--ticks", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reserve-gib", type=float, default=8.0, help="kept free beside weights and KV")
    parser.add_argument(
        "--gpu-gib", type=float, default=None, help="memory table total (default: the device's)"
    )
    parser.add_argument("--time-budget", type=float, default=0.0, help="seconds; 0: no limit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--attention-probe", action="store_true", help="time the attention kernel alone first (CUDA)"
    )
    args = parser.parse_args(argv)
    if min(args.sessions) < 1 or min(args.frames) < 2 or args.ticks < 1:
        parser.error("--sessions >= 1, --frames >= 2 and --ticks >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    args = parse_args(argv)
    started = time.perf_counter()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = moshi_config(args.config)
    levels = sorted(set(args.sessions))
    torch.set_grad_enabled(False)

    weights = dummy_weights(config, device=device, dtype=dtype, seed=args.seed)
    weight_bytes = sum(p.numel() * p.element_size() for p in weights.parameters())
    pool = build_pool(args, device, max(levels), levels)
    if device.type == "cuda":
        total_memory = torch.cuda.get_device_properties(device).total_memory
    else:
        total_memory = 139 * GIB  # the H200's, for the table
    table_total = int(args.gpu_gib * GIB) if args.gpu_gib else total_memory
    reserve = int(args.reserve_gib * GIB)

    print(f"# Duplex capacity: {args.config}, {str(dtype).removeprefix('torch.')} weights on {device}\n")
    print(
        f"- weights {weight_bytes / GIB:.2f} GiB; Mimi pool {len(levels)} buckets up to {max(levels)} "
        f"rows; {args.ticks} timed ticks after {args.warmup}; times in ms"
    )
    print(f"- modes: {', '.join(args.modes)}; each tick all N rows active, synchronized at its end\n")
    if args.attention_probe:
        if device.type == "cuda":
            probe_sessions = sorted({n for n in (1, 32, 128) if n <= max(levels)} | {max(levels)})
            print(attention_probe(config, device, probe_sessions, max(args.frames)), "\n", flush=True)
        else:
            print("(--attention-probe: CUDA only)\n")
    print(HEADER, flush=True)

    results: list[Level] = []
    peaks: list[str] = []
    for kv in args.kv_dtypes:
        for frames in args.frames:
            window = args.max_frames or frames
            per_slot = DuplexLM.kv_bytes_per_frame(config, kv, dtype) * (window + 1)
            free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else total_memory
            slots = min(max(levels), fit_slots(per_slot, free, reserve))
            lm = None
            if slots >= 1:
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                lm = DuplexLM(
                    weights,
                    config,
                    max_slots=slots,
                    device=device,
                    dtype=dtype,
                    max_frames=window,
                    kv_dtype=kv,
                )
                sampling = DuplexSampling(seed=args.seed)
                for slot in range(slots):
                    lm.start(slot, sampling)
            for n in levels:
                eager: Level | None = None
                for mode in args.modes:
                    level = Level(kv, frames, window, n, mode)
                    elapsed = time.perf_counter() - started
                    if lm is None or n > slots:
                        level.note = f"does not fit ({slots} slots of {per_slot / GIB:.2f} GiB fit)"
                    elif args.time_budget and elapsed > args.time_budget:
                        level.note = f"skipped: --time-budget {args.time_budget:g} s"
                    elif mode == "torch" and not _torch_fits(lm, n, min(frames, window)):
                        level.note = "skipped: the reference attention's temporaries do not fit"
                    else:
                        try:
                            run_level(lm, pool, level, args)
                        except torch.cuda.OutOfMemoryError:
                            level.note = "out of memory"
                            level.total_ms.clear()
                    if mode == "eager":
                        eager = level
                    results.append(level)
                # the eager baseline may come after the others in --modes: print once it is known
                for level in results[-len(args.modes) :]:
                    print(row(level, eager), flush=True)
            if lm is not None:
                if device.type == "cuda":
                    peak = torch.cuda.max_memory_allocated(device) / GIB
                    peaks.append(
                        f"- {kv} KV, window {window}: {slots} slots, KV {lm.kv_bytes / GIB:.1f} GiB, "
                        f"peak {peak:.1f} GiB"
                    )
                del lm
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()

    print()
    if peaks:
        print("Peak GPU memory (weights, Mimi pool, KV, graphs):\n")
        print("\n".join(peaks))
        print()
    print(memory_table(config, dtype, weight_bytes, table_total, reserve))
    print("\nLargest N with p99 total tick < 80 ms:\n")
    best: dict[tuple[str, int, str], int] = {}
    for level in results:
        key = (level.kv, level.frames, level.mode)
        if level.total_ms and level.p99 < FRAME_MS:
            best[key] = max(best.get(key, 0), level.sessions)
        else:
            best.setdefault(key, 0)
    for (kv, frames, mode), n in best.items():
        print(f"- {kv} KV, {frames} frames, {mode}: {n if n else 'none'}")
    print("\nGoals (graphs mode, any KV storage and length measured):\n")
    for sessions, limit in GOALS:
        met = [
            f"{lv.kv}/{lv.frames}: p99 {lv.p99:.1f} ms"
            for lv in results
            if lv.mode == "graphs" and lv.sessions == sessions and lv.total_ms
        ]
        print(f"- {sessions} sessions, p99 < {limit:g} ms: {'; '.join(met) if met else 'not measured'}")
    print(f"\n(ran {time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
