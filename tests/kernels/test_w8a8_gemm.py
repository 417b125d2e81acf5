"""The W8A8 GEMM of ``kernels/w8a8_gemm.py`` on the CPU under ``TRITON_INTERPRET=1`` (int8: the
interpreter has no fp8 products): bitwise the int32 product followed by the eager epilogue, at
ragged shapes and depths that do not fill a tile; what it refuses, and the tiles it picks."""

from __future__ import annotations

import pytest
import torch
from omnirt.kernels import w8a8_gemm
from omnirt.kernels.w8a8 import _int8_epilogue, quantize_rows

from .conftest import interpreted

SMALL = (
    w8a8_gemm.Config(16, 32, 32, warps=1, stages=1),
    w8a8_gemm.Config(32, 64, 32, warps=1, stages=1),
    w8a8_gemm.Config(32, 64, 32, warps=1, stages=1, group_m=2, tma=True),
)


@interpreted
@pytest.mark.parametrize("config", SMALL, ids=lambda c: c.name())
@pytest.mark.parametrize(("m", "n", "k"), [(37, 72, 48), (130, 200, 160), (5, 16, 32), (64, 64, 64)])
def test_int8_gemm_is_bitwise_the_int_product_and_its_epilogue(config, m, n, k):
    g = torch.Generator().manual_seed(m * n + k)
    xq, x_scale = quantize_rows(torch.randn(m, k, generator=g), "int8")
    qweight, weight_scale = quantize_rows(torch.randn(n, k, generator=g) * 0.1, "int8")
    acc = xq.int() @ qweight.int().t()  # exact: what torch._int_mm gives on CUDA
    for bias in (torch.randn(n, generator=g), None):
        got = w8a8_gemm.w8a8_gemm(xq, x_scale, qweight, weight_scale, bias, torch.float32, config=config)
        assert got.shape == (m, n) and got.dtype == torch.float32
        assert torch.equal(got, _int8_epilogue(acc, x_scale, weight_scale, bias, torch.float32))


@interpreted
def test_rows_of_a_wider_tensor_and_empty_products():
    g = torch.Generator().manual_seed(1)
    wide, x_scale = quantize_rows(torch.randn(20, 96, generator=g), "int8")
    xq = wide[:, :64]  # a row stride of 96
    qweight, weight_scale = quantize_rows(torch.randn(24, 64, generator=g), "int8")
    got = w8a8_gemm.w8a8_gemm(xq, x_scale, qweight, weight_scale, None, torch.float32, config=SMALL[0])
    want = _int8_epilogue(xq.int() @ qweight.int().t(), x_scale, weight_scale, None, torch.float32)
    assert torch.equal(got, want)
    empty = w8a8_gemm.w8a8_gemm(xq[:0], x_scale[:0], qweight, weight_scale, None, torch.float32)
    assert empty.shape == (0, 24)


def test_operands_it_does_not_take_are_refused():
    xq = torch.zeros(8, 32, dtype=torch.int8)
    qweight = torch.zeros(16, 32, dtype=torch.int8)
    x_scale, scale = torch.ones(8, 1), torch.ones(16, 1)
    assert w8a8_gemm.applies(xq, x_scale, qweight, scale)
    cases = {
        "mixed dtypes": (xq, x_scale, qweight.view(torch.float8_e4m3fn), scale),
        "bf16 operands": (xq.bfloat16(), x_scale, qweight.bfloat16(), scale),
        "widths that differ": (xq, x_scale, torch.zeros(16, 48, dtype=torch.int8), scale),
        "K not a multiple of 16": (xq[:, :24], x_scale, qweight[:, :24], scale),
        "a transposed weight": (xq, x_scale, torch.zeros(32, 16, dtype=torch.int8).t(), scale),
        "a scale too few": (xq, torch.ones(4, 1), qweight, scale),
        "a strided scale": (xq, torch.ones(8, 2)[:, :1], qweight, scale),
        "a bf16 scale": (xq, x_scale, qweight, scale.bfloat16()),
    }
    for name, (a, a_scale, b, b_scale) in cases.items():
        assert not w8a8_gemm.applies(a, a_scale, b, b_scale), name
        if w8a8_gemm.triton is not None:
            with pytest.raises(ValueError, match="w8a8_gemm wants"):
                w8a8_gemm.w8a8_gemm(a, a_scale, b, b_scale, None, torch.float32)


def test_tiles_are_the_tuned_ones_for_many_rows_and_small_for_few():
    assert w8a8_gemm.config_for("int8", 4128, 3840, 3840) == w8a8_gemm.TUNED.get(
        ("int8", 3840, 3840), w8a8_gemm.DEFAULT
    )
    assert w8a8_gemm.config_for("fp8", 32, 3840, 3840).bm <= 64
    for config in w8a8_gemm.CONFIGS:
        assert config.bk % 32 == 0 and config.bm % 16 == 0 and config.bn % 16 == 0, config.name()
    with pytest.raises(ValueError, match="a multiple of 32"):
        w8a8_gemm.Config(64, 64, 16)


@interpreted
@pytest.mark.parametrize("config", [None, *SMALL], ids=lambda c: c.name() if c else "chosen")
@pytest.mark.parametrize(("m", "h", "k"), [(37, 40, 48), (130, 96, 160), (3, 16, 32)])
def test_the_gated_epilogue_is_the_product_then_the_gated_unit(config, m, h, k):
    """``gated``: ``silu(gate) * up`` of the merged product, the bits of the product followed by the
    gated kernel (the same interpreter's ``exp``), within an ulp of eager's ``F.silu(a) * b``."""
    from omnirt.kernels.swiglu import swiglu_reference, swiglu_triton

    g = torch.Generator().manual_seed(m + h + k)
    xq, x_scale = quantize_rows(torch.randn(m, k, generator=g), "int8")
    qweight, weight_scale = quantize_rows(torch.randn(2 * h, k, generator=g) * 0.1, "int8")
    for bias in (torch.randn(2 * h, generator=g), None):
        product = w8a8_gemm.w8a8_gemm(xq, x_scale, qweight, weight_scale, bias, torch.float32)
        gated = w8a8_gemm.w8a8_gemm(
            xq, x_scale, qweight, weight_scale, bias, torch.float32, config=config, gated=True
        )
        assert gated.shape == (m, h) and gated.dtype == torch.float32
        assert torch.equal(gated, swiglu_triton(product[:, :h], product[:, h:]))
        eager = swiglu_reference(product[:, :h], product[:, h:])
        torch.testing.assert_close(gated, eager, rtol=3e-7, atol=1e-7)


@interpreted
def test_a_gated_product_wants_gate_and_up_rows():
    xq, x_scale = quantize_rows(torch.randn(4, 32), "int8")
    qweight, weight_scale = quantize_rows(torch.randn(30, 32), "int8")
    with pytest.raises(ValueError, match="gate and up rows, an even count, not 15"):
        w8a8_gemm.w8a8_gemm(xq, x_scale, qweight[:15], weight_scale[:15], None, torch.float32, gated=True)
    assert w8a8_gemm.config_for("int8", 4128, 20480, 3840, gated=True).bn == w8a8_gemm.DEFAULT.bn // 2


@interpreted
@pytest.mark.parametrize(
    "config",
    [
        w8a8_gemm.Config(32, 64, 32, warps=1, stages=1, group_m=2, tma=True, flatten=True),
        w8a8_gemm.Config(32, 64, 32, warps=1, stages=1, group_m=2, tma=True, store_tma=True),
        w8a8_gemm.Config(32, 32, 32, warps=1, stages=1, tma=True, flatten=True, store_tma=True),
    ],
    ids=lambda c: c.name(),
)
@pytest.mark.parametrize("gated", [False, True])
def test_the_tma_variants_are_the_same_product(config, gated):
    """The flattened tile loop and the descriptor's stores: the bits of the pointer form, ragged
    edges (rows and columns past the last whole tile) included."""
    g = torch.Generator().manual_seed(5)
    m, n, k = 70, 112, 96
    xq, x_scale = quantize_rows(torch.randn(m, k, generator=g), "int8")
    qweight, weight_scale = quantize_rows(torch.randn(n, k, generator=g) * 0.1, "int8")
    bias = torch.randn(n, generator=g)
    operands = (xq, x_scale, qweight, weight_scale, bias, torch.float32)
    want = w8a8_gemm.w8a8_gemm(*operands, config=SMALL[0], gated=gated)
    assert torch.equal(w8a8_gemm.w8a8_gemm(*operands, config=config, gated=gated), want)


@interpreted
@pytest.mark.parametrize("config", SMALL[1:], ids=lambda c: c.name())
def test_the_epilogue_finds_the_peak_of_the_last_columns(config):
    """``peak``: the largest magnitude of the output's columns ``peak_from`` on (V of a merged
    QKV product) as stored, found by the epilogue (tiles before those columns add nothing), raised
    from what the buffer held; the product's bits unchanged. ``w8a8_linear`` finds it either way
    (here, off CUDA, over its output)."""
    from omnirt.kernels.w8a8 import w8a8_linear

    g = torch.Generator().manual_seed(9)
    m, n, k = 70, 3 * 48, 64
    xq, x_scale = quantize_rows(torch.randn(m, k, generator=g), "int8")
    qweight, weight_scale = quantize_rows(torch.randn(n, k, generator=g) * 0.1, "int8")
    qweight[:96] *= 3  # q and k larger than v: their columns must not count
    operands = (xq, x_scale, qweight, weight_scale, None, torch.float32)
    want = w8a8_gemm.w8a8_gemm(*operands, config=config)
    for start in (96, 100, 0):
        peak = torch.zeros(1)
        got = w8a8_gemm.w8a8_gemm(*operands, config=config, peak=peak, peak_from=start)
        assert torch.equal(got, want) and torch.equal(peak, want[:, start:].abs().amax().view(1))
    assert want.abs().amax() > want[:, 96:].abs().amax()
    peak = torch.full((1,), 1e9)  # raised, never lowered
    w8a8_gemm.w8a8_gemm(*operands, config=config, peak=peak, peak_from=96)
    assert peak.item() == 1e9
    with pytest.raises(ValueError, match="peak must be fp32"):
        w8a8_gemm.w8a8_gemm(*operands, peak=torch.zeros(2), peak_from=96)
    x = torch.randn(3, m // 3 + 1, k, generator=g)
    peak = torch.zeros(1)
    out = w8a8_linear(x, qweight, weight_scale, None, "int8", peak, 96)
    assert torch.equal(peak, out[..., 96:].abs().amax().view(1))
