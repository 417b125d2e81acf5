"""The W8A8 products alone, at the linear layers' shapes of a DiT step (Z-Image 1024x1024, Wan 1.3B
and 14B at 480p, 81 frames): time and TFLOP/s of each way to compute ``x @ W.T`` against bf16's.

Rows per shape (``M`` tokens, ``N`` outputs, ``K`` inputs; the activations already quantized,
as a fused norm or gated unit hands them over):
- ``bf16``: ``torch.nn.functional.linear`` on bf16 operands (cuBLAS), the baseline;
- ``fp8 _scaled_mm row-wise``: the library's fp8 product (``w8a8.GEMM`` ``library``: a scale a
  token and a scale an output channel);
- ``fp8 _scaled_mm tensor-wise``: one scale each side (cuBLAS's fp8 GEMM): what the tensor cores
  give without row-wise scales, for reference;
- ``int8 _int_mm + epilogue``: the library's int8 product (an int32 product, then a kernel applying
  the scales and the bias), and ``_int_mm`` alone;
- ``Triton``: ``kernels/w8a8_gemm.py``, the scales and bias in the GEMM's epilogue, at each tile
  configuration of ``w8a8_gemm.CONFIGS`` (the fastest shown, with its name) and at the module's
  choice for the shape (``config_for``);
- ``as the layers run it``: ``w8a8.w8a8_linear`` with its default GEMM (``auto``: Triton's on Hopper).

Z-Image's merged ``w13`` also gets the gated unit's rows (``w13 + gated unit``: ``w2``'s input
made from ``x``, as ``stages/diffusion/fused.py`` runs it): bf16 (the product, then the gated
kernel), and per kind the Triton product, then the gated kernel writing ``w2``'s input quantized
(``swiglu.GATED_EPILOGUE`` off), against the gated unit in the GEMM's epilogue, then a pass
quantizing it (on, the default), checked bitwise against the first; and that GEMM alone at each
TMA tile configuration 256 columns wide (128 of each half).

The Triton rows are checked against the library's: int8 bitwise, fp8 by the largest difference
relative to the output's peak.

    python benchmarks/w8a8_gemm.py [--models zimage,wan1.3b,wan14b] [--all-configs]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def bench(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=5, rep=50, return_mode="median"))


def shapes(model: str) -> list[tuple[str, int, int, int]]:
    """``(layer, M, N, K)`` of the model's W8A8 products at its benchmark size (the merged q|k|v and
    w1|w3 products, as ``stages/diffusion/fused.py`` runs them), from the published configs."""
    if model == "zimage":
        cfg = json.loads((ROOT / "benchmarks/models/z-image-turbo/z-image-turbo.components.json").read_text())
        dim = cfg["transformer"]["dim"]
        hidden = int(dim / 3 * 8)
        m = 4096 + 32  # 1024x1024 in 2x2 patches, and a caption padded to 32
        return [("to_qkv", m, 3 * dim, dim), ("to_out", m, dim, dim), ("w13", m, 2 * hidden, dim),
                ("w2", m, dim, hidden)]  # fmt: skip
    cfg = json.loads((ROOT / "benchmarks/models/wan2.1-t2v/wan2.1-t2v.components.json").read_text())
    t = cfg["transformer_1.3b" if model == "wan1.3b" else "transformer_14b"]
    dim = t["num_attention_heads"] * t["attention_head_dim"]
    m = 21 * 30 * 52  # 480p, 81 frames: 21 latent frames of 60 x 104 in 2x2 patches
    return [("self qkv", m, 3 * dim, dim), ("self out", m, dim, dim), ("cross q", m, dim, dim),
            ("ffn up", m, t["ffn_dim"], dim), ("ffn down", m, dim, t["ffn_dim"])]  # fmt: skip


def rows_for(model: str, all_configs: bool) -> list[str]:
    out = []
    for layer, m, n, k in shapes(model):
        out += shape_rows(f"{model} {layer} {m}x{n}x{k}", m, n, k, all_configs)
        if layer == "w13":
            out += gated_rows(f"{model} w13 + gated unit {m}x{n}x{k}", m, n, k)
    return out


def gated_rows(label: str, m: int, n: int, k: int) -> list[str]:
    """``w2``'s input from ``x`` through the merged gate and up product ``[M, n]`` and the gated
    unit: bf16, then per kind with the gated unit apart and in the GEMM's epilogue."""
    from omnirt.kernels import swiglu, w8a8, w8a8_gemm

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k**-0.5
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g)
    h = n // 2

    def bf16() -> torch.Tensor:
        gate_up = torch.nn.functional.linear(x, w, bias)
        return swiglu.swiglu(gate_up[:, :h], gate_up[:, h:])

    base = bench(bf16)
    row = functools.partial(_row, label, 2.0 * m * n * k, base)
    out = [row("bf16: product, then the gated kernel", base)]
    for kind in ("fp8", "int8"):
        xq, xs = w8a8.quantize_rows_triton(x, kind)
        wq, ws = w8a8.quantize_rows(w, kind)
        q = w8a8.QuantizedRows(xq, xs, kind, (m, k), x.dtype)

        def run(q=q, wq=wq, ws=ws, kind=kind):
            return swiglu.swiglu_w8a8(q, wq, ws, bias, kind, kind)

        with w8a8.gemm_as("triton", (kind,)):
            try:
                swiglu.GATED_EPILOGUE = False
                apart, apart_ms = run(), bench(run)
            finally:
                swiglu.GATED_EPILOGUE = True
            fused, fused_ms = run(), bench(run)
        same = torch.equal(fused.scale, apart.scale) and torch.equal(
            fused.values.view(torch.uint8), apart.values.view(torch.uint8)
        )
        out.append(row(f"{kind}: Triton product, then the gated kernel quantizing", apart_ms))
        check = "bitwise" if same else "differs"
        out.append(row(f"**{kind}: gated unit in the GEMM's epilogue, then quantized**", fused_ms, check))
        for cfg in [c for c in w8a8_gemm.CONFIGS if c.tma and c.bn == 256]:  # each half's 128 columns
            cfg = dataclasses.replace(cfg, bn=cfg.bn // 2)
            alone = bench(lambda xq=xq, xs=xs, wq=wq, ws=ws, cfg=cfg: w8a8_gemm.w8a8_gemm(
                xq, xs, wq, ws, bias, x.dtype, config=cfg, gated=True))  # fmt: skip
            out.append(row(f"{kind}: the gated GEMM alone, {cfg.name()}", alone))
    return out


def shape_rows(label: str, m: int, n: int, k: int, all_configs: bool) -> list[str]:
    """The rows of one product: bf16, then each kind as run and by the Triton GEMM."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k**-0.5
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g)
    base = bench(lambda: torch.nn.functional.linear(x, w, bias))
    row = functools.partial(_row, label, 2.0 * m * n * k, base)
    out = [row("bf16", base)]
    for kind in ("fp8", "int8"):
        out += kind_rows(row, label, x, w, bias, kind, all_configs)
    return out


def _row(label: str, flop: float, base: float, name: str, ms: float, check: str = "") -> str:
    return f"| {label} | {name} | {ms:.3f} | {flop / ms / 1e9:.0f} | {base / ms:.2f}x | {check} |"


def kind_rows(row, label: str, x, w, bias, kind: str, all_configs: bool) -> list[str]:
    from omnirt.kernels import w8a8, w8a8_gemm

    (m, k), n = x.shape, w.shape[0]
    xq, xs = w8a8.quantize_rows_triton(x, kind)
    wq, ws = w8a8.quantize_rows(w, kind)
    q = w8a8.QuantizedRows(xq, xs, kind, (m, k), x.dtype)
    with w8a8.gemm_as("library", (kind,)):  # the library's products: the reference and their rows
        want = w8a8.w8a8_linear(q, wq, ws, bias, kind)
        library = bench(lambda: w8a8.w8a8_linear(q, wq, ws, bias, kind))
    out = []
    if kind == "fp8":
        one = torch.ones((), device="cuda")
        out.append(row("fp8 _scaled_mm row-wise (library)", library))
        ms = bench(lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one, out_dtype=x.dtype))
        out.append(row("fp8 _scaled_mm tensor-wise, no bias", ms))
    else:
        out.append(row("int8 _int_mm + epilogue (library)", library))
        out.append(row("int8 _int_mm alone", bench(lambda: torch._int_mm(xq, wq.t()))))
    peak = want.float().abs().max().item()

    def gemm(cfg=None):
        return w8a8_gemm.w8a8_gemm(xq, xs, wq, ws, bias, x.dtype, config=cfg)

    timed = []
    for cfg in w8a8_gemm.CONFIGS:
        try:
            got = gemm(cfg)
            ms = bench(functools.partial(gemm, cfg))
        except Exception as e:  # a tile too large for the card's shared memory
            out.append(f"| {label} | {kind} Triton {cfg.name()} | failed: {str(e).splitlines()[0][:60]} |")
            continue
        if kind == "int8":
            check = "bitwise" if torch.equal(got, want) else f"{(got != want).sum().item()} differ"
        else:
            check = f"max diff / peak {(got.float() - want.float()).abs().max().item() / peak:.1e}"
        timed.append((ms, cfg, check))
        if all_configs:
            out.append(row(f"{kind} Triton {cfg.name()}", ms, check))
    if timed:
        ms, cfg, check = min(timed, key=lambda item: item[0])
        out.append(row(f"**{kind} Triton, fastest: {cfg.name()}**", ms, check))
    chosen = w8a8_gemm.config_for(kind, m, n, k)
    out.append(row(f"{kind} Triton as chosen ({chosen.name()})", bench(gemm)))
    as_run = bench(lambda: w8a8.w8a8_linear(q, wq, ws, bias, kind))
    out.append(row(f"{kind} as the layers run it (GEMM {w8a8.GEMM[kind]})", as_run))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="zimage,wan1.3b,wan14b")
    p.add_argument("--all-configs", action="store_true", help="a row per Triton tile configuration")
    args = p.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    if any(m not in ("zimage", "wan1.3b", "wan14b") for m in models):
        p.error("--models are zimage, wan1.3b, wan14b")
    if not torch.cuda.is_available():
        print("benchmarks/w8a8_gemm.py needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"# W8A8 products: {torch.cuda.get_device_name()} (torch {torch.__version__})\n")
    print("| product (M x N x K) | how | ms | TFLOP/s | vs bf16 | check |\n|---|---|---|---|---|---|")
    for model in models:
        print("\n".join(rows_for(model, args.all_configs)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
