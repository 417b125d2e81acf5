"""A gated feed-forward's middle in one launch: ``silu(a) * b``, optionally quantized per token for
the W8A8 product that follows (``kernels/w8a8.py``).

Z-Image's ``FeedForward`` is ``w2(silu(w1(x)) * w3(x))``. Eagerly the middle is two elementwise
kernels over the hidden width (10240 at 1024x1024: ``silu`` reads and writes 4128 x 10240, the
product reads two and writes one) and, with W8A8 weights, a third pass that quantizes the product
for ``w2``. :func:`swiglu` is one pass that writes the product; :func:`swiglu_quantize` is one pass
(two reads of the row, the second from cache) that writes it quantized: the 8-bit values and the
row's scale, never the bf16 product.

**Bits.** The eager chain: ``silu`` in fp32 (``x / (1 + expf(-x))``, IEEE division), rounded to the
input dtype; the product of two rounded values in fp32 (exact for bf16), rounded; then, quantizing,
:func:`~.w8a8.quantize_rows`. In bf16 the SiLU of each of the 65536 values is ATen's own, looked up
(:func:`~.silu.silu_table`); in fp16 and fp32 it is computed with libdevice's ``expf`` (the
CUDA math library ATen's kernel calls). So the kernel is bitwise the eager chain on CUDA (the GPU
tests check it); on the CPU under ``TRITON_INTERPRET=1`` (fp32, numpy's ``exp``) within an ulp.

:func:`swiglu` and :func:`swiglu_quantize` dispatch: the kernel for CUDA tensors with Triton where
:data:`~.settings.FUSED` is not ``off``, else the eager chain.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import settings
from .settings import interpreted
from .silu import silu_table
from .w8a8 import (
    STORAGE,
    Kind,
    QuantizedRows,
    as_quantized,
    product_dtype,
    quantize,
    quantize_constants,
    triton_gemm_runs,
    w8a8_linear,
)
from .w8a8_gemm import w8a8_gemm

try:  # Triton ships with CUDA builds of torch only
    import triton
    import triton.language as tl

    from .silu import gated_values
    from .w8a8 import quantize_values
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def swiglu_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The eager chain (diffusers' ``FeedForward._forward_silu_gating``)."""
    return F.silu(a) * b


if triton is not None:

    @triton.jit
    def _gated(A, B, SILU, offs, live, TABLE: tl.constexpr, LIBDEVICE: tl.constexpr):
        """``silu(a) * b`` at ``offs`` of a row, rounded where eager rounds it, as fp32."""
        a = tl.load(A + offs, mask=live, other=0.0)
        b = tl.load(B + offs, mask=live, other=0.0).to(tl.float32)
        return gated_values(a, b, SILU, live, TABLE, LIBDEVICE)

    @triton.jit
    def _swiglu_kernel(A, B, OUT, S, SILU, cols, stride_a, stride_b, stride_o, INV_QMAX,
                       QMAX: tl.constexpr, MIN_PEAK: tl.constexpr, ROUNDER: tl.constexpr,
                       QUANT: tl.constexpr, INT8: tl.constexpr, TABLE: tl.constexpr,
                       LIBDEVICE: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        a_row = A + row * stride_a
        b_row = B + row * stride_b
        o_row = OUT + row * stride_o
        if QUANT:
            peak = tl.zeros([BLOCK], tl.float32)
            for start in range(0, cols, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                y = _gated(a_row, b_row, SILU, offs, offs < cols, TABLE, LIBDEVICE)
                peak = tl.maximum(peak, tl.abs(y))
            scale = tl.maximum(tl.max(peak, axis=0), MIN_PEAK) * INV_QMAX
            tl.store(S + row, scale)
            for start in range(0, cols, BLOCK):  # the row again (from cache), quantized
                offs = start + tl.arange(0, BLOCK)
                live = offs < cols
                y = _gated(a_row, b_row, SILU, offs, live, TABLE, LIBDEVICE)
                tl.store(o_row + offs, quantize_values(y, scale, QMAX, ROUNDER, INT8), mask=live)
        else:
            for start in range(0, cols, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                live = offs < cols
                y = _gated(a_row, b_row, SILU, offs, live, TABLE, LIBDEVICE)
                tl.store(o_row + offs, y.to(OUT.dtype.element_ty), mask=live)


def _check(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """Why the kernel cannot take ``a`` and ``b``, or None."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"a and b must have one shape and dtype: {a.dtype}{list(a.shape)}, {b.dtype}{list(b.shape)}"
    if a.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"unsupported dtype {a.dtype}"
    if a.stride(-1) != 1 or b.stride(-1) != 1:
        return "a and b must have a contiguous last dim"
    try:  # rows of a uniform stride: [..., C] that reshapes to [rows, C] without a copy
        a.view(-1, a.shape[-1]), b.view(-1, b.shape[-1])
    except RuntimeError:
        return "a and b must be rows of one stride (a view of [rows, C])"
    return None


def _block(cols: int) -> int:
    """The slice of a row a step reads: the largest power of two dividing ``cols`` up to 2048 (no
    masked tail), or the row rounded up to a power of two (at most 2048) for odd widths."""
    exact = min(cols & -cols, 2048)
    return exact if exact >= 256 else min(triton.next_power_of_2(cols), 2048)


def _launch(a: torch.Tensor, b: torch.Tensor, kind: Kind | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    cols = a.shape[-1]
    a2, b2 = a.view(-1, cols), b.view(-1, cols)
    rows = a2.shape[0]
    out = torch.empty(rows, cols, dtype=a.dtype if kind is None else STORAGE[kind], device=a.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=a.device) if kind is not None else None
    if rows and cols:
        table = a.dtype == torch.bfloat16
        block = _block(cols)
        _swiglu_kernel[(rows,)](
            a2, b2, out, scale if scale is not None else out, silu_table(a.device) if table else a2,
            cols, a2.stride(0), b2.stride(0), out.stride(0), **quantize_constants(kind),
            QUANT=kind is not None, TABLE=table, LIBDEVICE=not interpreted(), BLOCK=block,
            num_warps=max(1, min(8, block // 256)), enable_fp_fusion=False,
        )  # fmt: skip
    return out, scale


def _checked_launch(
    a: torch.Tensor, b: torch.Tensor, kind: Kind | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if triton is None:
        raise RuntimeError("Triton is not installed")
    reason = _check(a, b)
    if reason:
        raise ValueError(reason)
    return _launch(a, b, kind)


def swiglu_triton(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The kernel itself (any device Triton runs on); ValueError for inputs it does not take."""
    return _checked_launch(a, b, None)[0].view(a.shape)


def swiglu_quantize_triton(a: torch.Tensor, b: torch.Tensor, kind: Kind) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantizing kernel itself: ``quantize_rows(silu(a) * b)`` as ``(values, scale)``, values
    [rows, C] and scale [rows, 1]."""
    values, scale = _checked_launch(a, b, kind)
    assert scale is not None
    return values, scale


def kernel_applies(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether :func:`swiglu` and :func:`swiglu_quantize` run the kernel (bitwise wherever it
    takes the inputs, so ``auto`` and ``on`` both want it)."""
    return settings.kernel_device(a, b) and _check(a, b) is None and settings.wanted(True)


def _swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _launch(a, b, None)[0].view(a.shape)


def _swiglu_quantize(a: torch.Tensor, b: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    values, scale = _launch(a, b, kind)  # type: ignore[arg-type]
    assert scale is not None
    return values, scale


@torch.library.custom_op("omnirt::swiglu", mutates_args=())
def _swiglu_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _swiglu(a, b)


@_swiglu_op.register_fake
def _swiglu_fake(a, b):
    return a.new_empty(a.shape)


@torch.library.custom_op("omnirt::swiglu_quantize", mutates_args=())
def _swiglu_quantize_op(a: torch.Tensor, b: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _swiglu_quantize(a, b, kind)


@_swiglu_quantize_op.register_fake
def _swiglu_quantize_fake(a, b, kind):
    rows = a.numel() // a.shape[-1] if a.shape[-1] else 0
    return (a.new_empty(rows, a.shape[-1], dtype=STORAGE[kind]),  # type: ignore[index]
            a.new_empty(rows, 1, dtype=torch.float32))  # fmt: skip


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b``: the kernel where it applies (through the custom op ``omnirt::swiglu`` while
    ``torch.compile`` traces), else the eager chain; the same bits."""
    if not kernel_applies(a, b):
        return swiglu_reference(a, b)
    return settings.dispatch(torch.ops.omnirt.swiglu, _swiglu, a, b)


def swiglu_quantize(a: torch.Tensor, b: torch.Tensor, kind: Kind) -> QuantizedRows:
    """``silu(a) * b`` quantized per token for a W8A8 product: one kernel where it applies
    (``omnirt::swiglu_quantize`` while ``torch.compile`` traces), else the eager chain and
    :func:`~.w8a8.quantize`."""
    if not kernel_applies(a, b):
        return quantize(swiglu_reference(a, b), kind)
    values, scale = settings.dispatch(torch.ops.omnirt.swiglu_quantize, _swiglu_quantize, a, b, kind)
    return QuantizedRows(values, scale, kind, tuple(a.shape), a.dtype)


#: The gated unit of a merged W8A8 ``[gate | up]`` product computed in that product's epilogue
#: wherever the Triton GEMM runs it (:func:`swiglu_w8a8`): one kernel where there were two, and
#: the [M, 2H] product never in memory. False: the product, then the gated kernel (the same bits).
GATED_EPILOGUE = True


def swiglu_w8a8(
    x: torch.Tensor | QuantizedRows, qweight: torch.Tensor, weight_scale: torch.Tensor,
    bias: torch.Tensor | None, kind: Kind, out_kind: Kind,
) -> QuantizedRows:  # fmt: skip
    """``silu(gate) * up`` of the W8A8 product ``[gate | up] = x @ W.T + bias`` (``qweight`` a merged
    layer's rows, gate then up: Z-Image's ``w13``), quantized per token as ``out_kind`` for the
    product that reads it. Where the Triton GEMM runs the product
    (:func:`~.w8a8.triton_gemm_runs`) and :data:`GATED_EPILOGUE` holds, the gated unit is that
    GEMM's epilogue (:func:`~.w8a8_gemm.w8a8_gemm` ``gated``) and a second pass quantizes it; else
    :func:`~.w8a8.w8a8_linear`, then :func:`swiglu_quantize`. The same bits either way."""
    x = as_quantized(x, kind, qweight.shape[1])
    if GATED_EPILOGUE and qweight.shape[0] % 2 == 0 and triton_gemm_runs(x, qweight, weight_scale):
        gated = w8a8_gemm(x.values, x.scale, qweight, weight_scale, bias, product_dtype(x), gated=True)
        return quantize(gated.view(*x.shape[:-1], gated.shape[-1]), out_kind)
    gate_up = w8a8_linear(x, qweight, weight_scale, bias, kind)
    width = gate_up.shape[-1] // 2
    return swiglu_quantize(gate_up[..., :width], gate_up[..., width:], out_kind)
