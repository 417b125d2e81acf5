"""kernels/rms_norm.py on the CPU: the Triton kernel under Triton's interpreter (fp32) against the
eager chain (transformers' residual add and ``RMSNorm``), its sums of squares in ATen's order
(NumPy yardstick), the launch configurations read from ATen's source, the checks, the dispatcher,
and the speech decoders' use of it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omnirt.kernels import settings
from omnirt.kernels.reduce_order import aten_mean_config, mean_sumsq_reference
from omnirt.kernels.rms_norm import (
    add_rms_norm,
    add_rms_norm_reference,
    add_rms_norm_triton,
    kernel_applies,
    modulate_applies,
    rms_norm_modulate,
    rms_norm_modulate_reference,
    rms_norm_modulate_triton,
)
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeTextRMSNorm

from .conftest import interpreted

# (width, rows): the demo model's widths (read element by element) and the real model's (as
# 4-element vectors), at row counts that give each a different launch
SHAPES = [
    (32, 1), (64, 5), (64, 40), (128, 3), (1024, 1), (1024, 4), (2048, 1), (2048, 3), (2048, 8), (1024, 16),
    (2048, 40),
]


def _inputs(width: int, rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g) * 3
    return x, torch.randn(rows, width, generator=g), torch.randn(width, generator=g)


def test_the_reference_is_transformers_rms_norm():
    x, d, w = _inputs(2048, 3)
    norm = Qwen3OmniMoeTextRMSNorm(2048, eps=1e-6)
    norm.weight.data.copy_(w)
    for dtype in (torch.float32, torch.bfloat16):
        xs, ds, ns = x.to(dtype), d.to(dtype), norm.to(dtype)
        summed, out = add_rms_norm_reference(xs, ds, ns.weight, 1e-6)
        assert torch.equal(summed, xs + ds) and torch.equal(out, ns(xs + ds))


def test_launch_configurations_follow_aten():
    # (steps, lanes, vector): set_block_dimension's 512 threads, a warp's width first
    assert aten_mean_config(2048, 1) == (1, 512, 4)  # one row: 512 lanes of one vector
    assert aten_mean_config(2048, 2) == (2, 256, 4)
    assert aten_mean_config(2048, 16) == (16, 32, 4)  # from 16 rows: a warp a row
    assert aten_mean_config(2048, 512) == (16, 32, 4)
    assert aten_mean_config(1024, 4) == (2, 128, 4)
    # a head of 128 is one vector a lane over a warp: the order the H200 measured for the
    # q/k norms (kernels/qk_norm_rope.py, COMPOSITE_SUM "vec4_halving")
    assert all(aten_mean_config(128, rows) == (1, 32, 4) for rows in (1, 7, 64, 4096))
    assert aten_mean_config(64, 1) == (1, 64, 1) and aten_mean_config(64, 40) == (2, 32, 1)
    assert aten_mean_config(8192, 128) is None  # ATen would split a row over warps
    # Z-Image's 3840: 960 vectors, 30 for each lane of a warp; Wan's 1536 over 4 rows: 3 of 128
    assert aten_mean_config(3840, 4128) == (30, 32, 4) and aten_mean_config(3840, 16) == (30, 32, 4)
    assert aten_mean_config(1536, 4) == (3, 128, 4)
    assert aten_mean_config(3840, 1) is None  # 512 lanes: some lanes read one vector fewer
    assert aten_mean_config(1000, 20) is None and aten_mean_config(3842, 20) is None


@interpreted
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{w}x{r}" for w, r in SHAPES])
def test_kernel_is_the_eager_chain_with_atens_sums(shape):
    width, rows = shape
    x, d, w = _inputs(width, rows)
    sums = torch.empty(rows)
    summed, out = add_rms_norm_triton(x, d, w, 1e-6, sumsq=sums)
    want_sum, want = add_rms_norm_reference(x, d, w, 1e-6)
    assert torch.equal(summed, want_sum)  # the residual stream, exactly
    # the sums of squares in ATen's order, bit for bit; the output as close as fp32 allows (the
    # CPU's eager mean adds in another order)
    order = aten_mean_config(width, rows)
    assert np.array_equal(sums.numpy(), mean_sumsq_reference(want_sum.numpy(), *order))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@interpreted
@pytest.mark.parametrize("shape", [(1024, 1), (2048, 3), (1024, 16)], ids=str)
def test_moshis_chain_has_atens_sums(shape):
    width, rows = shape
    x, d, w = _inputs(width, rows)
    sums = torch.empty(rows)
    summed, out = add_rms_norm_triton(x, d, w, 1e-6, sumsq=sums, chain="moshi")
    want_sum, want = add_rms_norm_reference(x, d, w, 1e-6, chain="moshi")
    assert torch.equal(summed, want_sum)
    order = aten_mean_config(width, rows)
    assert np.array_equal(sums.numpy(), mean_sumsq_reference(want_sum.numpy(), *order))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="chain"):
        add_rms_norm_triton(x, d, w, 1e-6, chain="llama")


def test_moshis_reference_is_transformers_moshi_rms_norm():
    """In bf16 the two chains round differently; ``moshi`` is transformers' ``MoshiRMSNorm``."""
    from transformers.models.moshi.modeling_moshi import MoshiRMSNorm

    g = torch.Generator().manual_seed(4)
    x = (torch.randn(64, 512, generator=g) * 3).bfloat16()
    w = (torch.rand(512, generator=g) + 0.5).bfloat16()
    module = MoshiRMSNorm(512, eps=1e-5).to(torch.bfloat16)
    module.weight.data.copy_(w)
    moshi = add_rms_norm_reference(x, None, w, 1e-5, chain="moshi")[1]
    assert torch.equal(moshi, module(x))
    assert not torch.equal(moshi, add_rms_norm_reference(x, None, w, 1e-5)[1])


@interpreted
def test_without_a_delta_and_the_fast_preset():
    x, _, w = _inputs(1024, 6)
    for preset in ("exact", "fast"):
        summed, out = add_rms_norm_triton(x.view(2, 3, 1024), None, w, 1e-5, preset=preset)
        assert summed.data_ptr() == x.data_ptr()  # no sum: x itself
        torch.testing.assert_close(out.view(6, 1024), add_rms_norm_reference(x, None, w, 1e-5)[1])


@interpreted
def test_unsupported_inputs_are_refused():
    x, d, w = _inputs(1024, 2)
    bad = [
        (x[:, :1022].contiguous(), None, w[:1022], "multiple of 4"),
        (x[:, :96].contiguous(), None, w[:96], "power of two"),
        (x.t(), None, torch.ones(2), "contiguous"),
        (x, d[:1], w, "contiguous"),
        (x, d.double(), w, "dtype"),
        (x, d, w.half(), "weight"),
        (x.long(), None, w, "dtype"),
    ]
    for xs, ds, ws, words in bad:
        with pytest.raises(ValueError, match=words):
            add_rms_norm_triton(xs, ds, ws, 1e-6)


@interpreted
def test_custom_ops():
    x, d, w = _inputs(256, 3)
    calls = [
        (torch.ops.omnirt.add_rms_norm.default, (x, d, w, 1e-6, "exact")),
        (torch.ops.omnirt.rms_norm.default, (x, w, 1e-6, "exact")),
    ]
    for op, args in calls:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    summed, out = torch.ops.omnirt.add_rms_norm(x, d, w, 1e-6, "exact")
    assert torch.equal(summed, x + d)
    assert torch.equal(torch.ops.omnirt.rms_norm(summed, w, 1e-6, "exact"), out)


def test_the_dispatcher_runs_the_eager_chain_off_cuda():
    x, d, w = _inputs(2048, 2)
    assert not kernel_applies(x, d, w)
    summed, out = add_rms_norm(x, d, w, 1e-6)
    want_sum, want = add_rms_norm_reference(x, d, w, 1e-6)
    assert torch.equal(summed, want_sum) and torch.equal(out, want)
    before = settings.FUSED
    try:
        settings.set_fused("on")
        assert not kernel_applies(x, d, w)  # CPU tensors: never from the dispatcher
    finally:
        settings.set_fused(before)


# -- modulated: residual + mul * RMSNorm(x) ------------------------------------------------------
def _dit_inputs(batch: int, tokens: int, width: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, tokens, width, generator=g) * 2
    return (
        x,
        torch.randn(width, generator=g),  # the norm's weight
        1 + torch.randn(batch, 1, width, generator=g) * 0.1,  # scale: 1 + adaLN's
        torch.tanh(torch.randn(batch, 1, width, generator=g)),  # gate
        torch.randn(batch, tokens, width, generator=g),  # the residual stream
    )


def test_the_modulated_reference_is_diffusers_block_chain():
    from diffusers.models.normalization import RMSNorm

    x, w, scale, gate, residual = _dit_inputs(2, 5, 256)
    norm = RMSNorm(256, eps=1e-5)
    norm.weight.data.copy_(w)
    for dtype in (torch.float32, torch.bfloat16):
        xs, ns, sc, gt, res = x.to(dtype), norm.to(dtype), scale.to(dtype), gate.to(dtype), residual.to(dtype)
        assert torch.equal(rms_norm_modulate_reference(xs, ns.weight, 1e-5, sc), ns(xs) * sc)
        assert torch.equal(rms_norm_modulate_reference(xs, ns.weight, 1e-5, gt, res), res + gt * ns(xs))
        assert torch.equal(rms_norm_modulate_reference(xs, ns.weight, 1e-5, None, res), res + ns(xs))


# (batch, tokens, width): Z-Image's width at a few rows, two samples of per-sample modulation
DIT_SHAPES = [(1, 16, 3840), (2, 9, 3840), (2, 20, 256), (1, 3, 1024)]


@interpreted
@pytest.mark.parametrize("shape", DIT_SHAPES, ids=[f"{b}x{t}x{w}" for b, t, w in DIT_SHAPES])
def test_modulated_kernel_is_the_eager_chain_with_atens_sums(shape):
    batch, tokens, width = shape
    x, w, scale, gate, residual = _dit_inputs(batch, tokens, width)
    rows = batch * tokens
    for mul, res in ((scale, None), (gate, residual), (None, residual), (scale[:1, :, :], None)):
        sums = torch.empty(rows)
        out = rms_norm_modulate_triton(x, w, 1e-5, mul, res, sumsq=sums)
        want = rms_norm_modulate_reference(x, w, 1e-5, mul, res)
        order = aten_mean_config(width, rows)
        if order is not None:
            assert np.array_equal(sums.numpy(), mean_sumsq_reference(x.reshape(rows, width).numpy(), *order))
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        # each sample's rows take that sample's vector: swapping the samples' vectors changes them
        if mul is not None and mul.shape[0] == batch > 1:
            swapped = rms_norm_modulate_triton(x, w, 1e-5, mul.flip(0).contiguous(), res)
            torch.testing.assert_close(swapped, rms_norm_modulate_reference(x, w, 1e-5, mul.flip(0), res))
            assert not torch.allclose(swapped, out)


@interpreted
def test_modulated_fast_preset_and_refusals():
    x, w, scale, gate, residual = _dit_inputs(2, 4, 3840)
    fast = rms_norm_modulate_triton(x, w, 1e-5, gate, residual, preset="fast")
    torch.testing.assert_close(fast, rms_norm_modulate_reference(x, w, 1e-5, gate, residual))
    bad = [
        (x, scale.double(), None, "dtype"),
        (x, scale.expand(2, 4, 3840), None, r"\[B, 1, C\]"),
        (x, scale[:, :, :100], None, r"\[B, 1, C\]"),
        (x, scale, residual[:1], "residual"),
        (x, scale, residual.transpose(0, 1), "residual"),
    ]
    for xs, mul, res, words in bad:
        with pytest.raises(ValueError, match=words):
            rms_norm_modulate_triton(xs, w, 1e-5, mul, res)


@interpreted
def test_modulated_custom_op():
    x, w, scale, gate, residual = _dit_inputs(2, 3, 256)
    for args in ((x, w, 1e-5, "exact", scale, None), (x, w, 1e-5, "exact", gate, residual)):
        torch.library.opcheck(
            torch.ops.omnirt.rms_norm_modulate.default, args, test_utils=("test_schema", "test_faketensor")
        )


def test_the_modulated_dispatcher_runs_the_eager_chain_off_cuda():
    x, w, scale, gate, residual = _dit_inputs(1, 16, 3840)
    x, w, gate, residual = (t.bfloat16() for t in (x, w, gate, residual))
    assert not modulate_applies(x, w, gate, residual)
    assert torch.equal(rms_norm_modulate(x, w, 1e-5, gate, residual),
                       rms_norm_modulate_reference(x, w, 1e-5, gate, residual))  # fmt: skip


@interpreted
@pytest.mark.parametrize("shape", [(2, 9, 3840), (2, 20, 256)], ids=str)
def test_the_quantizing_kernel_writes_the_norms_rows_quantized(shape):
    """``rms_norm_modulate_quantize``: the norm's output never stored, its rows quantized in the
    kernel exactly as ``w8a8.quantize_rows`` quantizes the stored output (int8: the interpreter
    has no fp8)."""
    from omnirt.kernels.rms_norm import rms_norm_modulate_quantize, rms_norm_modulate_quantize_triton
    from omnirt.kernels.w8a8 import quantize_rows

    batch, tokens, width = shape
    x, w, scale, _, _ = _dit_inputs(*shape)
    x[0, 3] *= 50  # one row with an outlier: its own scale
    for mul in (scale, None, scale[:1])[: 1 if width > 256 else 3]:  # the interpreter is slow at 3840
        values, row_scale = rms_norm_modulate_quantize_triton(x, w, 1e-5, mul, "int8")
        want_values, want_scale = quantize_rows(
            rms_norm_modulate_triton(x, w, 1e-5, mul).reshape(-1, width), "int8"
        )
        assert values.shape == (batch * tokens, width) and row_scale.shape == (batch * tokens, 1)
        assert torch.equal(values, want_values) and torch.equal(row_scale, want_scale)
    # off CUDA the dispatcher quantizes the eager chain's output
    got = rms_norm_modulate_quantize(x, w, 1e-5, scale, "int8")
    eager = rms_norm_modulate_reference(x, w, 1e-5, scale).reshape(-1, width)
    want_values, want_scale = quantize_rows(eager, "int8")
    assert torch.equal(got.values, want_values) and torch.equal(got.scale, want_scale)
    assert got.shape == tuple(x.shape) and got.dtype == x.dtype and got.kind == "int8"
    with pytest.raises(ValueError, match="int8, fp8"):
        rms_norm_modulate_quantize_triton(x, w, 1e-5, scale, "int4")
    with pytest.raises(ValueError, match=r"\[B, 1, C\]"):
        rms_norm_modulate_quantize_triton(x, w, 1e-5, scale[:, :, :100], "int8")
    torch.library.opcheck(
        torch.ops.omnirt.rms_norm_modulate_quantize.default, (x, w, 1e-5, "exact", scale, "int8"),
        test_utils=("test_schema", "test_faketensor"),
    )  # fmt: skip


@interpreted
def test_rows_held_in_registers_give_the_same_bits(monkeypatch):
    """``settings.HOLD_ROWS``: a row read once and kept in registers for the passes after its sum
    gives the bits of the row read again for each pass, in every form of the kernel that holds
    (the residual add, the modulated norm with a residual, the quantizing norm); a row too wide
    for one warp's registers is read again either way."""
    from omnirt.kernels import rms_norm
    from omnirt.kernels.rms_norm import rms_norm_modulate_quantize_triton

    x, w, scale, gate, residual = _dit_inputs(2, 5, 3840)
    xs, ds, ws = _inputs(2048, 20)

    def run():
        sums = torch.empty(10)
        modulated = rms_norm_modulate_triton(x, w, 1e-5, gate, residual, sumsq=sums)
        return (modulated, sums, *rms_norm_modulate_quantize_triton(x, w, 1e-5, scale, "int8"),
                *add_rms_norm_triton(xs, ds, ws, 1e-6))  # fmt: skip

    assert rms_norm.holds(30, 128, True) is False  # off by default
    again = run()
    monkeypatch.setattr(settings, "HOLD_ROWS", True)
    assert rms_norm.holds(30, 128, True) and rms_norm.holds(16, 128, True)
    assert not rms_norm.holds(30, 128, False) and not rms_norm.holds(2, 4096, True)
    held = run()
    assert all(torch.equal(a, b) for a, b in zip(again, held, strict=True))


@interpreted
@pytest.mark.parametrize(
    ("shape", "hold"),  # Z-Image's launch (30 x 128) with its rows read again; rows held at 256
    [((2, 8, 3840), False), ((2, 20, 256), False), ((2, 20, 256), True)],
    ids=["(2, 8, 3840)-read-again", "(2, 20, 256)-read-again", "(2, 20, 256)-held"],
)
def test_the_pair_is_the_two_norms_one_after_the_other(shape, hold, monkeypatch):
    """``rms_norm_modulate_pair``: a block's residual update (``x + gate * norm(out)``) and the next
    sublayer's norm of the new stream (``scale * norm2``, or quantized) in one launch, the bits of
    the two kernels one after the other; the dispatcher off CUDA runs those two chains."""
    from omnirt.kernels.rms_norm import (
        rms_norm_modulate_pair,
        rms_norm_modulate_pair_reference,
        rms_norm_modulate_pair_triton,
        rms_norm_modulate_quantize_triton,
    )
    from omnirt.kernels.w8a8 import quantize_rows

    monkeypatch.setattr(settings, "HOLD_ROWS", hold)
    batch, tokens, width = shape
    out, w, scale, gate, residual = _dit_inputs(*shape)
    w2 = torch.randn(width, generator=torch.Generator().manual_seed(7))
    vectors = [(gate, scale), (gate[:1, 0, :], None)]  # per-sample; shared and none
    for mul, mul2 in vectors[: 1 if width > 256 else 2]:  # the interpreter is slow at 3840
        stream, normed, none = rms_norm_modulate_pair_triton(out, w, 1e-5, mul, residual, w2, 1e-6, mul2)
        want_stream = rms_norm_modulate_triton(out, w, 1e-5, mul, residual)
        assert none is None and torch.equal(stream, want_stream)
        assert torch.equal(normed, rms_norm_modulate_triton(want_stream, w2, 1e-6, mul2))
        stream, values, row_scale = rms_norm_modulate_pair_triton(
            out, w, 1e-5, mul, residual, w2, 1e-6, mul2, "int8"
        )
        want_values, want_scale = rms_norm_modulate_quantize_triton(want_stream, w2, 1e-6, mul2, "int8")
        assert torch.equal(stream, want_stream)
        assert torch.equal(values, want_values) and torch.equal(row_scale, want_scale)
    # off CUDA: the eager chains, one after the other
    got_stream, got = rms_norm_modulate_pair(out, w, 1e-5, gate, residual, w2, 1e-6, scale, "int8")
    want_stream, want = rms_norm_modulate_pair_reference(out, w, 1e-5, gate, residual, w2, 1e-6, scale)
    assert torch.equal(got_stream, want_stream) and got.kind == "int8"
    assert torch.equal(got.values, quantize_rows(want.reshape(-1, width), "int8")[0])
    with pytest.raises(ValueError, match=r"\[B, 1, C\]"):
        rms_norm_modulate_pair_triton(out, w, 1e-5, gate, residual, w2, 1e-6, scale[:, :, :100])
    with pytest.raises(ValueError, match="residual"):
        rms_norm_modulate_pair_triton(out, w, 1e-5, gate, residual[:, :1], w2, 1e-6, scale)
    for op, extra in ((torch.ops.omnirt.rms_norm_modulate_pair, ()),
                      (torch.ops.omnirt.rms_norm_modulate_pair_quantize, ("int8",))):  # fmt: skip
        torch.library.opcheck(
            op.default, (out, w, 1e-5, gate, residual, w2, 1e-6, scale, *extra),
            test_utils=("test_schema", "test_faketensor"),
        )  # fmt: skip
