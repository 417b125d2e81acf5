"""Per-tick time of Mimi encode + decode of one frame for every session at once.

One tick = encode one 1920-sample frame and decode one frame of codes for each of N sessions
(one batch). Paths, all in the same run on the same random weights (default ``MimiConfig``,
``num_quantizers=8``):

* ``transformers``: ``MimiModel`` eager, streaming encode (``use_streaming`` + caches) and decode
  with the attention cache (its convolutions keep no state): the baseline;
* ``ours eager``: ``MimiSlotPool`` without CUDA graphs;
* ``ours graphs``: ``MimiSlotPool`` replaying CUDA graphs captured at bucket N (fp32, and bf16).

GPU times come from CUDA events around each tick (median over ``--iters`` ticks after
``--warmup``); on CPU from ``time.perf_counter``. ``--tiny`` runs a tiny config with few
sessions on CPU, to check the script here.

    python benchmarks/codec_ticks.py                # H200: 1, 8, 32, 128, 256, 512 sessions
    python benchmarks/codec_ticks.py --tiny         # CPU smoke run
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time
from collections.abc import Callable

import torch
from omnirt.codecs.mimi import MimiCodecConfig, MimiSlotPool, build_mimi
from omnirt.codecs.mimi.reference import TINY_MIMI, random_reference_model
from omnirt.stages.codec_graphs import capture_mimi

FULL_SESSIONS = (1, 8, 32, 128, 256, 512)
TINY_SESSIONS = (1, 4, 16)
BUDGET_MS = 10.0


def _timer(device: torch.device, tick: Callable[[], None], warmup: int, iters: int) -> float:
    """Median milliseconds of one tick."""
    for _ in range(warmup):
        tick()
    times: list[float] = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)
        ]
        for start, end in events:
            start.record()
            tick()
            end.record()
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) for start, end in events]
    else:
        for _ in range(iters):
            begin = time.perf_counter()
            tick()
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


class TransformersTick:
    """One streaming tick through transformers' public ``encode``/``decode`` (5.17 and 5.24 APIs)."""

    def __init__(self, model, sessions: int, device: torch.device) -> None:
        from transformers import DynamicCache

        self.model = model
        self.frame = torch.randn(sessions, 1, 1920, device=device) * 0.1
        encode_params = inspect.signature(model.encode).parameters
        decode_params = inspect.signature(model.decode).parameters
        self.enc_cache_arg = (
            "encoder_cache" if "encoder_cache" in encode_params else "encoder_past_key_values"
        )
        self.dec_cache_arg = (
            "decoder_cache" if "decoder_cache" in decode_params else "decoder_past_key_values"
        )
        self.new_cache = lambda: DynamicCache(config=model.config)
        self.enc_cache = self.new_cache()
        self.dec_cache = self.new_cache()
        self.padding_cache = None

    @torch.no_grad()
    def __call__(self) -> None:
        out = self.model.encode(
            self.frame,
            num_quantizers=8,
            use_streaming=True,
            padding_cache=self.padding_cache,
            return_dict=True,
            **{self.enc_cache_arg: self.enc_cache},
        )
        self.padding_cache = out.padding_cache
        self.model.decode(out.audio_codes, return_dict=True, **{self.dec_cache_arg: self.dec_cache})


class OursTick:
    def __init__(self, pool: MimiSlotPool, sessions: int) -> None:
        self.pool = pool
        self.frame = torch.randn(sessions, pool.model.frame_size, device=pool.device) * 0.1
        self.exec = torch.ones(sessions, dtype=torch.bool, device=pool.device)

    def __call__(self) -> None:
        codes = self.pool.encode(self.frame, self.exec)
        self.pool.decode(codes, self.exec)


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    config_kwargs = dict(TINY_MIMI) if args.tiny else {"num_quantizers": 8}
    sessions = args.sessions or (TINY_SESSIONS if args.tiny else FULL_SESSIONS)
    reference = random_reference_model(seed=0, **config_kwargs).to(device)
    config = MimiCodecConfig.from_dict(reference.config.to_dict())
    state = {k: v.detach().cpu() for k, v in reference.state_dict().items()}
    dtypes = [d for d in args.graph_dtypes.split(",") if d]
    columns = ["transformers eager fp32", "ours eager fp32"] + [f"ours graphs {d}" for d in dtypes]
    results: dict[str, dict[int, float]] = {c: {} for c in columns}
    for n in sessions:
        results["transformers eager fp32"][n] = _timer(
            device, TransformersTick(reference, n, device), args.warmup, args.iters
        )
        pool = MimiSlotPool(build_mimi(config, state, device=device), n, check_codes=False)
        results["ours eager fp32"][n] = _timer(device, OursTick(pool, n), args.warmup, args.iters)
        del pool
        for name in dtypes:
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
            model = build_mimi(config, state, device=device, dtype=dtype)
            pool = MimiSlotPool(model, n, buckets=[n], check_codes=False)
            capture_mimi(pool)
            tick = OursTick(pool, n)
            ms = _timer(device, tick, args.warmup, args.iters)
            if device.type == "cuda" and pool.encode_runner.last_path != "graph":
                raise RuntimeError("graph path expected on CUDA")
            results[f"ours graphs {name}"][n] = ms
            del pool, model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"sessions={n}: " + ", ".join(f"{c}={results[c][n]:.3f} ms" for c in columns), flush=True)
    return {"device": str(device), "tiny": args.tiny, "sessions": list(sessions), "results": results}


def profile(args: argparse.Namespace, sessions: int, dtype: torch.dtype) -> str:
    """Top CUDA kernels of eager ticks (the kernels a graph replays), by total device time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    device = torch.device(args.device)
    reference = random_reference_model(seed=0, num_quantizers=8)
    config = MimiCodecConfig.from_dict(reference.config.to_dict())
    model = build_mimi(config, reference.state_dict(), device=device, dtype=dtype)
    tick = OursTick(MimiSlotPool(model, sessions, check_codes=False), sessions)
    for _ in range(3):
        tick()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            tick()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)


def table(report: dict) -> str:
    results = report["results"]
    columns = list(results)
    base = results[columns[0]]
    lines = ["| sessions | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for n in report["sessions"]:
        cells = [f"{base[n]:.2f} ms"]
        for c in columns[1:]:
            cells.append(f"{results[c][n]:.2f} ms ({base[n] / results[c][n]:.1f}x)")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    fits = []
    for c in columns:
        ok = [n for n in report["sessions"] if results[c][n] <= BUDGET_MS]
        fits.append(str(max(ok)) if ok else "none")
    lines.append(f"| max sessions within {BUDGET_MS:g} ms | " + " | ".join(fits) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="tiny config and few sessions (CPU check)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sessions", type=lambda s: tuple(int(x) for x in s.split(",")), default=None)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--graph-dtypes", default="fp32,bf16", help="comma list of fp32,bf16")
    parser.add_argument("--cudnn-benchmark", action="store_true", help="let cuDNN time its conv algorithms")
    parser.add_argument(
        "--matmul-tf32",
        action="store_true",
        help="fp32 matmuls on TF32 tensor cores (convolutions use TF32 already)",
    )
    parser.add_argument("--json", default=None, help="also write the raw numbers here")
    parser.add_argument(
        "--profile", type=int, default=0, help="print top kernels at this many sessions (CUDA)"
    )
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    torch.backends.cuda.matmul.allow_tf32 = args.matmul_tf32
    if args.profile:
        for dtype in (torch.float32, torch.bfloat16):
            print(
                f"## kernels, {args.profile} sessions, {dtype}, 5 ticks\n"
                + profile(args, args.profile, dtype)
            )
        return
    if args.tiny and args.device == "cuda":
        args.device = "cpu"
    report = run(args)
    print(table(report))
    from omnirt.kernels import ring_attention

    kernel = ring_attention.kernel_in_use() if report["device"] != "cpu" else "torch"
    print(f"ring attention: {kernel}; cudnn.benchmark={args.cudnn_benchmark}; matmul TF32={args.matmul_tf32}")
    if report["device"] == "cpu":
        print("(CPU: no CUDA graphs here, the 'graphs' columns ran the eager fallback)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
