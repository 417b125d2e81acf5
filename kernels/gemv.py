"""Products of a few rows with a weight, ``x @ w.T`` for ``x`` [M, K] with M up to 16 (a decode
step's rows), in one launch, optionally with the gated unit ``silu(a) * b`` of the rows computed
as they are read.

:func:`gemv` is one program per ``BLOCK_N`` output columns (and, with ``split`` > 1, per part of
K): it streams its columns' weight rows in ``BLOCK_K`` slices, each against all ``M`` rows (padded
to 16 for the tensor cores), fp32 accumulation, one rounding to the output dtype. Split parts store
their fp32 sums to a workspace; the last part of a column block to finish (a counter per block,
reset by that part, so a CUDA graph replays it) adds them in part order: the same bits on every
call, eager or from a graph, whichever part ends last. ``gated`` reads ``x`` as ``[a | b]``
halves and multiplies by ``silu(a) * b``, rounded where the gated-unit kernel rounds it
(``kernels/swiglu.py``). Not bitwise cuBLAS (another summation order); the reference
(:func:`gemv_reference`) is ``F.linear`` of the same inputs.

Measured on the H200 (``benchmarks/few_row_products.py``, 2026-12-04): at 8 rows cuBLAS is as fast
or faster at every product of the talker and code predictor (3.8-5.1 us, the kernel 4.5-5.9; the
gated down product 8.3 against 9.5 with the split), so the decoders keep cuBLAS there. At one row
cuBLAS's kernel for the 1024 x 2048 attention output takes 10.0-12.4 us and this one 4.7: that is
where the speech decoder runs it (``stages/speech/merged.MergedLayer.attention_output``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .settings import interpreted, kernel_device
from .silu import silu_table

try:  # Triton ships with CUDA builds of torch only
    import triton
    import triton.language as tl

    from .swiglu import _gated
except ImportError:  # pragma: no cover - depends on the install
    triton = None

#: The most rows a call takes (one tensor-core tile of rows).
MAX_ROWS = 16
#: Output columns and weight columns a program's step reads, its warps, pipeline stages and the
#: parts K is split into (programs that each sum a slice; the block's last one adds the parts).
LAUNCH = (16, 256, 4, 3, 1)
#: Counters of the split programs per output block (zero between calls), per device and stream.
_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _counters(device: torch.device, blocks: int) -> torch.Tensor:
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
    key = (device, stream)
    counters = _COUNTERS.get(key)
    if counters is None or counters.numel() < blocks:
        counters = torch.zeros(max(blocks, 1024), dtype=torch.int32, device=device)
        _COUNTERS[key] = counters
    return counters


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, *, gated: bool = False) -> torch.Tensor:
    """The chain the kernel replaces: ``F.linear`` of ``x`` (or of ``silu(a) * b`` of its halves)."""
    if gated:
        inner = x.shape[-1] // 2
        x = F.silu(x[..., :inner]) * x[..., inner:]
    return F.linear(x, weight)


if triton is not None:

    @triton.jit
    def _gemv_kernel(
        X, W, OUT, SILU, PART, COUNT, rows, n, k, k_split, stride_x, stride_w, stride_o,
        GATED: tl.constexpr, TABLE: tl.constexpr, LIBDEVICE: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr,
    ):  # fmt: skip
        block = tl.program_id(0)
        cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        row_ok = m[:, None] < rows
        col_ok = cols[:, None] < n
        start = tl.program_id(1) * k_split
        end = tl.minimum(start + k_split, k)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(start, end, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk[None, :] < end
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
        live = row_ok & (cols[None, :] < n)
        if SPLIT == 1:
            tl.store(out, acc.to(OUT.dtype.element_ty), mask=live)
        else:  # each part's sums to the workspace; the last part of the block adds them in order
            tile = m[:, None] * n + cols[None, :]
            tl.store(PART + tl.program_id(1) * BLOCK_M * n + tile, acc, mask=live)
            tl.debug_barrier()
            if tl.atomic_add(COUNT + block, 1, sem="acq_rel") == SPLIT - 1:
                total = tl.load(PART + tile, mask=live, other=0.0, cache_modifier=".cg")
                for part in tl.static_range(1, SPLIT):
                    at_part = PART + part * BLOCK_M * n + tile
                    total += tl.load(at_part, mask=live, other=0.0, cache_modifier=".cg")
                tl.store(out, total.to(OUT.dtype.element_ty), mask=live)
                tl.atomic_xchg(COUNT + block, 0)  # ready for the next call (or graph replay)


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
    launch: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """``x @ weight.T`` [M, N] (``gated``: of ``silu(a) * b`` with ``x = [a | b]``), the kernel itself
    (CUDA, or the CPU under ``TRITON_INTERPRET=1``); ``launch``: ``(BLOCK_N, BLOCK_K, warps,
    stages[, split])`` instead of :data:`LAUNCH` (probes). ValueError for inputs it does not take."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    reason = _check(x, weight, gated)
    if reason:
        raise ValueError(reason)
    rows, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    block_n, block_k, warps, stages, *rest = launch or LAUNCH
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    split = max(1, min(rest[0] if rest else 1, triton.cdiv(k, block_k)))
    k_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k  # whole steps a part
    split = triton.cdiv(k, k_split)
    blocks = triton.cdiv(n, block_n)
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if split > 1:
        part = torch.empty((split, MAX_ROWS, n), dtype=torch.float32, device=x.device)
        count = _counters(x.device, blocks)
    else:
        part = count = out  # stand-ins never read without SPLIT
    table = gated and x.dtype == torch.bfloat16 and not interpreted()
    silu = silu_table(x.device) if table else x  # a stand-in never read without TABLE
    _gemv_kernel[(blocks, split)](
        x, weight, out, silu, part, count, rows, n, k, k_split, x.stride(0), weight.stride(0),
        out.stride(0), GATED=gated, TABLE=table, LIBDEVICE=not interpreted(), BLOCK_M=MAX_ROWS,
        BLOCK_N=block_n, BLOCK_K=block_k, IEEE=x.dtype == torch.float32, SPLIT=split,
        num_warps=1 if interpreted() else warps, num_stages=stages,
    )  # fmt: skip
    return out
