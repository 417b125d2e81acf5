"""How long Triton takes to compile the kernels that dominate a cold start, without a GPU.

A first start on a machine whose Triton cache is empty compiles every kernel of the decode steps
(``speech_steps.py --compile-report`` lists them on the GPU: the draw kernel and the MoE grouping
kernel are most of it). Triton compiles for a named target without a device (its front end, its
MLIR passes, LLVM and ``ptxas``), so the compile time of a kernel can be measured and worked on
on a machine with no GPU. Each case compiles in a fresh process with an empty cache and prints:

- the wall time of ``triton.compile`` for the target (default sm_90, the H100/H200);
- the time of Triton's coalescing pass (``MLIR_ENABLE_TIMING``), which walks the kernel's whole
  use-def component once per tensor load or store;
- the ratio against the baseline row of the same kernel (its former form) in the same run.

Cases: ``kernels/draw.py``'s ``_draw_kernel`` at 2,048 codes as launched (the softmax's lane sums
read 4 vectors a loop trip) against its former form (all 64 reads unrolled: ``UNROLL = ITERS``);
``kernels/moe_route.py``'s ``_group_kernel`` at 512 pairs, and at 4,096 and 8,192 pairs as
launched (at most 8 keys a thread: 16 and 32 warps) against its former 8 warps (16 and 32 keys).

    python benchmarks/kernel_compile.py [--arch 90] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass

#: Pointer dtypes of the kernels' pointer arguments (the rest are i32 scalars or constexprs).
_DRAW_POINTERS = {
    "LOGITS": "*bf16", "SAMPLED": "*i1", "SCALE": "*fp32", "TOP_K": "*i64", "CUT": "*i64", "UNIFORM": "*fp32",
    "OUT": "*i64", "SCRATCH": "*fp32", "PROBS": "*fp32",
}  # fmt: skip
_GROUP_POINTERS = {"ids_ptr": "*i64", "perm_ptr": "*i64", "inv_ptr": "*i64", "ends_ptr": "*i32"}


@dataclass(frozen=True)
class Case:
    kernel: str  # "draw" or "group"
    form: str
    size: int
    unroll: int | None = None  # draw: the lane sums' reads per loop trip (None: as launched)
    warps: int | None = None  # the program's warps (None: as launched)
    baseline: str | None = None  # the form this one is compared with


CASES = (
    Case("draw", "all 64 reads unrolled (before)", 2048, unroll=64),
    Case("draw", "4 reads a loop trip (as launched)", 2048, baseline="all 64 reads unrolled (before)"),
    Case("group", "as launched", 512),
    Case("group", "8 warps (before)", 4096, warps=8),
    Case("group", "as launched", 4096, baseline="8 warps (before)"),
    Case("group", "8 warps (before)", 8192, warps=8),
    Case("group", "as launched", 8192, baseline="8 warps (before)"),
)


def _compile(case: Case, arch: int) -> float:
    """Seconds of one ``triton.compile`` of ``case`` (run in the child process)."""
    import time

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if case.kernel == "draw":
        from omnirt.kernels import draw

        fn = draw._draw_kernel
        consts, options = draw.launch_config(case.size)
        consts["STORE_PROBS"] = False
        if case.unroll:
            consts["UNROLL"] = case.unroll
        pointers = _DRAW_POINTERS
    else:
        from omnirt.kernels import moe_route

        fn = moe_route._group_kernel
        consts, options = moe_route.launch_config(case.size, 128)  # Qwen3-Omni's thinker: 128 experts
        pointers = _GROUP_POINTERS
    if case.warps:
        options = dict(options, num_warps=case.warps)
    names = fn.arg_names
    signature = {n: pointers.get(n, "constexpr" if n in consts else "i32") for n in names}
    source = ASTSource(fn, signature, constexprs={(names.index(k),): v for k, v in consts.items()})
    t0 = time.perf_counter()
    triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    return time.perf_counter() - t0


def measure(case: Case, arch: int) -> tuple[float, float | None]:
    """``(compile seconds, coalescing pass seconds or None)`` of ``case`` in a fresh process with an
    empty Triton cache."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache, MLIR_ENABLE_TIMING="1")
        env.pop("TRITON_INTERPRET", None)  # the compiler's path, whatever the caller runs under
        code = (
            "import json, sys; sys.path[:0] = [sys.argv[1]]; import kernel_compile as k; "
            "case = k.Case(**json.loads(sys.argv[2])); print('SECONDS', k._compile(case, int(sys.argv[3])))"
        )
        args = [os.path.dirname(os.path.abspath(__file__)), json.dumps(case.__dict__), str(arch)]
        done = subprocess.run(
            [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, check=False
        )
    if done.returncode != 0:
        raise RuntimeError(f"compiling {case.kernel} ({case.form}) failed:\n{done.stderr[-3000:]}")
    seconds = float(re.search(r"^SECONDS (\S+)$", done.stdout, re.M).group(1))
    coalesce = re.findall(r"^\s*([0-9.]+) \(\s*[0-9.]+%\)\s+TritonGPUCoalesce$", done.stderr, re.M)
    return seconds, (sum(map(float, coalesce)) if coalesce else None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability to compile for (90: sm_90)")
    p.add_argument("--repeats", type=int, default=1, help="compiles per case (the median)")
    p.add_argument("--kernels", default="draw,group", help="which kernels (comma-separated: draw, group)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    wanted = set(args.kernels.split(","))
    if not wanted <= {"draw", "group"}:
        p.error("--kernels are draw and group")
    try:
        import triton
    except ImportError:
        print("benchmarks/kernel_compile.py needs Triton", file=sys.stderr)
        return 2
    print(f"# Triton compile times for sm_{args.arch} (Triton {triton.__version__}, {os.cpu_count()} CPUs)\n")
    print("| kernel | size | form | compile (s) | coalescing pass (s) | vs before |")
    print("|---|---|---|---|---|---|")
    seen: dict[tuple[str, int, str], float] = {}
    for case in CASES:
        if case.kernel not in wanted:
            continue
        runs = [measure(case, args.arch) for _ in range(args.repeats)]
        seconds = statistics.median(r[0] for r in runs)
        passes = [r[1] for r in runs if r[1] is not None]
        coalesce = f"{statistics.median(passes):.2f}" if passes else "-"
        seen[(case.kernel, case.size, case.form)] = seconds
        before = seen.get((case.kernel, case.size, case.baseline)) if case.baseline else None
        ratio = f"{before / seconds:.2f}x faster" if before else "-"
        name = {"draw": "`_draw_kernel`", "group": "`_group_kernel`"}[case.kernel]
        print(f"| {name} | {case.size} | {case.form} | {seconds:.2f} | {coalesce} | {ratio} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
