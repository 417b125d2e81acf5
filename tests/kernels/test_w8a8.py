"""kernels/w8a8.py: per-row 8-bit quantization and the W8A8 products (int8 through
``torch._int_mm``, fp8 through ``torch._scaled_mm``) against the dequantized reference, on the CPU."""

from __future__ import annotations

import pytest
import torch
from omnirt.kernels.w8a8 import QMAX, quantize_rows, w8a8_linear, w8a8_linear_reference


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_rows_are_quantized_symmetrically(kind):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 40, generator=g) * torch.tensor([0.01, 1, 3, 100, 1e-3, 7]).unsqueeze(1)
    q, scale = quantize_rows(x, kind)
    assert q.dtype == (torch.int8 if kind == "int8" else torch.float8_e4m3fn) and scale.shape == (6, 1)
    back = q.float() * scale
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((6,), QMAX[kind]))  # each row's peak
    relative = ((back - x).norm(dim=1) / x.norm(dim=1)).max()
    assert relative < (0.01 if kind == "int8" else 0.05)
    zero_q, zero_scale = quantize_rows(torch.zeros(2, 8), kind)  # an all-zero row stays zero
    assert torch.equal(zero_q.float(), torch.zeros(2, 8)) and bool((zero_scale > 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_products_equal_the_dequantized_reference(kind, dtype):
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(48, 64, generator=g) * 0.05
    qweight, scale = quantize_rows(weight, kind)
    for bias in (torch.randn(48, generator=g), None):
        x = torch.randn(2, 3, 64, generator=g).to(dtype)  # leading dims kept
        got = w8a8_linear(x, qweight, scale, bias, kind)
        want = w8a8_linear_reference(x, qweight, scale, bias, kind)
        assert got.shape == (2, 3, 48) and got.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        exact = (x.float() @ weight.t() + (0 if bias is None else bias)).to(dtype)
        error = (got.float() - exact.float()).norm() / exact.float().norm()
        assert error < (0.02 if kind == "int8" else 0.08)  # close to the unquantized product
