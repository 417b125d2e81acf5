"""W8A8 on the GPU (marker ``gpu``): the quantization and int8 epilogue kernels bitwise equal to the
eager chains; int8 (``torch._int_mm``, padded below 17 rows) and fp8
(``torch._scaled_mm`` with row-wise scales) against the dequantized reference in bf16, and a
quantized Wan transformer on CUDA close to the bf16 one."""

from __future__ import annotations

import pytest
import torch
from omnirt.kernels.w8a8 import quantize_rows, w8a8_linear, w8a8_linear_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("rows", [1, 16, 33, 4096])
def test_products_on_cuda(kind, rows):
    g = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(512, 256, device="cuda", generator=g) * 0.05
    qweight, scale = quantize_rows(weight, kind)
    x = torch.randn(rows, 256, device="cuda", generator=g).to(torch.bfloat16)
    bias = torch.randn(512, device="cuda", generator=g)
    got = w8a8_linear(x, qweight, scale, bias, kind)
    want = w8a8_linear_reference(x, qweight, scale, bias, kind)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 512)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("hold", [False, True], ids=["read-again", "held"])
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_kernels_are_bitwise_the_eager_chains_on_cuda(kind, hold, monkeypatch):
    from omnirt.kernels import settings
    from omnirt.kernels.w8a8 import _int8_epilogue, int8_epilogue_triton, quantize_rows_triton

    monkeypatch.setattr(settings, "HOLD_ROWS", hold)  # the rows read once and held, or read again
    g = torch.Generator(device="cuda").manual_seed(2)
    for rows, cols in ((1, 64), (300, 3072), (4100, 13824), (4128, 10240), (33, 20000)):
        x = (torch.randn(rows, cols, device="cuda", generator=g) * 3).to(torch.bfloat16)
        got_q, got_scale = quantize_rows_triton(x, kind)
        want_q, want_scale = quantize_rows(x, kind)
        assert torch.equal(got_scale, want_scale)
        assert torch.equal(got_q.view(torch.int8), want_q.view(torch.int8))
    acc = torch.randint(-(2**24), 2**24, (333, 1000), device="cuda", generator=g, dtype=torch.int32)
    x_scale = torch.rand(333, 1, device="cuda", generator=g) * 1e-2
    weight_scale = torch.rand(1000, 1, device="cuda", generator=g) * 1e-3
    for bias in (torch.randn(1000, device="cuda", generator=g).to(torch.bfloat16), None):
        got = int8_epilogue_triton(acc, x_scale, weight_scale, bias, torch.bfloat16)
        assert torch.equal(got, _int8_epilogue(acc, x_scale, weight_scale, bias, torch.bfloat16))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantized_wan_on_cuda(kind):
    from diffusers import WanTransformer3DModel
    from omnirt.stages.diffusion.quant import quantize_model
    from omnirt.stages.diffusion.wan_loader import _cast_keeping_fp32

    with torch.device("cuda"):
        torch.manual_seed(0)
        wan = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=128, in_channels=16,
            out_channels=16, text_dim=64, freq_dim=256, ffn_dim=1024, num_layers=2, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
        ).eval()  # fmt: skip
    _cast_keeping_fp32(wan, torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(1)
    video = torch.randn(2, 16, 5, 16, 24, device="cuda", dtype=torch.bfloat16, generator=g)
    text = torch.randn(2, 32, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    steps = torch.tensor([300.0, 700.0], device="cuda")
    with torch.no_grad():
        want = wan(video, steps, text, return_dict=False)[0].float()
        done = quantize_model(wan, kind)
        got = wan(video, steps, text, return_dict=False)[0].float()
    assert done.layers == 20  # 10 per block: q, k, v, out of both attentions and the two of the FFN
    snr = 10 * torch.log10(want.pow(2).mean() / (got - want).pow(2).mean())
    assert snr > (25 if kind == "int8" else 18), float(snr)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_merged_quantized_zimage_on_cuda(kind):
    """A W8A8 Z-Image with the fused forwards and merged layers (q, k, v one product; w1, w3 one;
    the norms and the gated unit writing quantized inputs) against the same model unmerged and
    unfused: int8 sums are integers, so the same bits; fp8 within fp32 rounding of the sums."""
    import copy

    from omnirt.stages.diffusion import fused
    from omnirt.stages.diffusion.quant import quantize_model

    from .dit_models import tiny_zimage

    zimage = tiny_zimage(dim=768, heads=6)  # feed-forward 2048 wide: fp8 wants multiples of 16
    quantize_model(zimage, kind)
    merged = copy.deepcopy(zimage)
    assert fused.install(merged) == 12
    assert fused._quantized_inputs(merged.layers[0]) == kind
    g = torch.Generator(device="cuda").manual_seed(1)
    latents = [torch.randn(16, 1, 32, 32, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2)]
    caption = [torch.randn(n, 64, device="cuda", dtype=torch.bfloat16, generator=g) for n in (7, 19)]
    t = torch.tensor([0.3, 0.7], device="cuda", dtype=torch.bfloat16)
    from omnirt.kernels import settings

    before = settings.FP8_ATTENTION
    settings.set_fp8_attention("off")  # the merging alone (fp8 attention: test_fp8_attention_gpu.py)
    try:
        with torch.no_grad():
            want = torch.stack(zimage(latents, t, caption, return_dict=False)[0]).float()
            got = torch.stack(merged(latents, t, caption, return_dict=False)[0]).float()
    finally:
        settings.set_fp8_attention(before)
    if kind == "int8":
        assert torch.equal(got, want)
    else:
        snr = 10 * torch.log10(want.pow(2).mean() / (got - want).pow(2).mean())
        assert snr > 35, float(snr)
