"""The W8A8 GEMM of ``kernels/w8a8_gemm.py`` on the GPU (marker ``gpu``): int8 bitwise the
``torch._int_mm`` path of ``kernels/w8a8.py`` in bf16 at every tile configuration, fp8 within
bf16 rounding of ``torch._scaled_mm``'s row-wise product, and captured in a CUDA graph whose
replays follow new inputs."""

from __future__ import annotations

import pytest
import torch
from omnirt.kernels import w8a8, w8a8_gemm
from omnirt.kernels.w8a8 import (
    QuantizedRows,
    _dequantized_product,
    quantize_rows,
    quantize_rows_triton,
    w8a8_linear,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _operands(kind, m, n, k, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(m, k, device="cuda", generator=g) * 2).to(torch.bfloat16)
    qweight, weight_scale = quantize_rows(torch.randn(n, k, device="cuda", generator=g) * k**-0.5, kind)
    bias = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    xq, x_scale = quantize_rows_triton(x, kind)
    return x, xq, x_scale, qweight, weight_scale, bias


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize(("m", "n", "k"), [(4128, 3840, 3840), (333, 1000, 272), (17, 256, 512), (1, 64, 64)])
def test_the_gemm_against_the_library_products(kind, m, n, k, monkeypatch):
    x, xq, x_scale, qweight, weight_scale, bias = _operands(kind, m, n, k)
    monkeypatch.setitem(w8a8.GEMM, kind, "library")  # the layers' default is this GEMM on Hopper
    rows = QuantizedRows(xq, x_scale, kind, (m, k), x.dtype)
    for b in (bias, None):
        if kind == "fp8" and n % 16:  # cuBLAS's fp8 product takes no such width: the sums in fp32
            want = _dequantized_product(xq, x_scale, qweight, weight_scale, b, x.dtype)
            routed = w8a8_gemm.w8a8_gemm(xq, x_scale, qweight, weight_scale, b, x.dtype)  # any GEMM setting
            assert torch.equal(w8a8_linear(rows, qweight, weight_scale, b, kind), routed)
        else:
            want = w8a8_linear(rows, qweight, weight_scale, b, kind)
        for config in (None,) + w8a8_gemm.CONFIGS:
            got = w8a8_gemm.w8a8_gemm(xq, x_scale, qweight, weight_scale, b, x.dtype, config=config)
            assert got.dtype == torch.bfloat16 and got.shape == (m, n)
            if kind == "int8":
                assert torch.equal(got, want), config
            else:  # fp32 sums in another order, then one bf16 rounding each
                peak = want.float().abs().max()
                assert (got.float() - want.float()).abs().max() <= 2e-2 * peak, config


def test_fp8_widths_no_gemm_takes_run_in_fp32():
    """An fp8 layer with K not a multiple of 16 (neither ``_scaled_mm`` nor the GEMM takes it): the
    product in fp32 from the 8-bit values, close to bf16's on the dequantized operands."""
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(40, 200, device="cuda", generator=g).to(torch.bfloat16)
    qweight, weight_scale = quantize_rows(torch.randn(1000, 200, device="cuda", generator=g) * 0.07, "fp8")
    bias = torch.randn(1000, device="cuda", generator=g).to(torch.bfloat16)
    xq, x_scale = quantize_rows(x, "fp8")
    rows = QuantizedRows(xq, x_scale, "fp8", (40, 200), x.dtype)
    got = w8a8_linear(rows, qweight, weight_scale, bias, "fp8")
    want = (xq.float() * x_scale) @ (qweight.float() * weight_scale).t() + bias.float()
    assert got.dtype == torch.bfloat16 and (got.float() - want).abs().max() <= 1e-2 * want.abs().max()


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_the_gemm_replays_from_a_cuda_graph_with_new_inputs(kind):
    x, xq, x_scale, qweight, weight_scale, bias = _operands(kind, 300, 512, 256)
    w8a8_gemm.w8a8_gemm(xq, x_scale, qweight, weight_scale, bias, x.dtype)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w8a8_gemm.w8a8_gemm(xq, x_scale, qweight, weight_scale, bias, x.dtype)
    _, xq2, x_scale2, *_ = _operands(kind, 300, 512, 256, seed=1)
    xq.copy_(xq2)
    x_scale.copy_(x_scale2)
    graph.replay()
    want = w8a8_gemm.w8a8_gemm(xq2, x_scale2, qweight, weight_scale, bias, x.dtype)
    assert torch.equal(out, want)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize(("m", "h", "k"), [(4128, 10240, 3840), (333, 640, 272), (17, 256, 512)])
def test_the_gated_epilogue_is_bitwise_the_product_then_the_gated_kernel(kind, m, h, k, monkeypatch):
    """``swiglu_w8a8`` with the gated unit in the GEMM's epilogue against the GEMM's product, then
    ``swiglu_quantize`` (``GATED_EPILOGUE`` off): the same 8-bit values and scales for ``w2``; and
    the gated output itself bitwise the product followed by the gated kernel, at every tile."""
    from omnirt.kernels import swiglu

    x, xq, x_scale, qweight, weight_scale, bias = _operands(kind, m, 2 * h, k)
    rows = QuantizedRows(xq, x_scale, kind, (m, k), x.dtype)
    monkeypatch.setitem(w8a8.GEMM, kind, "triton")
    for b in (bias, None):
        product = w8a8_gemm.w8a8_gemm(xq, x_scale, qweight, weight_scale, b, x.dtype)
        want = swiglu.swiglu_triton(product[:, :h], product[:, h:])
        for config in (None, w8a8_gemm.Config(128, 128, 128, warps=8, stages=3)):
            got = w8a8_gemm.w8a8_gemm(
                xq, x_scale, qweight, weight_scale, b, x.dtype, config=config, gated=True
            )
            assert got.shape == (m, h) and torch.equal(got, want), config
        fused = swiglu.swiglu_w8a8(rows, qweight, weight_scale, b, kind, "fp8")
        monkeypatch.setattr(swiglu, "GATED_EPILOGUE", False)
        split = swiglu.swiglu_w8a8(rows, qweight, weight_scale, b, kind, "fp8")
        monkeypatch.setattr(swiglu, "GATED_EPILOGUE", True)
        assert torch.equal(fused.scale, split.scale)
        assert torch.equal(fused.values.view(torch.uint8), split.values.view(torch.uint8))
