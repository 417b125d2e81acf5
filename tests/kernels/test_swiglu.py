"""kernels/swiglu.py on the CPU: the gated unit's kernel under Triton's interpreter (fp32) against
the eager chain (diffusers' ``silu(a) * b``), the quantizing variant bitwise the eager
quantization of the kernel's own product, strided halves of one merged product, the refusals and
the dispatchers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from omnirt.kernels.swiglu import (
    kernel_applies,
    swiglu,
    swiglu_quantize,
    swiglu_quantize_triton,
    swiglu_reference,
    swiglu_triton,
)
from omnirt.kernels.w8a8 import quantize_rows

from .conftest import interpreted


def _gate_up(rows: int, width: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 2 * width, generator=g) * 4


def test_the_reference_is_diffusers_gating():
    from diffusers.models.transformers.transformer_z_image import FeedForward

    ffn = FeedForward(16, 48)
    a, b = _gate_up(5, 48).chunk(2, dim=-1)
    assert torch.equal(swiglu_reference(a, b), ffn._forward_silu_gating(a, b))


@interpreted
@pytest.mark.parametrize("shape", [(7, 300), (3, 5000), (4, 2048), (1, 40)], ids=str)
def test_kernel_is_the_eager_chain(shape):
    rows, width = shape
    gate_up = _gate_up(rows, width)
    a, b = gate_up[:, :width], gate_up[:, width:]  # halves of one merged product: strided rows
    got = swiglu_triton(a, b)
    # fp32 under the interpreter: numpy's exp, not CUDA's expf (the GPU tests check the bits)
    torch.testing.assert_close(got, F.silu(a) * b, rtol=4e-7, atol=1e-7)  # two roundings, an ulp each
    assert got.shape == a.shape and got.is_contiguous()
    values, scale = swiglu_quantize_triton(a, b, "int8")
    want_values, want_scale = quantize_rows(got, "int8")  # the kernel's own product, quantized
    assert torch.equal(values, want_values) and torch.equal(scale, want_scale)
    batched = swiglu_triton(a.reshape(1, rows, width).contiguous(), b.reshape(1, rows, width).contiguous())
    assert batched.shape == (1, rows, width) and torch.equal(batched[0], got)


@interpreted
def test_refusals():
    a, b = _gate_up(4, 64).chunk(2, dim=-1)
    bad = [
        (a, b[:, :32], "one shape and dtype"),
        (a, b.double(), "one shape and dtype"),
        (a.int(), b.int(), "dtype"),
        (a.t(), b.t(), "contiguous last dim"),
        (torch.randn(2, 3, 64)[:, ::2], torch.randn(2, 3, 64)[:, ::2], "rows of one stride"),
    ]
    for x, y, words in bad:
        with pytest.raises(ValueError, match=words):
            swiglu_triton(x, y)
    with pytest.raises(KeyError):
        swiglu_quantize_triton(a, b, "int4")  # type: ignore[arg-type]


def test_the_dispatchers_run_the_eager_chain_off_cuda():
    a, b = _gate_up(6, 96).bfloat16().chunk(2, dim=-1)
    assert not kernel_applies(a, b)
    assert torch.equal(swiglu(a, b), F.silu(a) * b)
    got = swiglu_quantize(a, b, "fp8")
    want_values, want_scale = quantize_rows(F.silu(a) * b, "fp8")
    assert torch.equal(got.values.view(torch.int8), want_values.view(torch.int8))
    assert torch.equal(got.scale, want_scale)
    assert got.shape == (6, 96) and got.dtype == torch.bfloat16 and got.kind == "fp8"


@interpreted
def test_custom_ops_schema_fake_and_kernel():
    """``omnirt::swiglu`` and ``omnirt::swiglu_quantize`` (what ``torch.compile`` traces): schemas
    and fakes agree with the kernels, which they run."""
    a, b = _gate_up(5, 64).chunk(2, dim=-1)
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.omnirt.swiglu.default, (a, b), test_utils=checks)
    torch.library.opcheck(torch.ops.omnirt.swiglu_quantize.default, (a, b, "int8"), test_utils=checks)
    assert torch.equal(torch.ops.omnirt.swiglu(a, b), swiglu_triton(a, b))
    values, scale = torch.ops.omnirt.swiglu_quantize(a, b, "int8")
    want_values, want_scale = swiglu_quantize_triton(a, b, "int8")
    assert values.shape == (5, 64) and scale.shape == (5, 1)
    assert torch.equal(values, want_values) and torch.equal(scale, want_scale)


def test_the_gated_w8a8_product_off_cuda_is_the_product_then_the_gated_unit():
    """``swiglu_w8a8`` where no Triton GEMM runs (the CPU): the merged product, then
    ``swiglu_quantize`` of its halves; activations of another kind or width are refused."""
    from omnirt.kernels.swiglu import swiglu_w8a8
    from omnirt.kernels.w8a8 import quantize, w8a8_linear

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 64, generator=g).bfloat16()
    qweight, weight_scale = quantize_rows(torch.randn(96, 64, generator=g) * 0.1, "int8")
    bias = torch.randn(96, generator=g).bfloat16()
    got = swiglu_w8a8(x, qweight, weight_scale, bias, "int8", "fp8")
    product = w8a8_linear(x, qweight, weight_scale, bias, "int8")
    want = swiglu_quantize(product[..., :48], product[..., 48:], "fp8")
    assert got.shape == (2, 5, 48) and got.kind == "fp8" and torch.equal(got.scale, want.scale)
    assert torch.equal(got.values.view(torch.int8), want.values.view(torch.int8))
    with pytest.raises(ValueError, match="fp8 activations of 64 columns for a int8 layer"):
        swiglu_w8a8(quantize(x, "fp8"), qweight, weight_scale, bias, "int8", "fp8")
