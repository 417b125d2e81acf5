"""W8A8 matrix products: 8-bit weights (one scale per output channel) times 8-bit activations
(one scale per token, quantized on the fly), for the DiT's linear layers.

- ``int8``: symmetric int8 both sides, ``torch._int_mm`` (int32 accumulation, exact), then the
  two scales and the bias in fp32, rounded once to the output dtype.
- ``fp8``: e4m3 both sides, ``torch._scaled_mm`` with row-wise scales (Hopper's FP8 tensor cores;
  the CPU has a reference implementation), the scales and bias applied inside.

:func:`w8a8_linear_reference` is the dequantized product (the quantized operands times their
scales, multiplied in fp32): what the fast paths must equal up to fp32 rounding. Weights are
quantized once (:func:`quantize_rows` of ``[out, in]``), activations on every call.
"""

from __future__ import annotations

from typing import Literal

import torch

Kind = Literal["int8", "fp8"]
KINDS: tuple[Kind, ...] = ("int8", "fp8")
#: The largest magnitude of each format (int8 is kept symmetric: -127..127).
QMAX: dict[str, float] = {"int8": 127.0, "fp8": 448.0}
STORAGE: dict[str, torch.dtype] = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
#: ``torch._int_mm`` on CUDA wants more than 16 rows; fewer are padded with zero rows.
_INT_MM_MIN_ROWS = 17


def check_kind(kind: str) -> Kind:
    if kind not in KINDS:
        raise ValueError(f"quantization must be one of {', '.join(KINDS)}, not {kind!r}")
    return kind  # type: ignore[return-value]


def quantize_rows(x: torch.Tensor, kind: Kind) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [rows, cols] as 8-bit values and one fp32 scale per row [rows, 1], symmetric:
    ``x ~ q * scale`` with the row's largest magnitude mapped to the format's largest value."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)
    scale = amax / QMAX[kind]
    scaled = xf / scale
    if kind == "int8":
        return scaled.round_().clamp_(-127, 127).to(torch.int8), scale
    return scaled.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn), scale


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


def w8a8_linear(
    x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, kind: Kind
) -> torch.Tensor:
    """``x @ W.T + bias`` with ``W ~ qweight * weight_scale`` (``qweight`` [out, in] 8-bit,
    ``weight_scale`` [out, 1] fp32) and ``x`` [..., in] quantized per token; returns ``x``'s dtype."""
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    xq, x_scale = quantize_rows(rows, kind)
    if kind == "int8":
        if xq.is_cuda and count < _INT_MM_MIN_ROWS:
            xq = torch.cat([xq, xq.new_zeros(_INT_MM_MIN_ROWS - count, xq.shape[1])])
        acc = torch._int_mm(xq, qweight.t())[:count]
        out = acc.float() * x_scale * weight_scale.t()
        if bias is not None:
            out = out + bias.float()
        out = out.to(x.dtype)
    else:
        out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
        out = torch._scaled_mm(
            xq,
            qweight.t(),
            scale_a=x_scale,
            scale_b=weight_scale.t().contiguous(),
            bias=None if bias is None else bias.to(out_dtype),
            out_dtype=out_dtype,
        )
    return out.view(*x.shape[:-1], qweight.shape[0])
