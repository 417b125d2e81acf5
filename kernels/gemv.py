"""Products of a few rows with a weight, ``x @ w.T`` for ``x`` [M, K] with M up to 16 (a decode
step's rows), in one launch that reads the weight once at full width, optionally with the gated
unit ``silu(a) * b`` of the rows computed as they are read (the code predictor's MLP: ``down``
reads ``gate_up``'s output).

At a few rows a decoder's products are weight reads: the code predictor's qkv product at 8 rows
reads 8 MB and writes 64 KB. cuBLAS's kernels for those shapes take 4 to 6 us on the H200 (about a
third of the bandwidth), its down product (K = 3072) is split over K with a second launch that
adds the parts, and the gated unit before it is a launch of its own. :func:`gemv` is one program
per ``BLOCK_N`` output columns: it streams its columns' weight rows once in ``BLOCK_K`` slices,
each against all ``M`` rows (padded to 16 for the tensor cores), fp32 accumulation, one rounding
to the output dtype; ``gated`` reads ``x`` as ``[a | b]`` halves and multiplies by
``silu(a) * b``, rounded where the gated-unit kernel rounds it (``kernels/swiglu.py``), so the
product's inputs are that kernel's outputs. No split over K, no atomics: the same bits on every
call, eager or from a CUDA graph. Not bitwise cuBLAS (another summation order); the reference
(:func:`gemv_reference`) is ``F.linear`` of the same inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .conv_input import silu_table
from .settings import interpreted, kernel_device

try:  # Triton ships with CUDA builds of torch only
    import triton
    import triton.language as tl

    from .swiglu import _gated
except ImportError:  # pragma: no cover - depends on the install
    triton = None

#: The most rows a call takes (one tensor-core tile of rows).
MAX_ROWS = 16
#: Output columns and weight columns a program's step reads, its warps and pipeline stages.
LAUNCH = (16, 256, 4, 3)


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, *, gated: bool = False) -> torch.Tensor:
    """The chain the kernel replaces: ``F.linear`` of ``x`` (or of ``silu(a) * b`` of its halves)."""
    if gated:
        inner = x.shape[-1] // 2
        x = F.silu(x[..., :inner]) * x[..., inner:]
    return F.linear(x, weight)


if triton is not None:

    @triton.jit
    def _gemv_kernel(
        X, W, OUT, SILU, rows, n, k, stride_x, stride_w, stride_o,
        GATED: tl.constexpr, TABLE: tl.constexpr, LIBDEVICE: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        row_ok = m[:, None] < rows
        col_ok = cols[:, None] < n
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, k, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk[None, :] < k
            at = m[:, None].to(tl.int64) * stride_x + kk[None, :]
            if GATED:  # x is [a | b]: the rows' gated unit, as kernels/swiglu.py rounds it
                x = _gated(X, X + k, SILU, at, row_ok & k_ok, TABLE, LIBDEVICE).to(W.dtype.element_ty)
            else:
                x = tl.load(X + at, mask=row_ok & k_ok, other=0.0)
            w_at = cols[:, None].to(tl.int64) * stride_w + kk[None, :]
            w = tl.load(W + w_at, mask=col_ok & k_ok, other=0.0)
            if IEEE:  # fp32 rows: no TF32, as F.linear by default
                acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w), acc)
        out = OUT + m[:, None].to(tl.int64) * stride_o + cols[None, :]
        tl.store(out, acc.to(OUT.dtype.element_ty), mask=row_ok & (cols[None, :] < n))


def _check(x: torch.Tensor, weight: torch.Tensor, gated: bool) -> str | None:
    if x.dim() != 2 or weight.dim() != 2:
        return f"x must be [M, K] and the weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}"
    if not 1 <= x.shape[0] <= MAX_ROWS:
        return f"1 to {MAX_ROWS} rows, got {x.shape[0]}"
    width = x.shape[1] // 2 if gated else x.shape[1]
    if (gated and x.shape[1] % 2) or weight.shape[1] != width:
        kind = "gated" if gated else "plain"
        return f"the weight's {weight.shape[1]} columns do not match x's {x.shape[1]} ({kind})"
    if x.dtype != weight.dtype or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"x and the weight must share a float dtype, got {x.dtype} and {weight.dtype}"
    if x.stride(1) != 1 or weight.stride(1) != 1:
        return "x and the weight must have contiguous rows"
    return None


def kernel_applies(x: torch.Tensor, weight: torch.Tensor, *, gated: bool = False) -> bool:
    return kernel_device(x, weight) and _check(x, weight, gated) is None


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    gated: bool = False,
    launch: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """``x @ weight.T`` [M, N] (``gated``: of ``silu(a) * b`` with ``x = [a | b]``), the kernel itself
    (CUDA, or the CPU under ``TRITON_INTERPRET=1``); ``launch``: ``(BLOCK_N, BLOCK_K, warps,
    stages)`` instead of :data:`LAUNCH` (probes). ValueError for inputs it does not take."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    reason = _check(x, weight, gated)
    if reason:
        raise ValueError(reason)
    rows, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    block_n, block_k, warps, stages = launch or LAUNCH
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    table = gated and x.dtype == torch.bfloat16 and not interpreted()
    silu = silu_table(x.device) if table else x  # a stand-in never read without TABLE
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, out, silu, rows, n, k, x.stride(0), weight.stride(0), out.stride(0),
        GATED=gated, TABLE=table, LIBDEVICE=not interpreted(), BLOCK_M=MAX_ROWS, BLOCK_N=block_n,
        BLOCK_K=min(block_k, max(16, triton.next_power_of_2(k))), IEEE=x.dtype == torch.float32,
        num_warps=1 if interpreted() else warps, num_stages=stages,
    )  # fmt: skip
    return out
