"""kernels/adaln.py on the CPU: the Triton kernel under Triton's interpreter (fp32) against the
eager chain (Wan's norm1/norm3 with their modulation), every modulation shape, the dispatcher and
the custom op."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from omnirt.kernels.adaln import (
    MAX_WIDTH,
    adaln_modulate,
    adaln_modulate_reference,
    adaln_modulate_triton,
    even_combine_coefficient,
    kernel_applies,
)

from .conftest import interpreted


def _x(batch=2, seq=3, width=1536, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seq, width, generator=g) * 3 + 1, g


def _modulations(batch, seq, width, g):
    table = torch.randn(batch, 6, width, generator=g)
    per_token = torch.randn(batch, seq, 6, width, generator=g)
    return {
        "per-sample views at a 6C stride": (table[:, 1:2], table[:, 0:1]),
        "per-token views": (per_token[:, :, 1], per_token[:, :, 0]),
        "shared (C,) and (1, 1, C)": (torch.randn(width, generator=g), torch.randn(1, 1, width, generator=g)),
        "shared (1, C)": (torch.randn(1, width, generator=g), None),
        "shift only": (None, torch.randn(batch, 1, width, generator=g)),
        "none": (None, None),
    }


@interpreted
@pytest.mark.parametrize("preset", ["exact", "fast"])
@pytest.mark.parametrize("width", [64, 1536, 3584])
def test_kernel_matches_the_eager_chain(width, preset):
    x, g = _x(width=width)
    for name, (scale, shift) in _modulations(2, 3, width, g).items():
        got = adaln_modulate_triton(x, scale, shift, eps=1e-6, preset=preset)
        torch.testing.assert_close(
            got, adaln_modulate_reference(x, scale, shift, eps=1e-6), rtol=1e-5, atol=1e-5, msg=name
        )


@interpreted
def test_layer_norm_affine_offset_and_strided_rows():
    x, g = _x(batch=3, seq=4, width=512)
    rows = x[:, ::2]  # every other row: strided
    weight, bias = torch.randn(512, generator=g), torch.randn(512, generator=g)
    scale = torch.randn(3, 1, 512, generator=g)
    for w, b in ((weight, bias), (weight, None), (None, bias)):
        got = adaln_modulate_triton(rows, scale, None, eps=1e-5, weight=w, bias=b, scale_offset=0.0)
        want = adaln_modulate_reference(rows, scale, None, eps=1e-5, weight=w, bias=b, scale_offset=0.0)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@interpreted
def test_variants_give_the_same_statistics():
    x, g = _x(width=1024)
    scale, shift = torch.randn(2, 1, 1024, generator=g), torch.randn(2, 1, 1024, generator=g)
    want = adaln_modulate_reference(x, scale, shift, eps=1e-6)
    for variant in ({"tree": "split"}, {"load": "tile"}, {"online_fma": False}, {"combine_mean_fma": "b"}):
        torch.testing.assert_close(
            adaln_modulate_triton(x, scale, shift, eps=1e-6, **variant), want, rtol=1e-5, atol=1e-5
        )
    # the two ways of reading a thread's vectors do the same arithmetic (rows of whole steps too)
    for width in (1024, 1000):
        x, g = _x(width=width, seed=5)
        args = (x, torch.randn(2, 1, width, generator=g), None)
        tile = adaln_modulate_triton(*args, eps=1e-6, load="tile")
        assert torch.equal(tile, adaln_modulate_triton(*args, eps=1e-6, load="items"))


@interpreted
@pytest.mark.parametrize("width", [512, 1536])
def test_whole_rows_take_constant_reciprocals_with_the_same_bits(width):
    """Rows of whole 512-element steps take each Welford update's ``1 / k`` as a compile-time
    constant instead of dividing in the chain: bitwise what the divisions give (per sample and per
    token)."""
    x, g = _x(batch=2, seq=5, width=width, seed=3)
    for scale, shift in list(_modulations(2, 5, width, g).values())[:2]:
        constants = adaln_modulate_triton(x, scale, shift, eps=1e-6)
        divided = adaln_modulate_triton(x, scale, shift, eps=1e-6, even=False)
        assert torch.equal(constants, divided)


@interpreted
@pytest.mark.parametrize("width", [512, 1536, 5120])
def test_output_from_held_tiles_has_the_reloaded_rows_bits(width):
    """``output_from="held"`` writes a row of whole steps from the tiles its statistics loaded (one
    read of the row): bitwise the chunked second read, with and without a LayerNorm weight and bias;
    every modulation shape at Wan 1.3B's width, the per-sample and per-token ones at the others."""
    x, g = _x(batch=2, seq=3, width=width, seed=7)
    weight, bias = torch.randn(width, generator=g), torch.randn(width, generator=g)
    modulations = list(_modulations(2, 3, width, g).items())
    for name, (scale, shift) in modulations if width == 1536 else modulations[:2]:  # the interpreter is slow
        for w, b in ((None, None), (weight, bias)):
            kw = dict(eps=1e-6, weight=w, bias=b)
            held = adaln_modulate_triton(x, scale, shift, output_from="held", **kw)
            assert torch.equal(held, adaln_modulate_triton(x, scale, shift, output_from="reload", **kw)), name


@interpreted
def test_held_tiles_give_the_same_bits_with_several_rows_a_program():
    """3 x 3 rows, one, two or four a program (the last program's rows past the end masked):
    bitwise the same; other counts are refused. A row of another width takes the second read, and
    ``output_from`` is checked."""
    x, g = _x(batch=3, seq=3, width=1536, seed=9)
    for name, (scale, shift) in list(_modulations(3, 3, x.shape[-1], g).items())[:3]:
        one = adaln_modulate_triton(x, scale, shift, eps=1e-6, output_from="held", rows=1)
        for rows in (2, 4):
            got = adaln_modulate_triton(x, scale, shift, eps=1e-6, output_from="held", rows=rows)
            assert torch.equal(got, one), (name, rows)
    with pytest.raises(ValueError, match="rows must be"):
        adaln_modulate_triton(x, None, None, eps=1e-6, output_from="held", rows=3)
    x, g = _x(width=1000, seed=8)
    scale = torch.randn(2, 1, 1000, generator=g)
    torch.testing.assert_close(
        adaln_modulate_triton(x, scale, None, eps=1e-6, output_from="held"),
        adaln_modulate_reference(x, scale, None, eps=1e-6), rtol=1e-5, atol=1e-5,
    )  # fmt: skip
    with pytest.raises(ValueError, match="output_from must be one of"):
        adaln_modulate_triton(x, scale, None, eps=1e-6, output_from="twice")


def test_each_reciprocal_constant_is_the_fp32_division():
    """The kernel writes ``1.0 / k`` in Python (a double), which the compiler rounds to fp32: the
    same bits as the fp32 division ATen's chain makes, for every update count a row can have."""
    for k in range(1, MAX_WIDTH // 128 + 1):
        assert np.float32(1.0 / k) == np.float32(1.0) / np.float32(k), k


@pytest.mark.parametrize("width", range(512, 16385, 512))
def test_the_known_combine_coefficient_is_what_each_level_divides_to(width):
    """ATen's combine of two equal counts at every level of the 128-thread tree: ``count * (1 /
    total)`` with both steps rounded in fp32 is the one constant, whatever the level."""
    count = np.float32(width // 128)
    for _ in range(7):  # 5 levels within a warp, 2 across the 4 warps
        total = count + count
        assert count * (np.float32(1.0) / total) == np.float32(even_combine_coefficient(width))
        count = total


@interpreted
@pytest.mark.parametrize("mean_fma", ["none", "a", "b"])
def test_the_known_combine_gives_the_divisions_bits(mean_fma, monkeypatch):
    """``combine="known"`` over the explicit tree (the interpreter folds Triton's reduction in
    order, where the counts differ): bitwise the tree that divides, on rows of whole steps."""
    for width in (512, 1536):
        x, g = _x(width=width, seed=11)
        args = (x, torch.randn(2, 1, width, generator=g), torch.randn(2, 1, width, generator=g))
        kw = dict(eps=1e-6, tree="split", combine_mean_fma=mean_fma)
        known = adaln_modulate_triton(*args, combine="known", **kw)
        assert torch.equal(known, adaln_modulate_triton(*args, combine="divide", **kw))
        torch.testing.assert_close(known, adaln_modulate_reference(*args, eps=1e-6), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="combine must be one of"):
        adaln_modulate_triton(*args, eps=1e-6, combine="guess")
    # the GPU's form (Triton's reduction with the constant) launched once, for the sm_90 compile
    # of tests/kernels/test_zz_sm90.py; the interpreter's in-order fold makes its values moot here
    module = importlib.import_module(adaln_modulate_triton.__module__)
    monkeypatch.setattr(module, "interpreted", lambda: False)
    assert adaln_modulate_triton(*args, eps=1e-6, combine="known").shape == x.shape


@interpreted
def test_unsupported_inputs_are_refused_by_the_kernel():
    x, g = _x(width=64)
    with pytest.raises(ValueError, match="B, S, C"):
        adaln_modulate_triton(x[0], None, None, eps=1e-6)
    with pytest.raises(ValueError, match="broadcast"):
        adaln_modulate_triton(x, torch.randn(3, 1, 64), None, eps=1e-6)
    with pytest.raises(ValueError, match="multiples of 4"):
        adaln_modulate_triton(torch.randn(1, 2, 66)[..., :62], None, None, eps=1e-6)
    with pytest.raises(ValueError, match="weight and bias"):
        adaln_modulate_triton(x, None, None, eps=1e-6, weight=torch.randn(32))


def test_dispatcher_runs_the_eager_chain_off_cuda():
    x, g = _x(width=256)
    scale = torch.randn(2, 1, 256, generator=g)
    assert not kernel_applies(x, scale, None)
    assert torch.equal(
        adaln_modulate(x, scale, None, eps=1e-6), adaln_modulate_reference(x, scale, None, eps=1e-6)
    )


@interpreted
def test_custom_op_schema_fake_and_kernel():
    x, g = _x(batch=1, seq=2, width=128)
    scale, shift = torch.randn(1, 1, 128, generator=g), torch.randn(128, generator=g)
    args = (x, scale, shift, None, None, 1e-6, 1.0, "exact")
    torch.library.opcheck(
        torch.ops.omnirt.adaln_modulate.default, args, test_utils=("test_schema", "test_faketensor")
    )
    torch.testing.assert_close(
        torch.ops.omnirt.adaln_modulate(*args),
        adaln_modulate_reference(x, scale, shift, eps=1e-6),
        rtol=1e-5,
        atol=1e-5,
    )
