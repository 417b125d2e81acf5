"""stages/diffusion/quant.py: W8A8 Z-Image and Wan transformers (the blocks' linear layers
quantized, the embeddings, projections in and out and modulation kept), their outputs close to
the full-precision model's, and the loaders' ``quantization`` option."""

from __future__ import annotations

import fnmatch

import pytest
import torch
from omnirt.stages.diffusion.quant import KEEP, W8A8Linear, quantize_model

from .test_fused_install import _wan, _zimage, fused_on  # noqa: F401 (a fixture used by name)


def _snr_db(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(10 * torch.log10(want.float().pow(2).mean() / (got.float() - want.float()).pow(2).mean()))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantized_transformers_stay_close(kind):
    g = torch.Generator().manual_seed(2)
    zimage, wan = _zimage(torch.float32), _wan(torch.float32)
    latents = [torch.randn(16, 1, 16, 16, generator=g) for _ in range(2)]
    caption = [torch.randn(n, 32, generator=g) for n in (5, 11)]
    t = torch.tensor([0.3, 0.7])
    video = torch.randn(2, 16, 3, 8, 12, generator=g)
    text = torch.randn(2, 16, 32, generator=g)
    steps = torch.tensor([300.0, 700.0])
    with torch.no_grad():
        for model, call, blocks in (
            (zimage, lambda: torch.stack(zimage(latents, t, caption, return_dict=False)[0]), 4),
            (wan, lambda: wan(video, steps, text, return_dict=False)[0], 2),
        ):
            want = call()
            linear = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
            done = quantize_model(model, kind)
            swapped = {n for n, m in model.named_modules() if isinstance(m, W8A8Linear)}
            assert done.layers == len(swapped) and done.layers + done.kept == len(linear)
            assert len(swapped) >= 7 * blocks  # attention and feed-forward of every block
            patterns = KEEP[type(model).__name__]
            assert not any(fnmatch.fnmatchcase(n, p) for n in swapped for p in patterns)
            assert done.bytes_after < done.bytes_before
            assert _snr_db(call(), want) > (30 if kind == "int8" else 20)


def test_extra_keep_patterns_and_unknown_kinds():
    model = _wan(torch.float32)
    done = quantize_model(model, "int8", keep=["blocks.0.*"])
    assert isinstance(model.blocks[1].attn1.to_q, W8A8Linear)
    assert isinstance(model.blocks[0].attn1.to_q, torch.nn.Linear)
    assert done.kept > len(KEEP["WanTransformer3DModel"])
    with pytest.raises(ValueError, match="int8, fp8"):
        quantize_model(_wan(torch.float32), "int4")


def test_loaders_quantize_and_report_it():
    from omnirt.stages.diffusion.factory import build_embedded_diffusion_pipelines

    image, video = build_embedded_diffusion_pipelines(device="cpu", warm_up=False, quantization="int8")
    for pipeline in (image, video):
        assert pipeline.info.quantization == "int8"
        transformer = pipeline.denoiser.transformer
        assert any(isinstance(m, W8A8Linear) for m in transformer.modules())
    from omnirt.stages.diffusion.wan_demo import ensure_wan_demo
    from omnirt.stages.diffusion.wan_loader import WanLoadError, load_wan

    with pytest.raises(WanLoadError, match="quantization"):
        load_wan(ensure_wan_demo(), device="cpu", quantization="int4")


@pytest.mark.usefixtures("fused_on")
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_merged_layers_compute_what_the_separate_ones_compute(kind):
    """``fused.install`` on a W8A8 model merges the layers that read one input (q, k, v; Z-Image's
    w1 and w3; Wan's cross-attention k and v) and runs the quantized-input paths: on the CPU (the
    kernels' eager chains) the same output as the unmerged model (int8: integer sums, the same
    bits); the old names stay usable views; no weight is held twice."""
    from omnirt.stages.diffusion import fused
    from omnirt.stages.diffusion.quant import W8A8Slice, merge_layers

    g = torch.Generator().manual_seed(5)
    zimage, wan = _zimage(torch.bfloat16), _wan(torch.bfloat16)
    latents = [torch.randn(16, 1, 16, 16, generator=g).bfloat16() for _ in range(2)]
    caption = [torch.randn(n, 32, generator=g).bfloat16() for n in (5, 11)]
    t = torch.tensor([0.3, 0.7], dtype=torch.bfloat16)
    video = torch.randn(2, 16, 3, 8, 12, generator=g).bfloat16()
    text = torch.randn(2, 16, 32, generator=g).bfloat16()
    steps = torch.tensor([300.0, 700.0])
    with torch.no_grad():
        for model, call, merged in (
            (zimage, lambda: torch.stack(zimage(latents, t, caption, return_dict=False)[0]), 8),
            (wan, lambda: wan(video, steps, text, return_dict=False)[0], 4),
        ):
            quantize_model(model, kind)
            want = call()
            held = sum(b.numel() * b.element_size() for b in model.buffers())
            probe = torch.ones(3, _width(model)).bfloat16()
            q_before = model.get_submodule(_first_attention(model)).to_q(probe)
            fused.install(model)
            made = [m for m in model.modules() for n in ("to_qkv", "to_kv", "w13") if hasattr(m, n)]
            assert len(made) == merged
            if model is zimage:  # the norms write the quantized inputs of q, k, v and w1, w3
                assert fused._quantized_inputs(model.layers[0]) == kind
            assert sum(b.numel() * b.element_size() for b in model.buffers()) == held
            attention = model.get_submodule(_first_attention(model))
            assert isinstance(attention.to_q, W8A8Slice) and isinstance(attention.to_qkv, W8A8Linear)
            assert torch.equal(attention.to_q(probe), q_before)
            got = call()
            if kind == "int8":
                assert torch.equal(got, want)
            else:  # the CPU's fp8 product blocks its sums by the operands' shapes
                assert _snr_db(got, want) > 40
            fused.uninstall(model)
            assert torch.equal(call(), want) if kind == "int8" else _snr_db(call(), want) > 40
            assert merge_layers(attention, ("to_q", "to_k", "to_v"), "again") is None  # slices now


def _first_attention(model: torch.nn.Module) -> str:
    return "layers.0.attention" if hasattr(model, "layers") else "blocks.0.attn1"


def _width(model: torch.nn.Module) -> int:
    return int(model.config.get("dim") or model.config.num_attention_heads * model.config.attention_head_dim)
