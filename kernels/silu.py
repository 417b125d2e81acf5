"""ATen's SiLU, bit for bit, inside Triton kernels: the gated unit's (``kernels/swiglu.py``), the
few-row product's (``kernels/gemv.py``) and the W8A8 GEMM's gated epilogue (``kernels/w8a8_gemm.py``)
through :func:`gated_values`; the VAE's conv input (``kernels/conv_input.py``) reads the table.

In bf16 ATen computes ``x / (1 + exp(-x))`` in fp32 with CUDA's ``expf`` and rounds it; rather than
reproduce ``expf`` to the last bit, a kernel looks the SiLU of each of the 65536 bf16 values up in
:func:`silu_table`, which ATen computed on the kernel's device. In fp16 and fp32 :func:`silu_rounded`
computes it with libdevice's ``expf`` (the function ATen's kernel calls) and IEEE division; under
``TRITON_INTERPRET=1`` (the CPU, fp32) with numpy's ``exp``, within an ulp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # Triton ships with CUDA builds of torch only
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - depends on the install
    triton = None

_SILU_TABLES: dict[torch.device, torch.Tensor] = {}


def silu_table(device: torch.device) -> torch.Tensor:
    """``F.silu`` of every bf16 value, computed by ATen on ``device`` (so bitwise its SiLU),
    indexed by the value's 16 bits."""
    table = _SILU_TABLES.get(device)
    if table is None:
        bits = torch.arange(65536, dtype=torch.int32, device=device)
        signed = torch.where(bits >= 32768, bits - 65536, bits).to(torch.int16)
        table = _SILU_TABLES[device] = F.silu(signed.view(torch.bfloat16))
    return table


if triton is not None:

    @triton.jit
    def silu_rounded(a, SILU, live, TABLE: tl.constexpr, LIBDEVICE: tl.constexpr):
        """ATen's ``F.silu`` of ``a`` (values of the tensor's dtype), rounded to that dtype, as fp32.
        ``TABLE`` (bf16): looked up in ``SILU`` (:func:`silu_table`) by the value's bits, where
        ``live``; else ``a / (1 + exp(-a))`` in fp32, IEEE division, libdevice's ``expf`` with
        ``LIBDEVICE`` (the GPU) and Triton's ``exp`` without (the interpreter)."""
        if TABLE:
            bits = a.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            s = tl.load(SILU + bits, mask=live, other=0.0).to(tl.float32)
        else:
            af = a.to(tl.float32)
            if LIBDEVICE:
                e = libdevice.exp(-af)
            else:
                e = tl.exp(-af)
            s = tl.math.div_rn(af, 1.0 + e).to(a.dtype).to(tl.float32)
        return s

    @triton.jit
    def gated_values(a, b, SILU, live, TABLE: tl.constexpr, LIBDEVICE: tl.constexpr):
        """The gated unit ``silu(a) * b`` as eager rounds it (``F.silu(a) * b``): ``a`` values of the
        tensors' dtype, ``b`` the same values as fp32; the SiLU rounded, the product of the two
        rounded values in fp32 (exact for bf16), rounded to ``a``'s dtype, returned as fp32."""
        return (silu_rounded(a, SILU, live, TABLE, LIBDEVICE) * b).to(a.dtype).to(tl.float32)
