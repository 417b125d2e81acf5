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
        axes_lens=[128, 32, 32],  # positions past 64: a caption of 40 tokens pads to 64
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
    # 5 and 40 tokens pad to 32 and 64: rows of two lengths, so diffusers passes a mask
    caption = [torch.randn(n, 32, dtype=torch.bfloat16, generator=g) for n in (5, 40)]
    t = torch.tensor([0.3, 0.7], dtype=torch.bfloat16)
    attention = zimage.layers[0].attention
    before = settings.FP8_ATTENTION
    try:
        with torch.no_grad():
            settings.set_fp8_attention("off")
            want = torch.stack(zimage(latents, t, caption, return_dict=False)[0])
            assert not fused._fp8_block(attention)
            settings.set_fp8_attention("on")
            assert fused._fp8_block(attention) == (kind == "fp8")
            assert torch.equal(torch.stack(zimage(latents, t, caption, return_dict=False)[0]), want)
    finally:
        settings.set_fp8_attention(before)


def _snr_db(got: torch.Tensor, want: torch.Tensor) -> float:
    noise = (got.float() - want.float()).pow(2).mean()
    return float(10 * torch.log10(want.float().pow(2).mean() / noise))


@pytest.mark.parametrize("chain", ["zimage", "wan"])
def test_fp8_attention_hands_its_e4m3_output_to_the_fp8_to_out(chain, fused_on, monkeypatch):
    """The fp8 path's wiring, with cuDNN's attention replaced by its fp32 model (the CPU has no
    cuDNN): every fp8 block's queries and keys come from the QK chain in e4m3, and its output goes
    to the fp8 ``to_out`` as cuDNN writes it (:class:`QuantizedRows`, e4m3 at V's scale), or, with
    ``FP8_ATTENTION_E4M3_OUT`` off, in bf16; both close to the same model with bf16 attention."""
    from omnirt.kernels import fp8_attention
    from omnirt.kernels.w8a8 import QuantizedRows
    from omnirt.stages.diffusion import fused
    from omnirt.stages.diffusion.quant import quantize_model

    g = torch.Generator().manual_seed(4)
    if chain == "zimage":
        model = _zimage(torch.bfloat16)
        latents = [torch.randn(16, 1, 16, 16, dtype=torch.bfloat16, generator=g) for _ in range(2)]
        caption = [torch.randn(n, 32, dtype=torch.bfloat16, generator=g) for n in (5, 40)]  # a mask
        t = torch.tensor([0.3, 0.7], dtype=torch.bfloat16)
        call = lambda: torch.stack(model(latents, t, caption, return_dict=False)[0])  # noqa: E731
    else:
        model = _wan(torch.bfloat16)
        video = torch.randn(2, 16, 3, 8, 12, dtype=torch.bfloat16, generator=g)
        text = torch.randn(2, 16, 32, dtype=torch.bfloat16, generator=g)
        steps = torch.tensor([300.0, 700.0])
        call = lambda: model(video, steps, text, return_dict=False)[0]  # noqa: E731
    quantize_model(model, "fp8")
    install(model)
    fused_kinds = (ZImageFusedProcessor, WanFusedProcessor)
    attentions = [m for m in model.modules() if isinstance(getattr(m, "processor", None), fused_kinds)]
    ran: list[tuple[torch.dtype, torch.dtype, bool]] = []
    handed: list[type] = []
    masked: list[bool] = []

    def attention(q, k, v, lengths=None, scale=None, **kwargs):
        ran.append((q.dtype, k.dtype, kwargs["quantized_out"]))
        masked.append(lengths is not None)
        return fp8_attention.fp8_attention_reference(q, k, v, lengths, scale, **kwargs)

    monkeypatch.setattr(fp8_attention, "applies", lambda *args, **kwargs: True)
    monkeypatch.setattr(fp8_attention, "fp8_attention", attention)
    for attn in attentions:
        attn.to_out[0].register_forward_pre_hook(lambda module, args: handed.append(type(args[0])))
    before = settings.FP8_ATTENTION, fused.FP8_ATTENTION_E4M3_OUT
    try:
        with torch.no_grad():
            settings.set_fp8_attention("off")
            want = call()
            settings.set_fp8_attention("on")
            ran.clear(), handed.clear()
            got = call()
            assert ran == [(torch.float8_e4m3fn, torch.float8_e4m3fn, True)] * len(attentions)
            assert handed == [QuantizedRows] * len(attentions)
            fused.FP8_ATTENTION_E4M3_OUT = False
            ran.clear(), handed.clear()
            wide = call()
            assert [out for _, _, out in ran] == [False] * len(attentions)
            assert handed == [torch.Tensor] * len(attentions)
    finally:
        settings.set_fp8_attention(before[0])
        fused.FP8_ATTENTION_E4M3_OUT = before[1]
    assert any(masked) == (chain == "zimage")  # Z-Image's captions of two lengths: keys masked
    assert torch.isfinite(got).all() and not torch.equal(got, want)
    assert _snr_db(got, want) > 15 and _snr_db(wide, want) > 15
    print(f"{chain}: fp8 attention (e4m3 out) vs bf16 attention {_snr_db(got, want):.1f} dB, "
          f"bf16 out {_snr_db(wide, want):.1f} dB")  # fmt: skip
