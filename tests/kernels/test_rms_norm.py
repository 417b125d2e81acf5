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
from omnirt.kernels.rms_norm import add_rms_norm, add_rms_norm_reference, add_rms_norm_triton, kernel_applies
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeTextRMSNorm

from .conftest import interpreted

# (width, rows): the demo model's widths (read element by element) and the real model's (as
# 4-element vectors), at row counts that give each a different launch
SHAPES = [
    (32, 1), (64, 5), (64, 40), (128, 3), (1024, 1), (1024, 4), (2048, 3), (2048, 8), (1024, 16), (2048, 40)
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
    assert aten_mean_config(1536, 4) is None


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
        (x[:, :1000].contiguous(), None, w[:1000], "power of two"),
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
