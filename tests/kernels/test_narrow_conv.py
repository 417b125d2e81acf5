"""The few-output-channel 3D convolution (``kernels/narrow_conv.py``, the Wan VAE head's at the
``fast`` level) on the CPU under ``TRITON_INTERPRET=1`` (fp32): against the fp32 convolution,
channels-last and NCDHW frames, several channel blocks, rows wider than a program; what it
refuses. tests/gpu/test_wan_vae_gpu.py runs it in bf16 at the decoder's shape."""

from __future__ import annotations

import pytest
import torch
from omnirt.kernels import narrow_conv

from .conftest import interpreted


def _case(c: int, k: int, shape: tuple[int, int, int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, c, *shape, generator=g)
    weight = torch.randn(k, c, 3, 3, 3, generator=g) * 0.05
    bias = torch.randn(k, generator=g)
    return x, weight, bias


@interpreted
@pytest.mark.parametrize("channels_last", [True, False])
@pytest.mark.parametrize(("c", "k", "shape"), [(64, 3, (4, 5, 7)), (32, 16, (3, 3, 20)), (96, 1, (3, 4, 3))])
def test_matches_the_fp32_convolution(c, k, shape, channels_last):
    x, weight, bias = _case(c, k, shape)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last_3d)
    assert narrow_conv.applies(x, weight)
    got = narrow_conv.narrow_conv3d(x, weight, bias)
    want = narrow_conv.narrow_conv3d_reference(x, weight, bias)
    assert got.shape == want.shape == (1, k, shape[0] - 2, shape[1] - 2, shape[2] - 2) and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    packed = narrow_conv.packed_weight(weight)
    assert packed.shape == (27, c, narrow_conv.OUT_PAD) and not packed[:, :, k:].any()
    again = narrow_conv.narrow_conv3d(x, weight, None, packed=packed)
    want = narrow_conv.narrow_conv3d_reference(x, weight, None)
    torch.testing.assert_close(again, want, rtol=1e-5, atol=1e-5)


def test_what_it_refuses():
    x, weight, _ = _case(64, 3, (3, 3, 3))
    assert not narrow_conv.applies(x, weight[:, :32])  # channels that do not match
    assert not narrow_conv.applies(x[:, :48], weight[:, :48])  # not a multiple of the channel block
    wide = torch.randn(17, 64, 3, 3, 3)
    assert not narrow_conv.applies(x, wide)  # too many outputs
    assert not narrow_conv.applies(x.double(), weight.double())
    assert not narrow_conv.applies(x[:, :, :2], weight)  # fewer frames than taps
    with pytest.raises(ValueError, match="at most 16 outputs"):
        narrow_conv.narrow_conv3d(x, wide)
