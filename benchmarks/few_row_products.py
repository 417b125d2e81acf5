"""The code predictor's and talker's products at a decode step's few rows: cuBLAS (``F.linear``, the
down product after the gated-unit kernel, as ``stages/speech/merged.py`` runs them) against
``kernels/gemv.py`` (one launch, the gated unit read in), each timed as the mean of a CUDA graph of
``--calls`` back-to-back calls (a graphed decode step runs them so), bf16, random weights of the
published config's shapes.

    python benchmarks/few_row_products.py [--rows 1 8] [--calls 50] [--launches 16,256,4,3,1 16,256,4,3,2]

Prints a table: microseconds a call, the kernel's best launch against cuBLAS, and the largest
difference from cuBLAS relative to the output's largest magnitude.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from omnirt.kernels.gemv import gemv
from omnirt.kernels.swiglu import swiglu

CONFIG = Path(__file__).resolve().parent / "models" / "qwen3-omni-30b-a3b-instruct" / "config.json"


def shapes(config: dict) -> list[tuple[str, int, int, bool]]:
    """(name, N, K, gated) of the code predictor's and the talker's attention products."""
    talker = config["talker_config"]
    cp, text = talker["code_predictor_config"], talker["text_config"]
    out = []
    for name, c in (("code predictor", cp), ("talker", text)):
        hidden, dim = c["hidden_size"], c["head_dim"]
        heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
        out.append((f"{name} qkv", (heads + 2 * kv) * dim, hidden, False))
        out.append((f"{name} o", hidden, heads * dim, False))
    out.append(("code predictor head", cp["vocab_size"], cp["hidden_size"], False))
    thinker = config["thinker_config"]["text_config"]
    hidden, dim, heads = thinker["hidden_size"], thinker["head_dim"], thinker["num_attention_heads"]
    out.append(("thinker o", hidden, heads * dim, False))
    inner = cp["intermediate_size"]
    out.append(("code predictor gate_up", 2 * inner, cp["hidden_size"], False))
    out.append(("code predictor down (gated)", cp["hidden_size"], inner, True))
    return out


def timed(fn, calls: int) -> float:
    """Mean microseconds of one call, from a CUDA graph of ``calls`` calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / calls)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--launches", nargs="+", default=["16,256,4,3", "32,256,4,3", "16,128,4,4"])
    ap.add_argument("--config", type=Path, default=CONFIG)
    args = ap.parse_args()
    launches = [tuple(int(v) for v in s.split(",")) for s in args.launches]
    config = json.loads(args.config.read_text())
    for rows in args.rows:
        table(config, rows, launches, args.calls)


def table(config: dict, rows: int, launches: list[tuple[int, ...]], calls: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"\n# Few-row products, {rows} rows, bf16, {torch.cuda.get_device_name()}\n")
    head = " | ".join(f"kernel {','.join(map(str, launch))} (us)" for launch in launches)
    print(f"| product | N x K | cuBLAS (us) | {head} | best vs cuBLAS | max diff / max |")
    print("|---|---|---|" + "---|" * len(launches) + "---|---|")
    for name, n, k, gated in shapes(config):
        x = torch.randn(rows, 2 * k if gated else k, device="cuda", generator=g).to(torch.bfloat16)
        w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
        if gated:
            def base(x=x, w=w, k=k):
                return F.linear(swiglu(x[:, :k], x[:, k:]), w)
        else:
            def base(x=x, w=w):
                return F.linear(x, w)
        want = base()
        base_us = timed(base, calls)
        cells, errors = [], []
        for launch in launches:
            got = gemv(x, w, gated=gated, launch=launch)
            errors.append(((got.float() - want.float()).abs().max() / want.float().abs().max()).item())
            def call(x=x, w=w, gated=gated, launch=launch):
                return gemv(x, w, gated=gated, launch=launch)

            cells.append(timed(call, calls))
        best = min(cells)
        row = " | ".join(f"{c:.2f}" for c in cells)
        print(f"| {name} | {n} x {k} | {base_us:.2f} | {row} | {base_us / best:.2f}x | {max(errors):.1e} |")


if __name__ == "__main__":
    main()
