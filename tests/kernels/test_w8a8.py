"""kernels/w8a8.py: per-row 8-bit quantization and the W8A8 products (int8 through
``torch._int_mm``, fp8 through ``torch._scaled_mm``) against the dequantized reference, on the CPU."""

from __future__ import annotations

import pytest
import torch
from omnirt.kernels.w8a8 import (
    QMAX,
    QuantizedRows,
    _dequantized_product,
    quantize_rows,
    w8a8_linear,
    w8a8_linear_reference,
)

from .conftest import interpreted


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


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_the_fp32_product_for_widths_no_gemm_takes(kind):
    """``_dequantized_product`` (what CUDA runs for fp8 widths that neither ``_scaled_mm`` nor the
    Triton GEMM takes): the library's product from the same 8-bit values, here on the CPU."""
    g = torch.Generator().manual_seed(3)
    qweight, scale = quantize_rows(torch.randn(40, 24, generator=g) * 0.1, kind)
    xq, x_scale = quantize_rows(torch.randn(5, 24, generator=g), kind)
    rows = QuantizedRows(xq, x_scale, kind, (5, 24), torch.float32)
    for bias in (torch.randn(40, generator=g), None):
        want = w8a8_linear(rows, qweight, scale, bias, kind)
        got = _dequantized_product(xq, x_scale, qweight, scale, bias, torch.float32)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@interpreted
@pytest.mark.parametrize("hold", [False, True], ids=["read-again", "held"])
def test_quantize_kernel_is_bitwise_the_eager_chain(hold, monkeypatch):
    """The per-token quantization, each row read again for its values or (``settings.HOLD_ROWS``)
    read once as one block and held, up to ``HOLD_WIDTH`` wide (wider rows are read again)."""
    from omnirt.kernels import settings
    from omnirt.kernels.w8a8 import quantize_rows_triton

    monkeypatch.setattr(settings, "HOLD_ROWS", hold)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, 300, generator=g) * torch.logspace(-3, 3, 7).unsqueeze(1)
    x[3] = 0.0  # an all-zero row
    x[5, 17] = 1e4  # one outlier sets its row's scale
    wide = torch.randn(3, 5000, generator=g)  # more columns than one block
    strided = torch.randn(4, 96, generator=g)[:, :64]  # rows of a wider tensor
    widest = torch.randn(2, 16385, generator=g)  # wider than HOLD_WIDTH: read again either way
    for rows in (x, wide, strided, widest):
        got_q, got_scale = quantize_rows_triton(rows, "int8")
        want_q, want_scale = quantize_rows(rows, "int8")
        assert torch.equal(got_q, want_q) and torch.equal(got_scale, want_scale)
    with pytest.raises(ValueError, match="unit column stride"):
        quantize_rows_triton(x.t(), "int8")


@interpreted
def test_int8_epilogue_kernel_is_bitwise_the_eager_chain():
    from omnirt.kernels.w8a8 import _int8_epilogue, int8_epilogue_triton

    g = torch.Generator().manual_seed(3)
    acc = torch.randint(-(2**20), 2**20, (45, 200), generator=g, dtype=torch.int32)
    x_scale = torch.rand(45, 1, generator=g) * 1e-2
    weight_scale = torch.rand(200, 1, generator=g) * 1e-3
    for bias in (torch.randn(200, generator=g), None):
        got = int8_epilogue_triton(acc, x_scale, weight_scale, bias, torch.float32)
        assert torch.equal(got, _int8_epilogue(acc, x_scale, weight_scale, bias, torch.float32))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_products_of_activations_quantized_once(kind):
    """``QuantizedRows`` (what a norm or gated-unit kernel writes) go into a product as they are:
    the same output as quantizing inside; a kind or width the layer does not take is refused."""
    from omnirt.kernels.w8a8 import quantize

    g = torch.Generator().manual_seed(4)
    qweight, scale = quantize_rows(torch.randn(24, 32, generator=g), kind)
    x = torch.randn(2, 5, 32, generator=g).bfloat16()
    rows = quantize(x, kind)
    assert rows.shape == (2, 5, 32) and rows.values.shape == (10, 32) and rows.dtype == torch.bfloat16
    got = w8a8_linear(rows, qweight, scale, None, kind)
    assert got.shape == (2, 5, 24) and torch.equal(got, w8a8_linear(x, qweight, scale, None, kind))
    other = "fp8" if kind == "int8" else "int8"
    with pytest.raises(ValueError, match=f"{other} activations of 32 columns for a {kind} layer"):
        w8a8_linear(quantize(x, other), qweight, scale, None, kind)
    with pytest.raises(ValueError, match="of 16 columns"):
        w8a8_linear(quantize(x[..., :16], kind), qweight, scale, None, kind)


def test_gemm_as_sets_the_gemm_for_a_block_and_restores_it():
    from omnirt.kernels import w8a8

    before = dict(w8a8.GEMM)
    with w8a8.gemm_as("library", ("fp8",)):
        assert w8a8.GEMM == {**before, "fp8": "library"}
    assert w8a8.GEMM == before
    with pytest.raises(ValueError, match="one of auto, library, triton"), w8a8.gemm_as("cublas"):
        pass
    assert w8a8.GEMM == before
