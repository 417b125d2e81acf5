"""The Wan VAE decoder's fast path (``stages/diffusion/wan_vae_fast.py``) on the CPU under
``TRITON_INTERPRET=1``: its kernels against the eager chains they replace (copies bitwise; the
norm + SiLU within an ulp, NumPy's exponential standing in for CUDA's), whole decodes of a tiny
``AutoencoderKLWan`` at each level against diffusers', the feature cache protocol kept, and
install / uninstall. tests/gpu/test_wan_vae_gpu.py holds the bitwise claims on CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan
from omnirt.kernels.conv_input import (
    add_bias_residual_,
    causal_conv_input,
    causal_conv_input_reference,
    channel_norms,
    channel_norms_cl,
    stacked_reference,
    upsample_frames,
    upsample_frames_reference,
)
from omnirt.kernels.reduce_order import aten_channel_splits, channel_sumsq_reference
from omnirt.stages.diffusion import wan_vae_fast

from ..kernels.conftest import interpreted

pytestmark = interpreted


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("cached", [0, 1, 2])
@pytest.mark.parametrize("frames", [1, 3])
def test_causal_conv_input_matches_eager(frames, cached, channels_last):
    g = torch.Generator().manual_seed(frames * 10 + cached)
    x = torch.randn(2, 6, frames, 5, 7, generator=g)
    cache = torch.randn(2, 6, cached, 5, 7, generator=g) if cached else None
    gamma = torch.rand(6, 1, 1, 1, generator=g) + 0.5
    for spatial_pad in (0, 1):
        got, got_cache = causal_conv_input(
            x, cache, time_pad=2, spatial_pad=spatial_pad, channels_last=channels_last
        )
        want, want_cache = causal_conv_input_reference(x, cache, time_pad=2, spatial_pad=spatial_pad)
        assert torch.equal(got, want) and torch.equal(got_cache, want_cache)
        assert got.is_contiguous(
            memory_format=torch.channels_last_3d if channels_last else torch.contiguous_format
        )
    norm = (gamma, 6**0.5)
    got, got_cache = causal_conv_input(
        x, cache, time_pad=2, spatial_pad=1, norm=norm, channels_last=channels_last
    )
    want, want_cache = causal_conv_input_reference(x, cache, time_pad=2, spatial_pad=1, norm=norm)
    torch.testing.assert_close(got, want, rtol=3e-7, atol=3e-7)
    torch.testing.assert_close(got_cache, want_cache, rtol=3e-7, atol=3e-7)
    assert torch.equal(got == 0, want == 0)  # the padding, and nothing else, is zero


@pytest.mark.parametrize("cached", [0, 1, 2])
def test_flat_channels_last_kernel_matches_the_tiled_one(cached, monkeypatch):
    """Dense channels-last frames and cache go through the flat kernel: the same bits as the tiled
    kernel, and eager's copies bitwise."""
    from omnirt.kernels import conv_input

    g = torch.Generator().manual_seed(20 + cached)
    cl = torch.channels_last_3d
    x = torch.randn(2, 6, 3, 5, 7, generator=g).contiguous(memory_format=cl)
    cache = torch.randn(2, 6, cached, 5, 7, generator=g).contiguous(memory_format=cl) if cached else None
    gamma = torch.rand(6, 1, 1, 1, generator=g) + 0.5
    for norm in (None, (gamma, 6**0.5)):
        kw = {"time_pad": 2, "spatial_pad": 1, "norm": norm, "channels_last": True}
        flat, flat_cache = causal_conv_input(x, cache, **kw)
        monkeypatch.setattr(conv_input, "FLAT_CHANNELS_LAST", False)
        tiled, tiled_cache = causal_conv_input(x, cache, **kw)
        monkeypatch.setattr(conv_input, "FLAT_CHANNELS_LAST", True)
        assert torch.equal(flat, tiled) and torch.equal(flat_cache, tiled_cache)
        assert flat.is_contiguous(memory_format=cl) and flat_cache.is_contiguous(memory_format=cl)
        if norm is None:
            want, want_cache = causal_conv_input_reference(x, cache, time_pad=2, spatial_pad=1)
            assert torch.equal(flat, want) and torch.equal(flat_cache, want_cache)


@pytest.mark.parametrize("cached", [0, 1, 2])
@pytest.mark.parametrize("frames", [1, 4])
def test_the_stacked_input_is_the_padded_one_side_by_side(frames, cached):
    """``stack=3``: the padded input written as the 2D frames a 3-tap convolution reads (output
    frame ``f`` = padded frames ``f .. f + 2`` along the channels), the same bits as the padded
    input stacked after, with the same next cache; refused for two videos or NCDHW frames."""
    g = torch.Generator().manual_seed(30 + 3 * frames + cached)
    cl = torch.channels_last_3d
    x = torch.randn(1, 6, frames, 5, 7, generator=g).contiguous(memory_format=cl)
    cache = torch.randn(1, 6, cached, 5, 7, generator=g).contiguous(memory_format=cl) if cached else None
    gamma = torch.rand(6, 1, 1, 1, generator=g) + 0.5
    for norm in (None, (gamma, 6**0.5)):
        kw = {"time_pad": 2, "spatial_pad": 1, "norm": norm, "channels_last": True}
        padded, want_cache = causal_conv_input(x, cache, **kw)
        stacked, got_cache = causal_conv_input(x, cache, stack=3, **kw)
        assert stacked.shape == (frames, 18, 7, 9)
        assert stacked.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(stacked, stacked_reference(padded, 3)) and torch.equal(got_cache, want_cache)
    with pytest.raises(ValueError, match="no stacked input"):
        causal_conv_input(torch.cat([x, x]), None, time_pad=2, spatial_pad=1, channels_last=True, stack=3)
    with pytest.raises(ValueError, match="no stacked input"):
        causal_conv_input(x.contiguous(), None, time_pad=2, spatial_pad=1, channels_last=True, stack=3)


def test_causal_conv_input_reads_strided_frames_and_refuses_a_misfit_cache():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 3, 6, 4, 5, generator=g).permute(0, 2, 1, 3, 4)  # [1, 6, 3, 4, 5], frames-first memory
    got, _ = causal_conv_input(x, None, time_pad=2, spatial_pad=1)
    assert torch.equal(got, causal_conv_input_reference(x, None, time_pad=2, spatial_pad=1)[0])
    with pytest.raises(ValueError, match="does not fit"):
        causal_conv_input(x, torch.zeros(1, 6, 1, 4, 4), time_pad=2, spatial_pad=1)
    with pytest.raises(ValueError, match="does not fit"):
        causal_conv_input(x, torch.zeros(1, 6, 3, 4, 5), time_pad=2, spatial_pad=1)


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("channels_last", [False, True])
def test_upsample_frames_is_eager_bitwise(interleave, channels_last):
    g = torch.Generator().manual_seed(7)
    for x in (
        torch.randn(2, 8, 3, 3, 5, generator=g),
        torch.randn(1, 3, 8, 2, 4, generator=g).permute(0, 2, 1, 3, 4),
    ):
        got = upsample_frames(x, interleave=interleave, channels_last=channels_last)
        assert torch.equal(got, upsample_frames_reference(x, interleave=interleave))
    with pytest.raises(ValueError, match="even channel count"):
        upsample_frames(torch.zeros(1, 3, 1, 2, 2), interleave=True)


def test_bias_and_residual_adds_are_eager_bitwise():
    g = torch.Generator().manual_seed(8)
    y = torch.randn(2, 5, 3, 4, 6, generator=g)
    bias = torch.randn(5, generator=g)
    shortcut = torch.randn(2, 3, 5, 4, 6, generator=g).permute(0, 2, 1, 3, 4)  # an upsampler's view
    want = (y + bias.view(1, 5, 1, 1, 1)) + shortcut
    got = add_bias_residual_(y.clone(), bias, shortcut)
    assert got.is_contiguous() and torch.equal(got, want)
    assert torch.equal(add_bias_residual_(y.clone(), bias), y + bias.view(1, 5, 1, 1, 1))
    assert torch.equal(add_bias_residual_(y.clone(), None, shortcut), y + shortcut)
    cl = torch.channels_last_3d  # dense channels-last frames: the flat kernel
    y_cl, shortcut_cl = y.contiguous(memory_format=cl), shortcut.contiguous(memory_format=cl)
    got = add_bias_residual_(y_cl.clone(), bias, shortcut_cl)
    assert got.is_contiguous(memory_format=cl) and torch.equal(got, want)
    assert torch.equal(add_bias_residual_(y_cl.clone(), bias), y + bias.view(1, 5, 1, 1, 1))
    before = y.clone()
    with pytest.raises(ValueError, match="cannot add"):
        add_bias_residual_(y, bias, shortcut.double())
    with pytest.raises(ValueError, match="does not fit"):
        add_bias_residual_(y, torch.zeros(4))
    assert torch.equal(y, before)  # refused before touching it


def test_aten_channel_splits_follow_setreduceconfig():
    # the Wan decoder's frames (480p and 720p levels, 1 to 4 frames): 4 threads a pixel
    for channels, inner in ((384, 60 * 104), (384, 2 * 120 * 208), (192, 4 * 240 * 416), (96, 4 * 480 * 832)):
        assert aten_channel_splits(channels, inner) == 4
    assert aten_channel_splits(96, 90 * 160) == 4
    assert aten_channel_splits(384, 42) == 16  # 2 pixels a thread, 16 lanes: 16 rows of threads
    assert aten_channel_splits(96, 35) == 1  # 1 pixel a thread, 32 lanes: 96 < 256 channels, no split
    assert aten_channel_splits(8, 1) is None  # one pixel: the channels are the innermost dim
    assert aten_channel_splits(4096, 64) is None  # ATen splits over blocks too


@pytest.mark.parametrize("splits", [1, 2, 4, 8, 16])
def test_channel_norms_follow_the_numpy_order(splits):
    """The channel norms of channels-last frames in ATen's NCDHW order (``reduce_order``) against
    its float64 / NumPy emulation, bit for bit: bf16 values (their squares are fp32 numbers, so
    the emulation's one rounding per fold is the FMA's); channel counts with and without a tail,
    a pixel count with one (128 a program), dense and strided frames."""
    g = torch.Generator().manual_seed(splits)
    for channels in (96, 20, 7):
        x = torch.randn(2, channels, 3, 5, 9, generator=g).to(torch.bfloat16).float() * 4
        padded = torch.zeros(2, 3, 5, 11, channels)  # channels innermost, rows padded: not dense
        padded[:, :, :, :9] = x.permute(0, 2, 3, 4, 1)
        strided = padded[:, :, :, :9].permute(0, 4, 1, 2, 3)
        for frames in (x.contiguous(memory_format=torch.channels_last_3d), strided):
            got = channel_norms_cl(frames, splits=splits)
            rows = x.permute(0, 2, 3, 4, 1).reshape(-1, channels).numpy()
            want = np.sqrt(channel_sumsq_reference(rows, splits)).reshape(2, 1, 3, 5, 9)
            assert got.shape == (2, 1, 3, 5, 9) and got.is_contiguous()
            assert np.array_equal(got.numpy(), want), (channels, int((got.numpy() != want).sum()))
    # the orders differ: a tail in the threads, a sum of 96 squares in other groupings
    y = torch.randn(1, 96, 2, 8, 8, generator=g).contiguous(memory_format=torch.channels_last_3d)
    assert not torch.equal(channel_norms_cl(y, splits=1), channel_norms_cl(y, splits=16))


def test_channel_norms_dispatch():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(1, 24, 2, 6, 10, generator=g)
    aten = torch.linalg.vector_norm(x, 2, dim=1, keepdim=True)
    assert torch.equal(channel_norms(x), aten)  # NCDHW frames: ATen's own
    cl = x.contiguous(memory_format=torch.channels_last_3d)
    want = channel_norms_cl(cl, splits=aten_channel_splits(24, 120))
    assert torch.equal(channel_norms(cl), want)
    torch.testing.assert_close(channel_norms(cl), aten, rtol=1e-6, atol=0)
    one = torch.randn(3, 5, 1, 1, 1, generator=g)  # one pixel a frame: ATen's own
    assert torch.equal(channel_norms(one), torch.linalg.vector_norm(one, 2, dim=1, keepdim=True))


def _tiny_vae(seed: int = 0) -> AutoencoderKLWan:
    torch.manual_seed(seed)
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1).eval()
    with torch.no_grad():
        for name, p in vae.named_parameters():  # gains away from 1, so the norms' scaling shows
            p.copy_(torch.randn_like(p) * (0.3 if "gamma" not in name else 0.5) + ("gamma" in name))
    return vae


def _latents(seed: int, frames: int = 2) -> torch.Tensor:
    """``frames`` latent frames of 1 x 2 for :func:`_tiny_vae` (8 x 16 pixels): the interpreter
    runs a program per padded row, so the decodes are kept small."""
    return torch.randn(1, 4, frames, 1, 2, generator=torch.Generator().manual_seed(seed))


def test_decodes_match_diffusers_at_each_level():
    vae = _tiny_vae()
    z = _latents(1)
    with torch.no_grad():
        want = vae.decode(z, return_dict=False)[0]
        # the decoder, its 10 residual blocks (2 in the middle, 2 per up block) and 3 upsamplers
        assert wan_vae_fast.install(vae, "exact") == 1 + 10 + 3
        assert wan_vae_fast.installed_level(vae) == "exact"
        exact = vae.decode(z, return_dict=False)[0]
        wan_vae_fast.install(vae, "fast")
        assert wan_vae_fast.installed_level(vae) == "fast"
        assert vae.decoder.conv_out.weight.is_contiguous()  # the inputs go channels-last, the weights stay
        fast = vae.decode(z, return_dict=False)[0]
        wan_vae_fast.uninstall(vae)
        assert wan_vae_fast.installed_level(vae) == "off" and vae.decoder.conv_out.weight.is_contiguous()
        again = vae.decode(z, return_dict=False)[0]
    assert want.shape == (1, 3, 5, 8, 16)
    assert torch.equal(again, want)  # uninstalled: diffusers' own decode
    torch.testing.assert_close(exact, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("form", "shapes", "per_frame"),
    # every 3x3x3 one: conv_in, the 10 residual blocks' two and the head's; or the 4 of 8 -> 8
    [("summed", None, 22), ("stacked", None, 22), ("summed", frozenset({(8, 8)}), 4)],
)
def test_the_fast_levels_2d_convolutions_match_diffusers(form, shapes, per_frame, monkeypatch):
    """``FAST_CONV``: the 3x3x3 causal convolutions of ``FAST_CONV_SHAPES`` as 2D ones over the
    time taps (another summation order: close, not bitwise), through a decode of two chunks;
    uninstalling drops the weights made for them."""
    vae = _tiny_vae()
    z = _latents(1)
    monkeypatch.setattr(wan_vae_fast, "FAST_CONV", form)
    monkeypatch.setattr(wan_vae_fast, "FAST_CONV_SHAPES", shapes)
    made, stacks = [], []
    real, real_stacked = wan_vae_fast._conv_2d_form, wan_vae_fast._stacked_conv
    monkeypatch.setattr(wan_vae_fast, "_conv_2d_form", lambda *a: made.append(a[2]) or real(*a))
    monkeypatch.setattr(wan_vae_fast, "_stacked_conv", lambda *a: stacks.append(a[0]) or real_stacked(*a))
    with torch.no_grad():
        want = vae.decode(z, return_dict=False)[0]
        wan_vae_fast.install(vae, "exact")
        exact = vae.decode(z, return_dict=False)[0]
        assert made == stacks == []  # exact keeps cuDNN's 3D convolutions
        wan_vae_fast.install(vae, "fast")
        got = vae.decode(z, return_dict=False)[0]
    if form == "summed":
        assert made == [form] * 2 * per_frame and stacks == []  # for each of the 2 latent frames
    else:  # stacked by the conv-input kernel where the frames are dense channels-last, else after
        assert len(stacks) == 2 * per_frame and set(made) == {form} and 0 < len(made) < len(stacks)
        from omnirt.kernels import conv_input

        monkeypatch.setattr(conv_input, "stacked_input_applies", lambda x, cache: False)
        before = len(made)
        with torch.no_grad():  # every input stacked after the kernel: the same bits
            assert torch.equal(vae.decode(z, return_dict=False)[0], got)
        assert len(made) - before == 2 * per_frame
    with torch.no_grad():
        taps = vae.decoder.up_blocks[0].resnets[0].conv1  # 16 -> 16
        assert hasattr(taps, "_omnirt_fast_weights") == (shapes is None)
        wan_vae_fast.uninstall(vae)
    assert not hasattr(taps, "_omnirt_fast_weights")
    torch.testing.assert_close(exact, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.equal(got, exact)  # another order: the forms do run
    monkeypatch.setattr(wan_vae_fast, "FAST_CONV", "2d")
    wan_vae_fast.install(vae, "exact")
    with pytest.raises(ValueError, match="3d, summed, stacked"):
        wan_vae_fast.install(vae, "fast")
    assert wan_vae_fast.installed_level(vae) == "exact"  # refused: what was installed stays


def test_the_fast_level_adds_bias_and_residual_in_the_convolutions_epilogue(monkeypatch):
    """``FUSED_EPILOGUE``: at ``fast``, each convolution's bias and residual go into its epilogue
    (``kernels/cudnn_conv.py``; here its fp32 reference stands in for cuDNN): the 3D and 2D
    convolutions with their bias and the second residual convolution with the block's shortcut,
    and the summed 2D form's taps each with the sum so far. Through a decode of two chunks, close
    to diffusers'; off, no call."""
    from omnirt.kernels import cudnn_conv

    vae = _tiny_vae()
    z = _latents(1)
    monkeypatch.setattr(wan_vae_fast, "FAST_CONV_SHAPES", frozenset({(8, 8)}))
    monkeypatch.setattr(wan_vae_fast, "FAST_CONV", "summed")
    calls = []

    def fused(x, weight, padding, *, bias=None, addends=()):
        calls.append((x.dim(), tuple(weight.shape[:2]), bias is not None, len(addends)))
        assert x.is_contiguous(memory_format=torch.channels_last_3d if x.dim() == 5 else torch.channels_last)
        return cudnn_conv.conv_epilogue_reference(x, weight, padding, bias=bias, addends=addends)

    monkeypatch.setattr(cudnn_conv, "try_conv_epilogue", fused)
    with torch.no_grad():
        want = vae.decode(z, return_dict=False)[0]
        monkeypatch.setattr(wan_vae_fast, "FUSED_EPILOGUE", "off")
        wan_vae_fast.install(vae, "fast")
        plain = vae.decode(z, return_dict=False)[0]
        assert calls == []
        monkeypatch.setattr(wan_vae_fast, "FUSED_EPILOGUE", "all")
        wan_vae_fast.install(vae, "fast")
        got = vae.decode(z, return_dict=False)[0]
        assert vae.decoder.conv_out.weight.is_contiguous()  # the module's weight untouched
        wan_vae_fast.uninstall(vae)
    assert not hasattr(vae.decoder.conv_out, "_omnirt_epilogue_weight")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got, plain, rtol=1e-4, atol=1e-4)
    # per latent frame: conv_in and the head (bias), each residual block's conv1 (bias) and conv2
    # (bias + shortcut), each upsampler's 2D convolution (bias), and from the second frame on the
    # 3D upsamplers' time convolutions (bias); the 8 -> 8 ones as 2D taps after the first, each
    # adding the sum so far, the last the bias (and conv2's the shortcut too)
    blocks = [m for m in vae.decoder.modules() if type(m).__name__ == "WanResidualBlock"]
    summed = [m for m in blocks if (m.conv1.in_channels, m.conv1.out_channels) == (8, 8)]
    times = [m for m in vae.decoder.modules() if getattr(m, "mode", None) == "upsample3d"]
    assert (len(blocks), len(summed), len(times)) == (10, 2, 2)
    head = calls.index((5, (3, 8), True, 0)) + 1  # the first frame's last call
    first, second = calls[:head], calls[head:]
    time_convs = [c for c in second if c[1] == (32, 16)]
    assert len(time_convs) == len(times) and [c for c in second if c not in time_convs] == first
    taps = [c for c in first if c[0] == 4 and c[1] == (8, 8)]
    tap = (4, (8, 8))
    conv1, conv2 = [(*tap, False, 1), (*tap, True, 1)], [(*tap, False, 1), (*tap, True, 2)]
    assert taps == (conv1 + conv2) * 2
    rest = [c for c in first if c not in taps]
    assert all(c[2] for c in rest)  # every convolution of this decoder has a bias
    assert len([c for c in rest if c[0] == 5 and c[3] == 1]) == len(blocks) - len(summed)  # conv2s
    assert len([c for c in rest if c[0] == 4]) == 3  # the upsamplers' 2D convolutions


@pytest.mark.parametrize("declined", ["last tap", "every 2D tap", "every 3D convolution"])
def test_convolutions_that_cudnn_declines_run_plain(monkeypatch, declined):
    """``FUSED_EPILOGUE`` where cuDNN declines some graphs (``try_conv_epilogue`` gives None): those
    convolutions run plain, their bias and residual added after (a summed form declined at its last
    tap keeps the fused partial sum and adds the last tap plainly), and the decode is the same as
    with every graph taken."""
    from omnirt.kernels import cudnn_conv

    vae = _tiny_vae()
    z = _latents(4)
    monkeypatch.setattr(wan_vae_fast, "FAST_CONV_SHAPES", frozenset({(8, 8)}))
    monkeypatch.setattr(wan_vae_fast, "FAST_CONV", "summed")
    outcomes = []

    def fused(x, weight, padding, *, bias=None, addends=()):
        tap = x.dim() == 4 and tuple(weight.shape[:2]) == (8, 8)
        no = {
            "last tap": tap and bias is not None,
            "every 2D tap": tap,
            "every 3D convolution": x.dim() == 5,
        }[declined]
        outcomes.append(not no)
        if no:
            return None
        return cudnn_conv.conv_epilogue_reference(x, weight, padding, bias=bias, addends=addends)

    monkeypatch.setattr(cudnn_conv, "try_conv_epilogue", fused)
    with torch.no_grad():
        want = vae.decode(z, return_dict=False)[0]
        monkeypatch.setattr(wan_vae_fast, "FUSED_EPILOGUE", "all")
        wan_vae_fast.install(vae, "fast")
        got = vae.decode(z, return_dict=False)[0]
        wan_vae_fast.uninstall(vae)
    assert True in outcomes and False in outcomes  # both paths ran
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("form", ["3d", "stacked"])
def test_fused_epilogues_at_the_fast_shapes_only(monkeypatch, form):
    """``FUSED_EPILOGUE = "shapes"``: only the causal 3x3x3 convolutions of ``FAST_CONV_SHAPES``
    (here 8 -> 8, the graph shape too; in the 3D form, or 2D over the taps stacked by the
    conv-input kernel) take the epilogue, each residual block's conv1 with its bias and conv2 with
    the bias and the shortcut; every other convolution adds them in the pass. ``exact`` never
    asks; an unknown value is refused and leaves what was installed."""
    from omnirt.kernels import cudnn_conv

    vae = _tiny_vae()
    z = _latents(6)
    monkeypatch.setattr(wan_vae_fast, "FAST_CONV", form)
    monkeypatch.setattr(wan_vae_fast, "FAST_CONV_SHAPES", frozenset({(8, 8)}))
    monkeypatch.setattr(wan_vae_fast, "GRAPH_CONV_SHAPES", frozenset({(8, 8)}))
    monkeypatch.setattr(wan_vae_fast, "FUSED_EPILOGUE", "shapes")
    monkeypatch.setattr(cudnn_conv, "conv_graph", lambda x, weight, padding: None)  # ATen's conv
    calls = []

    def fused(x, weight, padding, *, bias=None, addends=()):
        calls.append((x.dim(), tuple(weight.shape), bias is not None, len(addends)))
        return cudnn_conv.conv_epilogue_reference(x, weight, padding, bias=bias, addends=addends)

    monkeypatch.setattr(cudnn_conv, "try_conv_epilogue", fused)
    with torch.no_grad():
        want = vae.decode(z, return_dict=False)[0]
        wan_vae_fast.install(vae, "exact")
        exact = vae.decode(z, return_dict=False)[0]
        assert calls == []
        wan_vae_fast.install(vae, "fast")
        got = vae.decode(z, return_dict=False)[0]
        monkeypatch.setattr(wan_vae_fast, "FUSED_EPILOGUE", "some")
        with pytest.raises(ValueError, match="off, shapes, all"):
            wan_vae_fast.install(vae, "fast")
        assert wan_vae_fast.installed_level(vae) == "fast"
        wan_vae_fast.uninstall(vae)
    torch.testing.assert_close(exact, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    blocks = [m for m in vae.decoder.modules() if type(m).__name__ == "WanResidualBlock"]
    top = [m for m in blocks if (m.conv1.in_channels, m.conv1.out_channels) == (8, 8)]
    conv = (5, (8, 8, 3, 3, 3)) if form == "3d" else (4, (8, 24, 3, 3))
    per_frame = [(*conv, True, 0), (*conv, True, 1)] * len(top)  # conv1: bias; conv2: bias + shortcut
    assert len(top) == 2 and calls == per_frame * z.shape[2]


@pytest.mark.parametrize("level", ["exact", "fast"])
def test_graph_shapes_run_cudnn_graphs_then_add_bias_and_residual(monkeypatch, level):
    """``GRAPH_CONV_SHAPES`` (both levels; at ``fast`` also ``FAST_CONV = "graph"``): those causal
    3x3x3 convolutions ask ``cudnn_conv.conv_graph`` for the convolution alone (here ATen's own
    convolution stands in: the graph gives ATen's bits or is not used), their bias and residual
    added after; where it says None, ATen's convolution runs. The same decode either way; other
    convolutions never ask."""
    import torch.nn.functional as F
    from omnirt.kernels import cudnn_conv

    vae = _tiny_vae()
    z = _latents(5)
    monkeypatch.setattr(wan_vae_fast, "GRAPH_CONV_SHAPES", frozenset({(8, 8)}))
    if level == "fast":
        monkeypatch.setattr(wan_vae_fast, "FAST_CONV_SHAPES", frozenset({(16, 16)}))
        monkeypatch.setattr(wan_vae_fast, "FAST_CONV", "graph")
    calls, declined = [], []

    def graph(x, weight, padding):
        calls.append((x.dim(), tuple(weight.shape)))
        assert x.is_contiguous(memory_format=torch.channels_last_3d)
        return None if declined else F.conv3d(x, weight, padding=padding)

    monkeypatch.setattr(cudnn_conv, "conv_graph", graph)
    with torch.no_grad():
        want = vae.decode(z, return_dict=False)[0]
        wan_vae_fast.install(vae, level)
        got = vae.decode(z, return_dict=False)[0]
        asked = len(calls)
        declined.append(True)
        plain = vae.decode(z, return_dict=False)[0]
        wan_vae_fast.uninstall(vae)
    shapes = {(5, (8, 8, 3, 3, 3))} | ({(5, (16, 16, 3, 3, 3))} if level == "fast" else set())
    assert asked > 0 and set(calls) == shapes
    assert len(calls) == 2 * asked  # the declined decode asked as often
    assert torch.equal(got, plain)  # the graph's output (here ATen's) and ATen's: the same decode
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_feature_cache_protocol_is_kept():
    """Chunk by chunk with caller-owned caches (as WanDenoiser's decode in pieces calls it): the
    cache entries have diffusers' shapes and the frames match."""
    vae = _tiny_vae(2)
    z = vae.post_quant_conv(_latents(3, frames=3))
    count = int(vae._cached_conv_counts["decoder"])

    def run() -> tuple[list, list]:
        cache: list = [None] * count
        frames = []
        for i in range(z.shape[2]):
            frames.append(vae.decoder(z[:, :, i : i + 1], feat_cache=cache, feat_idx=[0], first_chunk=i == 0))
        return cache, frames

    with torch.no_grad():
        want_cache, want = run()
        wan_vae_fast.install(vae, "exact")
        got_cache, got = run()
    for a, b in zip(got_cache, want_cache, strict=True):
        assert type(a) is type(b)
        if isinstance(a, torch.Tensor):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)  # ulps of the SiLU, carried through
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_other_calls_run_diffusers_forward():
    vae = _tiny_vae(4)
    wan_vae_fast.install(vae, "exact")
    x = torch.randn(1, 4, 1, 4, 6)
    with torch.no_grad():
        whole = vae.decoder(vae.post_quant_conv(x))  # no feature cache: diffusers' path
        wan_vae_fast.uninstall(vae)
        assert torch.equal(whole, vae.decoder(vae.post_quant_conv(x)))
    assert wan_vae_fast.install(vae, "off") == 0 and wan_vae_fast.installed_level(vae) == "off"
    assert wan_vae_fast.install(torch.nn.Linear(2, 2), "exact") == 0
    with pytest.raises(ValueError, match="exact, fast, off"):
        wan_vae_fast.install(vae, "fastest")


def test_the_wan_denoiser_decodes_in_pieces_through_the_hooks(tmp_path_factory, monkeypatch):
    """The path the server takes: ``WanDenoiser``'s decode in pieces (start, frames, finish) on
    the embedded demo's VAE with the hooks installed (on CUDA its constructor installs them)."""
    import copy

    from omnirt.stages.diffusion.denoiser import Shape
    from omnirt.stages.diffusion.wan_demo import ensure_wan_demo
    from omnirt.stages.diffusion.wan_loader import load_wan

    from .test_wan import gens

    den = load_wan(ensure_wan_demo(tmp_path_factory.mktemp("omnirt-cache")), device="cpu")
    latents = den.init_latents(Shape(width=16, height=16, frames=5), gens([1]))
    want = den.decode(latents)
    hooked = copy.copy(den)
    hooked.vae = copy.deepcopy(den.vae)
    assert wan_vae_fast.install(hooked.vae, "exact") > 0
    calls = []
    kernel = wan_vae_fast.conv_input.causal_conv_input
    monkeypatch.setattr(
        wan_vae_fast.conv_input, "causal_conv_input", lambda *a, **k: calls.append(1) or kernel(*a, **k)
    )
    state = hooked.start_decode(latents)
    assert state.fast and hooked.decode_parts_total(Shape(width=16, height=16, frames=5)) == 8
    for _ in range(8):  # 2 latent frames, each in its 4 stages
        state = hooked.decode_parts(state, 1)
    got = hooked.finish_decode(state)
    assert got.shape == want.shape == (1, 5, 16, 16, 3) and calls  # the kernels ran
    assert (got.int() - want.int()).abs().max() <= 1  # pixels; on the CPU the SiLU is within an ulp
    assert torch.equal(got, hooked.decode(latents))  # the stages are the hooked call's, bitwise
