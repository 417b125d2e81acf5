"""The Wan VAE decoder's fast path on CUDA (marker ``gpu``): the conv-input kernels bitwise equal
to the eager chains in bf16 and fp32 (contiguous, frames-first and channels-last frames, against
eager on the same frames in NCDHW memory; stacked for the 2D form; a convolution's bias and a
residual added as ATen adds them), the channel norms of channels-last frames bitwise ATen's of
NCDHW frames at the decoder's shapes, and whole decodes of the published Wan 2.1 VAE config
(random weights): ``exact`` bitwise equal to diffusers', ``fast`` within its stated PSNR
(docs/kernels.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omnirt.kernels.conv_input import (
    add_bias_residual_,
    causal_conv_input,
    causal_conv_input_reference,
    channel_norms,
    stacked_reference,
    upsample_frames,
    upsample_frames_reference,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROOT = Path(__file__).resolve().parents[2]
#: The ``fast`` level's floor against diffusers (pixels in [-1, 1], peak-to-peak 2).
FAST_PSNR_DB = 40.0


def _frames(g: torch.Generator, shape: tuple, dtype: torch.dtype, layout: str) -> torch.Tensor:
    b, c, t, h, w = shape
    if layout == "frames_first":  # an upsampler's output: [b, t, c, h, w] memory viewed as [b, c, t, h, w]
        return torch.randn(b, t, c, h, w, device="cuda", generator=g).to(dtype).permute(0, 2, 1, 3, 4)
    x = torch.randn(shape, device="cuda", generator=g).to(dtype)
    return x.contiguous(memory_format=torch.channels_last_3d) if layout == "channels_last" else x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["contiguous", "frames_first", "channels_last"])
def test_conv_inputs_are_bitwise_eager(dtype, layout):
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in ((1, 96, 4, 60, 104), (2, 384, 1, 30, 52)):
        x = _frames(g, shape, dtype, layout)
        gamma = (torch.rand(shape[1], 1, 1, 1, device="cuda", generator=g) + 0.5).to(dtype)
        for cached in (0, 1, 2):
            cache = _frames(g, (*shape[:2], cached, *shape[3:]), dtype, "contiguous") if cached else None
            for norm in (None, (gamma, shape[1] ** 0.5)):
                got, got_cache = causal_conv_input(x, cache, time_pad=2, spatial_pad=1, norm=norm)
                # the claim: what eager makes of the same frames in NCDHW memory (diffusers' layout)
                ncdhw = x.contiguous() if layout == "channels_last" else x
                want, want_cache = causal_conv_input_reference(
                    ncdhw, cache, time_pad=2, spatial_pad=1, norm=norm
                )
                assert torch.equal(got, want), (shape, cached, norm is not None)
                assert torch.equal(got_cache, want_cache)
                if layout == "channels_last" and shape[0] == 1:  # the stacked 2D form's input
                    cl = None if cache is None else cache.contiguous(memory_format=torch.channels_last_3d)
                    kw = {"time_pad": 2, "spatial_pad": 1, "norm": norm, "channels_last": True}
                    stacked, stacked_cache = causal_conv_input(x, cl, stack=3, **kw)
                    assert torch.equal(stacked, stacked_reference(want, 3)), (shape, cached)
                    assert torch.equal(stacked_cache, want_cache)
        if layout == "frames_first":  # a convolution's output, its bias as ATen adds it, then a shortcut
            conv = torch.nn.Conv3d(shape[1], shape[1], 3, device="cuda", dtype=dtype)
            padded = torch.nn.functional.pad(x, (1, 1, 1, 1, 2, 0))
            want = conv(padded) + x
            got = add_bias_residual_(conv._conv_forward(padded, conv.weight, None), conv.bias, x)
            assert torch.equal(got, want)
        for interleave in (False, True):
            assert torch.equal(
                upsample_frames(x, interleave=interleave), upsample_frames_reference(x, interleave=interleave)
            )


#: Frames whose channel norms the decoder takes at 480p and 720p (channels, frames, rows, columns),
#: and shapes with tails (a pixel count that is odd, or 2 mod 4; a frame of fewer than 128 pixels).
NORM_SHAPES = (
    (384, 1, 60, 104), (384, 2, 120, 208), (192, 4, 240, 416), (96, 4, 480, 832), (96, 1, 480, 832),
    (384, 1, 90, 160), (384, 2, 180, 320), (192, 4, 360, 640), (96, 4, 720, 1280),
    (384, 1, 5, 7), (192, 3, 7, 7), (96, 1, 6, 7), (384, 2, 3, 7), (96, 2, 4, 4), (384, 1, 2, 3),
)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_channel_norms_of_channels_last_frames_are_diffusers_bitwise(dtype):
    """``channel_norms`` of channels-last frames (the ``exact`` level's) against the norms
    ``F.normalize(x.float(), dim=1)`` takes of the same frames in NCDHW memory (contiguous, and an
    upsampler's frames-first view), every element."""
    g = torch.Generator(device="cuda").manual_seed(4)
    for c, t, h, w in NORM_SHAPES:
        for b in (1, 2) if h * w < 10_000 else (1,):
            x = (torch.randn(b, c, t, h, w, device="cuda", generator=g) * 3).to(dtype)
            got = channel_norms(x.contiguous(memory_format=torch.channels_last_3d))
            want = x.float().norm(2, 1, keepdim=True)
            assert torch.equal(got, want), ((b, c, t, h, w), int((got != want).sum()))
            if (h * w) % 4 == 0:  # an upsampler's output: [b, t, c, h, w] memory
                ff = x.permute(0, 2, 1, 3, 4).contiguous().permute(0, 2, 1, 3, 4)
                assert torch.equal(got, ff.float().norm(2, 1, keepdim=True)), (b, c, t, h, w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("latents", [(4, 30, 52), (2, 60, 104)])
def test_real_config_decodes(dtype, latents, monkeypatch):
    from diffusers import AutoencoderKLWan
    from omnirt.kernels import cudnn_conv
    from omnirt.stages.diffusion import wan_vae_fast

    fused = []  # per try: whether cuDNN's graph ran
    real = cudnn_conv.try_conv_epilogue

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        fused.append(out is not None)
        return out

    monkeypatch.setattr(cudnn_conv, "try_conv_epilogue", spy)

    cfg = json.loads((ROOT / "benchmarks/models/wan2.1-t2v/wan2.1-t2v.components.json").read_text())["vae"]
    with torch.device("cuda"):
        torch.manual_seed(0)
        vae = AutoencoderKLWan.from_config({k: v for k, v in cfg.items() if not k.startswith("_")})
        with torch.no_grad():  # gains away from 1, so the norms' scaling shows
            for name, p in vae.named_parameters():
                if "gamma" in name:
                    p.uniform_(0.5, 1.5)
    vae = vae.to(dtype).eval()
    z = torch.randn(1, 16, *latents, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    with torch.no_grad():
        want = vae.decode(z.to(dtype), return_dict=False)[0]
        assert wan_vae_fast.install(vae, "exact") > 0
        exact = vae.decode(z.to(dtype), return_dict=False)[0]
        assert not any(fused)  # exact: no fused epilogue
        fasts = {}
        for form, epilogue in (("3d", "off"), ("3d", "shapes"), ("3d", "all"), ("stacked", "off"),
                               ("stacked", "shapes")):  # fmt: skip
            fused.clear()
            monkeypatch.setattr(wan_vae_fast, "FAST_CONV", form)
            monkeypatch.setattr(wan_vae_fast, "FUSED_EPILOGUE", epilogue)
            wan_vae_fast.install(vae, "fast")
            fasts[form, epilogue] = vae.decode(z.to(dtype), return_dict=False)[0]
            # bf16: the convolutions add their bias and residual in cuDNN's epilogue
            assert any(fused) == (dtype == torch.bfloat16 and epilogue != "off")
        wan_vae_fast.uninstall(vae)
    assert want.shape == (1, 3, 4 * latents[0] - 3, 8 * latents[1], 8 * latents[2])
    assert torch.equal(exact, want)
    for fast in fasts.values():
        mse = (fast.float() - want.float()).pow(2).mean()
        assert float(10 * torch.log10(4 / mse)) > FAST_PSNR_DB


#: Decoder convolutions (480p shapes, fewer frames): (input frames, weight, padding, addends).
EPILOGUE_CASES = (
    ((1, 96, 6, 482, 834), (96, 96, 3, 3, 3), (0, 0, 0), 1),  # the top level's conv2
    ((1, 384, 3, 62, 106), (384, 384, 3, 3, 3), (0, 0, 0), 0),
    ((1, 96, 6, 482, 834), (3, 96, 3, 3, 3), (0, 0, 0), 0),  # the head
    ((4, 384, 240, 416), (192, 384, 3, 3), (1, 1), 0),  # an upsampler's 2D convolution
    ((4, 96, 482, 834), (96, 96, 3, 3), (0, 0), 2),  # a summed 2D tap: the sum so far and a shortcut
)


@pytest.mark.parametrize(("frames", "kernel", "padding", "addends"), EPILOGUE_CASES)
def test_convolutions_with_their_epilogue_match_the_reference(frames, kernel, padding, addends, monkeypatch):
    """``kernels/cudnn_conv.py``: cuDNN takes the decoder's shapes with channels-last addends (on
    the H100 it declined others: those are not offered), and the fused bias and adds (fp32,
    rounded once) are within bf16's rounding of the fp32 reference (only the products' summation
    order differs)."""
    from omnirt.kernels import cudnn_conv

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # the reference in true fp32
    g = torch.Generator(device="cuda").manual_seed(7)
    fmt = torch.channels_last_3d if len(frames) == 5 else torch.channels_last
    x = torch.randn(frames, device="cuda", generator=g).to(torch.bfloat16).contiguous(memory_format=fmt)
    weight = (torch.randn(kernel, device="cuda", generator=g) * 0.03).to(torch.bfloat16)
    weight = weight.contiguous(memory_format=fmt)
    bias = torch.randn(kernel[0], device="cuda", generator=g).to(torch.bfloat16)
    shape = cudnn_conv.out_shape(x, weight, padding)
    extra = [torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16) for _ in range(addends)]
    if extra:  # an addend of another layout (here NC(D)HW) is not offered to cuDNN, which declines it
        assert not cudnn_conv.applies(x, weight, padding, bias=bias, addends=tuple(extra))
    extra = [a.contiguous(memory_format=fmt) for a in extra]  # as the decoder's residuals and sums come
    assert cudnn_conv.applies(x, weight, padding, bias=bias, addends=tuple(extra))
    plan = cudnn_conv._plans[cudnn_conv._shape(x, weight, padding, bias, tuple(extra))]
    assert plan.index is not None  # the fastest of the first AUTOTUNE_PLANS, timed
    got = cudnn_conv.conv_epilogue(x, weight, padding, bias=bias, addends=tuple(extra))
    want = cudnn_conv.conv_epilogue_reference(x, weight, padding, bias=bias, addends=tuple(extra))
    assert got.shape == want.shape and got.is_contiguous(memory_format=fmt)
    err = (got.float() - want.float()).abs() / want.float().abs().clamp_min(1.0)
    assert float(err.max()) <= 2**-7


GRAPH_CASES = [((1, 96, 6, 482, 834), (96, 96, 3, 3, 3)), ((1, 192, 6, 242, 418), (192, 192, 3, 3, 3))]


@pytest.mark.parametrize(("frames", "kernel"), GRAPH_CASES)
def test_the_graph_convolution_gives_atens_bits_or_none(frames, kernel):
    """``cudnn_conv.conv_graph``: where it answers, ATen's bits (its plan was checked against them on
    the first call; here a second call on new inputs checks again); None where ATen's is as fast."""
    import torch.nn.functional as F
    from omnirt.kernels import cudnn_conv

    g = torch.Generator(device="cuda").manual_seed(3)
    fmt = torch.channels_last_3d
    for _ in range(2):
        x = torch.randn(frames, device="cuda", generator=g).to(torch.bfloat16).contiguous(memory_format=fmt)
        weight = (torch.randn(kernel, device="cuda", generator=g) * 0.03).to(torch.bfloat16)
        weight = weight.contiguous(memory_format=fmt)
        got = cudnn_conv.conv_graph(x, weight, (0, 0, 0))
        if got is not None:
            assert got.is_contiguous(memory_format=fmt)
            assert torch.equal(got, F.conv3d(x, weight))
