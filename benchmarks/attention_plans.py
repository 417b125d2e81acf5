"""cuDNN's fp8 attention plans at the DiTs' self-attention shapes (Z-Image 1024x1024, Wan 1.3B and
14B at 480p, 81 frames), each plan timed, against bf16 attention (SDPA's cuDNN backend, what the
bf16 step runs): does a plan other than cuDNN's first (what ``kernels/fp8_attention.py`` runs)
do the work faster?

Rows per shape: bf16 SDPA; then each of cuDNN's first ``--plans`` fp8 plans (heuristics A, then
the fallback list) that builds and runs, with its time (the best of 20, as the bf16 row's),
TFLOP/s (4 S^2 H D a call) and the largest difference of its output from plan 0's, relative to
the output's peak.

    python benchmarks/attention_plans.py [--shapes zimage,wan1.3b,wan14b] [--plans 12]
"""

from __future__ import annotations

import argparse
import sys

import torch

SHAPES = {  # (tokens, heads, head dim)
    "zimage": (4096 + 32, 30, 128),
    "wan1.3b": (21 * 30 * 52, 12, 128),
    "wan14b": (21 * 30 * 52, 40, 128),
}


def rows_for(name: str, plans: int) -> list[str]:
    from omnirt.kernels import cudnn_graphs, fp8_attention

    tokens, heads, dim = SHAPES[name]
    flop = 4.0 * tokens * tokens * heads * dim
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, tokens, heads, dim, device="cuda", generator=g).bfloat16() for _ in "qkv")
    label = f"{name} ({tokens} tokens, {heads} x {dim})"

    def row(how: str, ms: float, check: str = "") -> str:
        return f"| {label} | {how} | {ms:.3f} | {flop / ms / 1e9:.0f} | {check} |"

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt)  # noqa: E731
        out = [row("bf16 SDPA (cuDNN)", cudnn_graphs.time_ms(sdpa, repeats=20))]
    cudnn = cudnn_graphs.frontend()
    plan = fp8_attention._build(cudnn, fp8_attention._shape(q, k, v, None, None))  # as the kernel builds it
    graph, handle = plan.graph, plan.handle
    cudnn_graphs.build_first_plans(graph, plans)
    (q8, qs), (k8, ks), (v8, vs) = (fp8_attention.quantize_tensor(t) for t in (q, k, v))
    result = torch.empty(q.shape, dtype=torch.float8_e4m3fn if plan.fp8_out else q.dtype, device="cuda")
    pack = {
        fp8_attention._Q: q8, fp8_attention._K: k8, fp8_attention._V: v8, fp8_attention._O: result,
        fp8_attention._Q_DESCALE: qs, fp8_attention._K_DESCALE: ks, fp8_attention._V_DESCALE: vs,
        fp8_attention._O_AMAX: torch.empty(1, dtype=torch.float32, device="cuda"), **plan.constants,
    }  # fmt: skip
    if plan.fp8_out:  # e4m3 at V's scale, as fp8_attention runs such a plan
        pack[fp8_attention._O_SCALE] = vs.reciprocal()
    first = None
    for index in range(min(graph.get_execution_plan_count(), plans)):
        try:
            size = graph.get_workspace_size_plan_at_index(index)
            workspace = torch.empty(size, dtype=torch.uint8, device="cuda")
            ms = cudnn_graphs.time_plan(cudnn, graph, pack, workspace, index, handle, 20)
        except Exception as e:  # not built, or does not run here
            out.append(f"| {label} | fp8 plan {index} | - | - | {str(e).splitlines()[0][:70]} |")
            continue
        got = result.float()
        if first is None:
            first = got.clone()
        diff = (got - first).abs().max().item() / first.abs().max().item()
        out.append(row(f"fp8 plan {index}" + (" (as run)" if index == 0 else ""), ms, f"{diff:.1e}"))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="zimage,wan1.3b,wan14b")
    p.add_argument("--plans", type=int, default=12, help="cuDNN's first plans built and timed")
    args = p.parse_args(argv)
    names = [s for s in args.shapes.split(",") if s]
    if any(s not in SHAPES for s in names):
        p.error(f"--shapes are {', '.join(SHAPES)}")
    if not torch.cuda.is_available():
        print("benchmarks/attention_plans.py needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"# fp8 attention plans: {torch.cuda.get_device_name()} (torch {torch.__version__})\n")
    print("| shape | how | ms | TFLOP/s | max diff / peak vs plan 0 |\n|---|---|---|---|---|")
    for name in names:
        print("\n".join(rows_for(name, args.plans)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
