"""stages/diffusion/fused.py: the fused processors and the block forwards compute exactly what
diffusers' own modules compute (on the CPU the kernels' eager chains run, so any difference would
be the wiring's), install and uninstall, and the ``off`` setting."""

from __future__ import annotations

import pytest
import torch
from omnirt.kernels import settings
from omnirt.stages.diffusion.fused import WanFusedProcessor, ZImageFusedProcessor, install, uninstall
from omnirt.stages.diffusion.wan_loader import _cast_keeping_fp32


@pytest.fixture
def fused_on():
    before = settings.FUSED
    settings.set_fused("on")
    yield
    settings.set_fused(before)


def _zimage(dtype):
    from diffusers import ZImageTransformer2DModel

    torch.manual_seed(0)
    model = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=256, n_layers=2, n_refiner_layers=1,
        n_heads=2, n_kv_heads=2, norm_eps=1e-5, qk_norm=True, cap_feat_dim=32, axes_dims=[32, 48, 48],
        axes_lens=[64, 32, 32],
    )  # fmt: skip
    return model.to(dtype).eval()


def _wan(dtype):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=64, ffn_dim=256, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=256,
    ).eval()  # fmt: skip
    _cast_keeping_fp32(model, dtype)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_installed_models_compute_what_diffusers_computes(dtype, fused_on):
    g = torch.Generator().manual_seed(1)
    zimage, wan = _zimage(dtype), _wan(dtype)
    latents = [torch.randn(16, 1, 16, 16, dtype=dtype, generator=g) for _ in range(2)]
    caption = [torch.randn(n, 32, dtype=dtype, generator=g) for n in (5, 11)]
    t = torch.tensor([0.3, 0.7], dtype=dtype)
    video = torch.randn(2, 16, 3, 8, 12, dtype=dtype, generator=g)
    text = torch.randn(2, 16, 32, dtype=dtype, generator=g)
    steps = torch.tensor([300.0, 700.0])
    with torch.no_grad():
        for model, call, sites, kind in (
            (
                zimage,
                lambda: torch.stack(zimage(latents, t, caption, return_dict=False)[0]),
                12,  # 4 attention processors, 4 block forwards, 4 feed-forwards (2 layers, 2 refiners)
                ZImageFusedProcessor,
            ),
            (wan, lambda: wan(video, steps, text, return_dict=False)[0], 4, WanFusedProcessor),
        ):
            want = call()
            assert install(model) == sites
            assert install(model) == 0  # nothing is wrapped twice
            assert any(isinstance(getattr(m, "processor", None), kind) for m in model.modules())
            assert torch.equal(call(), want)
            uninstall(model)
            assert not any(isinstance(getattr(m, "processor", None), kind) for m in model.modules())
            assert torch.equal(call(), want)


def test_off_installs_nothing():
    before = settings.FUSED
    settings.set_fused("off")
    try:
        model = _wan(torch.float32)
        assert install(model) == 0
        assert not any(isinstance(getattr(m, "processor", None), WanFusedProcessor) for m in model.modules())
    finally:
        settings.set_fused(before)


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_fp8_attention_asks_for_fp8_blocks_and_falls_back_off_cuda(kind, fused_on):
    """``--fp8-attention on`` picks the attentions of fp8 W8A8 blocks; where cuDNN's fp8 attention
    does not apply (here: the CPU) those blocks compute what they compute with it off."""
    from omnirt.stages.diffusion import fused
    from omnirt.stages.diffusion.quant import quantize_model

    g = torch.Generator().manual_seed(2)
    zimage = _zimage(torch.bfloat16)
    quantize_model(zimage, kind)
    install(zimage)
    latents = [torch.randn(16, 1, 16, 16, dtype=torch.bfloat16, generator=g) for _ in range(2)]
    caption = [torch.randn(n, 32, dtype=torch.bfloat16, generator=g) for n in (5, 11)]  # padded: a mask
    t = torch.tensor([0.3, 0.7], dtype=torch.bfloat16)
    attention = zimage.layers[0].attention
    before = settings.FP8_ATTENTION
    try:
        with torch.no_grad():
            want = torch.stack(zimage(latents, t, caption, return_dict=False)[0])
            assert not fused._fp8_block(attention)
            settings.set_fp8_attention("on")
            assert fused._fp8_block(attention) == (kind == "fp8")
            assert torch.equal(torch.stack(zimage(latents, t, caption, return_dict=False)[0]), want)
    finally:
        settings.set_fp8_attention(before)
