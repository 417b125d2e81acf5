"""W8A8 matrix products: 8-bit weights (one scale per output channel) times 8-bit activations
(one scale per token, quantized on the fly), for the DiT's linear layers.

- ``int8``: symmetric int8 both sides, ``torch._int_mm`` (int32 accumulation, exact), then the
  two scales and the bias in fp32, rounded once to the output dtype.
- ``fp8``: e4m3 both sides, ``torch._scaled_mm`` with row-wise scales (Hopper's FP8 tensor cores;
  the CPU has a reference implementation), the scales and bias applied inside.

On CUDA the product is the library's (:data:`GEMM` ``library``) or ``kernels/w8a8_gemm.py``'s
Triton GEMM with the scales and bias in its epilogue (``triton``: for int8 the same bits, no
int32 product in memory). Two Triton kernels do the memory-bound work around the library's
product, each one pass where eager takes five or six: :func:`quantize_rows_triton` (a row's peak,
its scale and its 8-bit values) and, for int8, :func:`int8_epilogue_triton` (int32 accumulators
times both scales, plus the bias, to the output dtype). Both are bitwise equal to the eager
chains they replace (:func:`quantize_rows` and the epilogue of :func:`w8a8_linear_reference`): the
same operations in the same order, without contraction into fused multiply-adds.

:func:`w8a8_linear_reference` is the dequantized product (the quantized operands times their
scales, multiplied in fp32): what the fast paths must equal up to fp32 rounding. Weights are
quantized once (:func:`quantize_rows` of ``[out, in]``), activations on every call, or once
for several products (:class:`QuantizedRows`: a kernel that makes the activations, such as a norm
or the gated unit of ``kernels/swiglu.py``, can write them quantized; :func:`w8a8_linear` takes
them as they are).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

from . import settings, w8a8_gemm
from .settings import kernel_device

try:  # Triton ships with CUDA builds of torch only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

Kind = Literal["int8", "fp8"]
KINDS: tuple[Kind, ...] = ("int8", "fp8")
#: The largest magnitude of each format (int8 is kept symmetric: -127..127).
QMAX: dict[str, float] = {"int8": 127.0, "fp8": 448.0}
STORAGE: dict[str, torch.dtype] = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
#: ``torch._int_mm`` on CUDA wants more than 16 rows; fewer are padded with zero rows.
_INT_MM_MIN_ROWS = 17
#: The smallest row peak a scale is taken from (an all-zero row gets a tiny positive scale).
_MIN_PEAK = 1e-12
#: 1.5 * 2**23: adding and subtracting it rounds an fp32 of magnitude below 2**22 to an integer,
#: ties to even (``torch.round``), in two correctly rounded additions.
_ROUNDER = 12582912.0


Gemm = Literal["auto", "library", "triton"]
GEMMS: tuple[Gemm, ...] = ("auto", "library", "triton")
#: Which GEMM runs each kind's products on CUDA: ``library`` (``torch._int_mm``, then the epilogue
#: kernel; ``torch._scaled_mm``), ``triton`` (:func:`~omnirt.kernels.w8a8_gemm.w8a8_gemm`) or
#: ``auto``: Triton's on Hopper, where it was measured faster at the DiTs' shapes (int8 1.2-1.6x
#: ``_int_mm`` and its epilogue with the same bits, fp8 0.94-1.38x ``_scaled_mm``'s row-wise product:
#: docs/benchmarks.md), the library's elsewhere.
GEMM: dict[Kind, Gemm] = {"int8": "auto", "fp8": "auto"}


def set_gemm(kind: str, gemm: str) -> None:
    """Sets :data:`GEMM` of ``kind``."""
    if gemm not in GEMMS:
        raise ValueError(f"the W8A8 GEMM must be one of {', '.join(GEMMS)}, not {gemm!r}")
    GEMM[check_kind(kind)] = gemm  # type: ignore[assignment]


@contextlib.contextmanager
def gemm_as(gemm: str, kinds: tuple[str, ...] = KINDS) -> Iterator[None]:
    """:data:`GEMM` of each of ``kinds`` set to ``gemm`` for the block, then as it was."""
    before = dict(GEMM)
    try:
        for kind in kinds:
            set_gemm(kind, gemm)
        yield
    finally:
        GEMM.update(before)


def check_kind(kind: str) -> Kind:
    if kind not in KINDS:
        raise ValueError(f"quantization must be one of {', '.join(KINDS)}, not {kind!r}")
    return kind  # type: ignore[return-value]


#: ``1 / QMAX`` rounded to fp32, the factor a row's peak is scaled by (ATen divides a CUDA tensor by
#: a Python number as a product with its fp32 reciprocal; this is that, everywhere).
_INVERSE_QMAX: dict[str, float] = {
    kind: float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(q, dtype=torch.float32))
    for kind, q in QMAX.items()
}


def quantize_constants(kind: Kind | None) -> dict[str, Any]:
    """The launch arguments a kernel calling :func:`quantize_values` takes for ``kind``
    (``INV_QMAX``, ``QMAX``, ``MIN_PEAK``, ``ROUNDER``, ``INT8``; None: a launch that does not
    quantize, given int8's)."""
    k = kind or "int8"
    return {"INV_QMAX": _INVERSE_QMAX[k], "QMAX": QMAX[k], "MIN_PEAK": _MIN_PEAK, "ROUNDER": _ROUNDER,
            "INT8": k == "int8"}  # fmt: skip


def quantize_rows(x: torch.Tensor, kind: Kind) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [rows, cols] as 8-bit values and one fp32 scale per row [rows, 1], symmetric:
    ``x ~ q * scale`` with the row's largest magnitude mapped to the format's largest value."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp_min(_MIN_PEAK)
    scale = amax * _INVERSE_QMAX[kind]
    return quantize_scaled(xf, scale, kind), scale


def quantize_scaled(x: torch.Tensor, scale: torch.Tensor, kind: Kind) -> torch.Tensor:
    """``x`` over a given ``scale`` (broadcast; fp32) as 8-bit values: the IEEE quotient in fp32,
    int8 rounded to the nearest integer (ties to even), clamped to the format's range, cast."""
    scaled = x.float() / scale
    if kind == "int8":
        return scaled.round_().clamp_(-127, 127).to(torch.int8)
    return scaled.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)


@dataclass(frozen=True)
class QuantizedRows:
    """Activations quantized per token: ``values`` [rows, cols] 8-bit and ``scale`` [rows, 1] fp32
    (:func:`quantize_rows`' pair) of a tensor of ``shape`` and ``dtype``, the shape and dtype a
    product of them keeps (its last dim changed)."""

    values: torch.Tensor
    scale: torch.Tensor
    kind: Kind
    shape: tuple[int, ...]
    dtype: torch.dtype


def quantize(x: torch.Tensor, kind: Kind) -> QuantizedRows:
    """``x`` [..., cols] per token: the Triton kernel on CUDA, else the eager chain (same bits)."""
    rows = x.reshape(-1, x.shape[-1])
    if kernel_device(rows) and rows.stride(-1) == 1:
        values, scale = quantize_rows_triton(rows, kind)
    else:
        values, scale = quantize_rows(rows, kind)
    return QuantizedRows(values, scale, kind, tuple(x.shape), x.dtype)


def _int8_epilogue(acc: torch.Tensor, x_scale: torch.Tensor, weight_scale: torch.Tensor, bias, dtype):
    out = acc.float() * x_scale * weight_scale.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(dtype)


def w8a8_linear_reference(
    x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, kind: Kind
) -> torch.Tensor:
    """The dequantized product of :func:`w8a8_linear`'s operands, in fp32, cast to ``x``'s dtype."""
    rows = x.reshape(-1, x.shape[-1])
    xq, x_scale = quantize_rows(rows, kind)
    out = (xq.float() * x_scale) @ (qweight.float() * weight_scale).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], qweight.shape[0])


if triton is not None:

    @triton.jit
    def quantize_values(v, scale, QMAX: tl.constexpr, ROUNDER: tl.constexpr, INT8: tl.constexpr):
        """fp32 ``v`` over its row's ``scale`` as :func:`quantize_rows` makes it: the IEEE
        quotient, int8 rounded to the nearest integer (ties to even), clamped, cast."""
        v = tl.math.div_rn(v, scale)
        if INT8:  # (one return: Triton types every return of a function, even unreachable ones)
            v = (v + ROUNDER) - ROUNDER  # to the nearest integer, ties to even (|v| <= 127)
            q = tl.minimum(tl.maximum(v, -QMAX), QMAX).to(tl.int8)
        else:
            q = tl.minimum(tl.maximum(v, -QMAX), QMAX).to(tl.float8e4nv)
        return q

    @triton.jit
    def _quantize_rows_kernel(X, Q, S, cols, stride_x, stride_q, INV_QMAX, QMAX: tl.constexpr,
                              MIN_PEAK: tl.constexpr, ROUNDER: tl.constexpr, INT8: tl.constexpr,
                              BLOCK: tl.constexpr, HOLD: tl.constexpr):  # fmt: skip
        # A program a row: its peak, then its values over the peak's scale. With HOLD the row is
        # one block (BLOCK >= cols), read once and kept in registers; else read again for the values.
        row = tl.program_id(0).to(tl.int64)
        src = X + row * stride_x
        dst = Q + row * stride_q
        if HOLD:
            offs = tl.arange(0, BLOCK)
            live = offs < cols
            v = tl.load(src + offs, mask=live, other=0.0).to(tl.float32)
            scale = tl.maximum(tl.max(tl.abs(v), axis=0), MIN_PEAK) * INV_QMAX
            tl.store(S + row, scale)
            tl.store(dst + offs, quantize_values(v, scale, QMAX, ROUNDER, INT8), mask=live)
        else:
            peak = tl.zeros([BLOCK], tl.float32)
            for start in range(0, cols, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                v = tl.load(src + offs, mask=offs < cols, other=0.0).to(tl.float32)
                peak = tl.maximum(peak, tl.abs(v))
            scale = tl.maximum(tl.max(peak, axis=0), MIN_PEAK) * INV_QMAX
            tl.store(S + row, scale)
            for start in range(0, cols, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                live = offs < cols
                v = tl.load(src + offs, mask=live, other=0.0).to(tl.float32)
                tl.store(dst + offs, quantize_values(v, scale, QMAX, ROUNDER, INT8), mask=live)

    @triton.jit
    def _int8_epilogue_kernel(ACC, XS, WS, BIAS, OUT, rows, cols, stride_acc, stride_out,
                              HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):  # fmt: skip
        r = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
        c = tl.program_id(1) * BN + tl.arange(0, BN)
        live = (r[:, None] < rows) & (c[None, :] < cols)
        acc = tl.load(ACC + r[:, None] * stride_acc + c[None, :], mask=live, other=0).to(tl.float32)
        out = acc * tl.load(XS + r, mask=r < rows, other=0.0)[:, None]
        out = out * tl.load(WS + c, mask=c < cols, other=0.0)[None, :]
        if HAS_BIAS:
            out = out + tl.load(BIAS + c, mask=c < cols, other=0.0).to(tl.float32)[None, :]
        tl.store(OUT + r[:, None] * stride_out + c[None, :], out.to(OUT.dtype.element_ty), mask=live)


#: The widest row (a power of two) :func:`quantize_rows_triton` reads once and keeps in registers
#: with :data:`~.settings.HOLD_ROWS` (at most 32 elements a thread over 16 warps; Z-Image's gated
#: output, 10240, is one block of 16384).
HOLD_WIDTH = 16384


def quantize_rows_triton(x: torch.Tensor, kind: Kind) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows` in one Triton kernel (``x`` [rows, cols] with unit column stride),
    bitwise equal to it; on the CPU under ``TRITON_INTERPRET=1`` for int8."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("quantize_rows_triton wants a [rows, cols] tensor with unit column stride")
    rows, cols = x.shape
    q = torch.empty(rows, cols, dtype=STORAGE[kind], device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        whole = triton.next_power_of_2(max(cols, 16))
        hold = settings.HOLD_ROWS and whole <= HOLD_WIDTH
        block = whole if hold else min(whole, 4096)
        _quantize_rows_kernel[(rows,)](
            x, q, scale, cols, x.stride(0), q.stride(0), **quantize_constants(kind), BLOCK=block,
            HOLD=hold, num_warps=min(16, max(4, block // 1024)) if hold else 4 if block <= 2048 else 8,
            enable_fp_fusion=False,
        )  # fmt: skip
    return q, scale


def int8_epilogue_triton(
    acc: torch.Tensor, x_scale: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """``(acc * x_scale * weight_scale.T + bias)`` in fp32, rounded once to ``dtype``, in one
    pass: ``acc`` [rows, cols] int32, ``x_scale`` [rows, 1], ``weight_scale`` [cols, 1] fp32."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    rows, cols = acc.shape
    out = torch.empty(rows, cols, dtype=dtype, device=acc.device)
    if rows and cols:
        bm, bn = 32, 128
        grid = (triton.cdiv(rows, bm), triton.cdiv(cols, bn))
        _int8_epilogue_kernel[grid](
            acc, x_scale, weight_scale, bias if bias is not None else weight_scale, out, rows, cols,
            acc.stride(0), out.stride(0), HAS_BIAS=bias is not None, BM=bm, BN=bn, num_warps=4,
            enable_fp_fusion=False,
        )  # fmt: skip
    return out


def _scaled_mm_takes(qweight: torch.Tensor) -> bool:
    """Whether ``torch._scaled_mm`` on CUDA takes an [N, K] e4m3 weight: both widths multiples of 16."""
    return qweight.shape[0] % 16 == 0 and qweight.shape[1] % 16 == 0


def _dequantized_product(
    xq: torch.Tensor, x_scale: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor,
    bias: torch.Tensor | None, dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """The W8A8 product in fp32 from the 8-bit values (exact in fp32), scaled, plus the bias, rounded
    once to ``dtype``: for the shapes no 8-bit GEMM takes."""
    return _int8_epilogue(xq.float() @ qweight.float().t(), x_scale, weight_scale, bias, dtype)  # (any kind)


def as_quantized(x: torch.Tensor | QuantizedRows, kind: Kind, inputs: int) -> QuantizedRows:
    """``x`` [..., inputs] quantized per token as ``kind`` (:func:`quantize`), or as given if it is
    already (ValueError if of another kind or width)."""
    if not isinstance(x, QuantizedRows):
        return quantize(x, kind)
    if x.kind != kind or x.values.shape[-1] != inputs:
        cols = x.values.shape[-1]
        raise ValueError(f"{x.kind} activations of {cols} columns for a {kind} layer of {inputs} inputs")
    return x


def product_dtype(x: QuantizedRows) -> torch.dtype:
    """The dtype a W8A8 product of ``x`` is written in: ``x``'s, a float one, else fp32."""
    return x.dtype if x.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32


def triton_gemm_runs(
    x: QuantizedRows, qweight: torch.Tensor, weight_scale: torch.Tensor, also: bool = False
) -> bool:
    """Whether :func:`w8a8_linear` runs ``x``'s product with ``qweight`` as the Triton GEMM: CUDA
    operands it takes, and :data:`GEMM` ``triton``, or ``auto`` on a card with TMA (Hopper), or
    ``also`` (a product no library GEMM takes)."""
    xq = x.values
    if not xq.is_cuda:
        return False
    gemm = GEMM[x.kind]
    wanted = gemm == "triton" or (gemm == "auto" and w8a8_gemm.tma_capable(xq.device)) or also
    return wanted and w8a8_gemm.applies(xq, x.scale, qweight, weight_scale)


def w8a8_linear(
    x: torch.Tensor | QuantizedRows,
    qweight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    kind: Kind,
    peak: torch.Tensor | None = None,
    peak_from: int = 0,
) -> torch.Tensor:
    """``x @ W.T + bias`` with ``W ~ qweight * weight_scale`` (``qweight`` [out, in] 8-bit,
    ``weight_scale`` [out, 1] fp32) and ``x`` [..., in] quantized per token (or given quantized:
    :class:`QuantizedRows` of ``kind``); returns ``x``'s dtype. On CUDA the quantization runs as a
    Triton kernel (same bits as eager) and the product as :data:`GEMM` says (``auto``: the Triton
    GEMM on Hopper); fp8 widths ``torch._scaled_mm`` refuses go to the Triton GEMM, or where K is
    not a multiple of 16 either, to the product in fp32.

    ``peak`` (fp32 [1]): raised to the largest magnitude of the output's columns ``peak_from`` on
    (in the Triton GEMM's epilogue where it runs, else over the output after it)."""
    x = as_quantized(x, kind, qweight.shape[1])
    xq, x_scale = x.values, x.scale
    count = xq.shape[0]
    out_dtype = product_dtype(x)
    library_fp8 = not xq.is_cuda or _scaled_mm_takes(qweight)
    if triton_gemm_runs(x, qweight, weight_scale, also=kind == "fp8" and not library_fp8):
        out = w8a8_gemm.w8a8_gemm(
            xq, x_scale, qweight, weight_scale, bias, out_dtype, peak=peak, peak_from=peak_from
        )
        return out.view(*x.shape[:-1], qweight.shape[0])
    if kind == "int8":
        if xq.is_cuda and count < _INT_MM_MIN_ROWS:
            xq = torch.cat([xq, xq.new_zeros(_INT_MM_MIN_ROWS - count, xq.shape[1])])
        acc = torch._int_mm(xq, qweight.t())[:count]
        if kernel_device(acc, qweight):
            out = int8_epilogue_triton(acc, x_scale, weight_scale, bias, x.dtype)
        else:
            out = _int8_epilogue(acc, x_scale, weight_scale, bias, x.dtype)
    elif not library_fp8:  # widths neither cuBLAS's fp8 product nor the Triton GEMM takes
        out = _dequantized_product(xq, x_scale, qweight, weight_scale, bias, out_dtype)
    else:
        out = torch._scaled_mm(
            xq,
            qweight.t(),
            scale_a=x_scale,
            scale_b=weight_scale.t().contiguous(),
            bias=None if bias is None else bias.to(out_dtype),
            out_dtype=out_dtype,
        )
    if peak is not None and out.shape[0] and out.shape[1] > peak_from:
        torch.maximum(peak, out[:, peak_from:].abs().amax().float(), out=peak)
    return out.view(*x.shape[:-1], qweight.shape[0])
