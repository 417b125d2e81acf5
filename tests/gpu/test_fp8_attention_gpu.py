"""FP8 attention on the GPU (marker ``gpu``; Hopper or later with ``nvidia-cudnn-frontend``): the
per-tensor quantization kernels bitwise the eager chain in fp8; cuDNN's fp8 attention against its
fp32 model (``fp8_attention_reference``) and against bf16 attention, with key padding; captured
in a CUDA graph, replay tracking new inputs; a W8A8 fp8 Z-Image with ``--fp8-attention on`` close
to the same model with bf16 attention, its attention having run in fp8."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from omnirt.kernels import cudnn_graphs, fp8_attention, settings


def _hopper_with_cudnn() -> bool:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        return False
    return cudnn_graphs.frontend() is not None


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _hopper_with_cudnn(), reason="needs a Hopper GPU and nvidia-cudnn-frontend"),
]


def _snr_db(got: torch.Tensor, want: torch.Tensor) -> float:
    noise = (got.float() - want.float()).pow(2).mean()
    return 10 * math.log10(want.float().pow(2).mean() / noise)


def _qkv(batch: int, tokens: int, heads: int, dim: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    packed = torch.randn(batch, tokens, 3, heads, dim, device="cuda", generator=g)
    q, k, v = packed.to(torch.bfloat16).unbind(2)  # views of a packed QKV, as the merged DiTs make them
    return F.rms_norm(q, (dim,)) * 1.5, F.rms_norm(k, (dim,)) * 1.5, v


def test_quantize_tensor_kernels_are_bitwise_the_eager_chain_in_fp8():
    q, k, v = _qkv(2, 1000, 6, 128, seed=1)
    for t in (q, k, v):  # v: a strided view
        got, got_scale = fp8_attention.quantize_tensor_triton(t)
        want, want_scale = fp8_attention.quantize_tensor_reference(t)
        assert torch.equal(got_scale, want_scale)
        assert torch.equal(got.view(torch.int8), want.view(torch.int8))


@pytest.mark.parametrize("chain", ["zimage", "wan"])
def test_qk_kernel_writes_e4m3_over_fixed_scales(chain):
    """The QK kernel's e4m3 outputs are bitwise its bf16 outputs over the scales; then attention
    from them keeps to bf16 attention of the bf16 outputs."""
    from omnirt.kernels.qk_norm_rope import qk_norm_rope, table_from_complex
    from omnirt.kernels.w8a8 import quantize_scaled

    heads, dim, tokens = (30, 128, 1000) if chain == "zimage" else (12, 128, 1560)
    q, k, v = _qkv(1, tokens, heads, 128, seed=6)
    g = torch.Generator(device="cuda").manual_seed(7)
    per_head = chain == "zimage"
    width = dim if per_head else heads * dim
    qw, kw = ((torch.rand(width, device="cuda", generator=g) + 0.5).bfloat16() for _ in range(2))
    angles = torch.rand(tokens, dim // 2, device="cuda", generator=g) * 6
    if per_head:
        table = table_from_complex(torch.polar(torch.ones_like(angles), angles))[None]
        args = dict(eps=1e-5, interleaved=True, per_head=True, norm="composite", rope="complex")
    else:
        table = torch.cat([angles.cos(), angles.sin()], -1)[None]
        args = dict(eps=1e-6, interleaved=True, per_head=False, norm="fused", rope="float32")
    scales = (fp8_attention.normed_scale(qw, width), fp8_attention.normed_scale(kw, width))
    plain = qk_norm_rope(q, k, qw, kw, table, **args)
    got = qk_norm_rope(q, k, qw, kw, table, out_scales=scales, **args)
    for a, b, scale in zip(got, plain, scales, strict=True):
        assert a.dtype == torch.float8_e4m3fn
        assert torch.equal(a.view(torch.int8), quantize_scaled(b, scale, "fp8").view(torch.int8))
    out = fp8_attention.fp8_attention(*got, v, q_scale=scales[0], k_scale=scales[1])
    bf16 = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (*plain, v))).transpose(1, 2)
    print(f"{chain}: attention from the QK kernel's e4m3 vs bf16 {_snr_db(out, bf16):.1f} dB")
    assert _snr_db(out, bf16) > 20


@pytest.mark.parametrize("quantized_out", [False, True])
@pytest.mark.parametrize("batch, tokens, heads", [(1, 4128, 30), (2, 1000, 6)])
def test_cudnn_fp8_attention_against_its_model_and_bf16(batch, tokens, heads, quantized_out):
    """Wide, or (``quantized_out``) e4m3 at V's scale as a W8A8 product takes it."""
    from omnirt.kernels.w8a8 import QuantizedRows

    q, k, v = _qkv(batch, tokens, heads, 128, seed=2)
    lengths = None if batch == 1 else torch.tensor([tokens, 777], dtype=torch.int32, device="cuda")
    assert fp8_attention.applies(q, k, v, lengths, quantized_out=quantized_out)
    got = fp8_attention.fp8_attention(q, k, v, lengths, quantized_out=quantized_out)
    plan = fp8_attention._plans[fp8_attention._shape(q, k, v, lengths, None, quantized_out)]
    model = fp8_attention.fp8_attention_reference(q, k, v, lengths, fp8_out=plan.fp8_out)
    if quantized_out:
        assert isinstance(got, QuantizedRows) and got.values.dtype == torch.float8_e4m3fn
        assert got.values.shape == (batch * tokens, heads * 128) and got.shape == (batch, tokens, heads * 128)
        assert got.scale.shape == (batch * tokens, 1) and got.scale.is_contiguous()
        got = (got.values.float() * got.scale).view(q.shape).to(v.dtype)
    mask = None
    if lengths is not None:
        mask = (torch.arange(tokens, device="cuda")[None, :] < lengths[:, None])[:, None, None, :]
    bf16 = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
    bf16 = bf16.transpose(1, 2)
    assert got.shape == q.shape and got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    out = "e4m3" if plan.fp8_out else "bf16"
    print(f"fp8 ({out} out) vs its model {_snr_db(got, model):.1f} dB, vs bf16 {_snr_db(got, bf16):.1f} dB")
    assert _snr_db(got, model) > 30  # the running maximum and the sums' order differ
    assert _snr_db(got, bf16) > 20


def test_timed_plans_keep_to_cudnns_first(monkeypatch):
    """``AUTOTUNE_PLANS``: at a shape's first call the fastest of cuDNN's first plans runs (its
    index kept), its output close to the first plan's; then the call is a plain execution."""
    q, k, v = _qkv(1, 2048, 8, 128, seed=8)
    first = fp8_attention.fp8_attention(q, k, v)
    monkeypatch.setattr(fp8_attention, "AUTOTUNE_PLANS", 6)
    monkeypatch.setattr(fp8_attention, "_plans", cudnn_graphs.PlanCache(4, "fp8 attention"))
    timed = fp8_attention.fp8_attention(q, k, v)
    plan = fp8_attention._plans[fp8_attention._shape(q, k, v, None, None)]
    assert plan.tuned and plan.index is not None and 0 <= plan.index < 6  # timed, one kept
    assert _snr_db(timed, first) > 30
    assert torch.equal(fp8_attention.fp8_attention(q, k, v), timed)


def test_fp8_attention_in_a_cuda_graph_tracks_new_inputs():
    q, k, v = _qkv(1, 1024, 4, 128, seed=3)
    static = [t.clone() for t in (q, k, v)]
    fp8_attention.fp8_attention(*static)  # builds the plan outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_attention.fp8_attention(*static)
    for seed in (4, 5):
        fresh = _qkv(1, 1024, 4, 128, seed=seed)
        for dst, src in zip(static, fresh, strict=True):
            dst.copy_(src)
        graph.replay()
        assert torch.equal(out, fp8_attention.fp8_attention(*fresh))


def test_fp8_zimage_attends_in_fp8_when_asked(monkeypatch):
    from omnirt.stages.diffusion import fused
    from omnirt.stages.diffusion.quant import quantize_model

    from .dit_models import tiny_zimage

    zimage = tiny_zimage(dim=768, heads=6)
    quantize_model(zimage, "fp8")
    fused.install(zimage)
    g = torch.Generator(device="cuda").manual_seed(1)
    latents = [torch.randn(16, 1, 32, 32, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2)]
    # captions padded to different multiples of 32 (diffusers masks only then: 7 and 19 both pad to 32)
    caption = [torch.randn(n, 64, device="cuda", dtype=torch.bfloat16, generator=g) for n in (7, 40)]
    t = torch.tensor([0.3, 0.7], device="cuda", dtype=torch.bfloat16)
    calls = []
    run = fp8_attention.fp8_attention

    def spy(*args, **kwargs):
        calls.append((args[3] is not None, args[0].dtype, kwargs["quantized_out"]))
        return run(*args, **kwargs)

    monkeypatch.setattr(fp8_attention, "fp8_attention", spy)
    before = settings.FP8_ATTENTION
    try:
        with torch.no_grad():
            settings.set_fp8_attention("off")  # (on by default)
            want = torch.stack(zimage(latents, t, caption, return_dict=False)[0]).float()
            assert not calls
            settings.set_fp8_attention("on")
            got = torch.stack(zimage(latents, t, caption, return_dict=False)[0]).float()
    finally:
        settings.set_fp8_attention(before)
    # every attention, its queries and keys written e4m3 by the QK kernel; the captions padded
    assert len(calls) == 4 and any(masked for masked, _, _ in calls)
    assert all(dtype == torch.float8_e4m3fn and e4m3_out for _, dtype, e4m3_out in calls)  # into to_out
    print(f"fp8 attention Z-Image vs bf16 attention: {_snr_db(got, want):.1f} dB")
    assert _snr_db(got, want) > 20


@pytest.mark.parametrize("gemm", ["triton", "library"])
def test_vs_peak_from_the_qkv_product_gives_the_same_step(gemm, monkeypatch):
    """``fused.V_PEAK_IN_PRODUCT``: V's peak for the fp8 attention found by the merged QKV
    product (the Triton GEMM's epilogue, or over the library product's output) gives the bits of
    V's quantization finding it itself, and the attention gets it (``v_peak``)."""
    from omnirt.kernels import w8a8
    from omnirt.stages.diffusion import fused
    from omnirt.stages.diffusion.quant import quantize_model

    from .dit_models import tiny_zimage

    zimage = tiny_zimage(dim=768, heads=6)
    quantize_model(zimage, "fp8")
    fused.install(zimage)
    g = torch.Generator(device="cuda").manual_seed(2)
    latents = [torch.randn(16, 1, 32, 32, device="cuda", dtype=torch.bfloat16, generator=g)]
    caption = [torch.randn(40, 64, device="cuda", dtype=torch.bfloat16, generator=g)]
    t = torch.tensor([0.4], device="cuda", dtype=torch.bfloat16)
    peaks = []
    run = fp8_attention.fp8_attention

    def spy(*args, **kwargs):
        peaks.append(kwargs.get("v_peak"))
        return run(*args, **kwargs)

    monkeypatch.setattr(fp8_attention, "fp8_attention", spy)
    with torch.no_grad(), w8a8.gemm_as(gemm):
        outputs = []
        for on in (False, True):
            monkeypatch.setattr(fused, "V_PEAK_IN_PRODUCT", on)
            outputs.append(zimage(latents, t, caption, return_dict=False)[0][0])
    assert torch.equal(outputs[0], outputs[1])
    assert len(peaks) == 8 and all(p is None for p in peaks[:4]) and all(p is not None for p in peaks[4:])
