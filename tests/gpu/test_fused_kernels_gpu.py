"""The fused DiT kernels on the GPU (marker ``gpu``; results in docs/benchmarks.md): bf16 parity per
preset (bitwise for ``exact``), ``torch.compile`` through the custom ops, CUDA graph capture and
replay on new inputs, and the diffusers DiT models with the kernels installed."""

from __future__ import annotations

import pytest
import torch
from omnirt.kernels import settings
from omnirt.kernels.adaln import adaln_modulate, adaln_modulate_reference, adaln_modulate_triton
from omnirt.kernels.qk_norm_rope import (
    kernel_applies,
    qk_norm_rope,
    qk_norm_rope_reference,
    qk_norm_rope_triton,
    split_packed_qkv,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

BF16 = torch.bfloat16
# (name, batch, tokens, q heads, k heads, per head, norm, rope, interleaved, packed)
QK_CASES = [
    ("zimage", 2, 1056, 30, 30, True, "composite", "complex", True, False),
    ("wan-1.3b", 2, 4096, 12, 12, False, "fused", "float32", True, False),
    ("wan-14b-packed", 1, 1024, 40, 40, False, "fused", "float32", True, True),
    ("qwen-prefill", 1, 777, 32, 4, True, "composite", "io", False, False),
    ("qwen-decode-3", 3, 1, 32, 4, True, "composite", "io", False, False),
    ("talker-decode-1", 1, 1, 16, 2, True, "composite", "io", False, False),
]


@pytest.fixture(autouse=True)
def _fused_auto():
    before = settings.FUSED
    settings.set_fused("auto")
    yield
    settings.set_fused(before)


def _qk_inputs(batch, tokens, hq, hk, per_head, rope, packed, seed=0, dim=128):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if packed:
        qkv = torch.randn(batch, tokens, (hq + 2 * hk) * dim, device="cuda", dtype=BF16, generator=g)
        q, k, _ = split_packed_qkv(qkv, hq, hk, dim)
    else:
        q = torch.randn(batch, tokens, hq, dim, device="cuda", dtype=BF16, generator=g)
        k = torch.randn(batch, tokens, hk, dim, device="cuda", dtype=BF16, generator=g)
    qw = (1 + 0.1 * torch.randn(dim if per_head else hq * dim, device="cuda", generator=g)).to(BF16)
    kw = (1 + 0.1 * torch.randn(dim if per_head else hk * dim, device="cuda", generator=g)).to(BF16)
    angles = torch.rand(1 if rope != "io" else batch, tokens, dim // 2, device="cuda", generator=g) * 100
    table = torch.cat([angles.cos(), angles.sin()], dim=-1)
    return q, k, qw, kw, table.to(BF16) if rope == "io" else table


def _kw(case):
    _, _, _, _, _, per_head, norm, rope, interleaved, _ = case
    return dict(eps=1e-6, interleaved=interleaved, per_head=per_head, norm=norm, rope=rope)


@pytest.mark.parametrize("case", QK_CASES, ids=[c[0] for c in QK_CASES])
def test_qk_exact_is_bitwise_and_fast_is_close(case):
    _, b, t, hq, hk, per_head, _, rope, _, packed = case
    q, k, qw, kw, table = _qk_inputs(b, t, hq, hk, per_head, rope, packed)
    ref = qk_norm_rope_reference(q, k, qw, kw, table, **_kw(case))
    exact = qk_norm_rope_triton(q, k, qw, kw, table, preset="exact", **_kw(case))
    fast = qk_norm_rope_triton(q, k, qw, kw, table, preset="fast", **_kw(case))
    for e, f, r in zip(exact, fast, ref, strict=True):
        assert e.is_contiguous() and e.shape == r.shape
        assert torch.equal(e, r)
        torch.testing.assert_close(f, r, rtol=2e-2, atol=2e-2)
    # the dispatcher takes the kernel for these chains (bitwise at head dim 128) and gives the same
    assert kernel_applies(q, k, qw, kw, table, per_head=per_head, norm=case[6], rope=rope)
    for d, r in zip(qk_norm_rope(q, k, qw, kw, table, **_kw(case)), ref, strict=True):
        assert torch.equal(d, r)


ADALN_CASES = [
    ("wan-1.3b-sample", (2, 1000, 1536), "sample"),
    ("wan-14b-sample", (1, 512, 5120), "sample"),
    ("ti2v-token", (1, 256, 3072), "token"),
    ("shared", (2, 300, 2048), "shared"),
    ("scale-only", (1, 700, 3840), "scale"),
]


def _adaln_inputs(shape, mode, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    b, s, c = shape
    x = torch.randn(shape, device="cuda", dtype=BF16, generator=g) * 2 + 0.5
    if mode == "token":
        table = torch.randn(b, s, 6, c, device="cuda", generator=g)
        return x, table[:, :, 1], table[:, :, 0]
    if mode == "shared":
        return x, torch.randn(c, device="cuda", generator=g), torch.randn(1, 1, c, device="cuda", generator=g)
    table = torch.randn(b, 6, c, device="cuda", generator=g)
    return x, table[:, 1:2], None if mode == "scale" else table[:, 0:1]


@pytest.mark.parametrize("case", ADALN_CASES, ids=[c[0] for c in ADALN_CASES])
def test_adaln_exact_is_bitwise_and_fast_is_close(case):
    _, shape, mode = case
    x, scale, shift = _adaln_inputs(shape, mode)
    ref = adaln_modulate_reference(x, scale, shift, eps=1e-6)
    assert torch.equal(adaln_modulate_triton(x, scale, shift, eps=1e-6, preset="exact"), ref)
    torch.testing.assert_close(adaln_modulate_triton(x, scale, shift, eps=1e-6, preset="fast"), ref)
    assert torch.equal(adaln_modulate(x, scale, shift, eps=1e-6), ref)


def test_compile_traces_through_both_ops():
    q, k, qw, kw, table = _qk_inputs(2, 300, 12, 12, False, "float32", False)
    x, scale, shift = _adaln_inputs((2, 300, 1536), "sample")
    case = QK_CASES[1]

    def block(q, k, x, scale, shift):  # (doubling is exact: any fusion inductor makes keeps the bits)
        qo, ko = qk_norm_rope(q, k, qw, kw, table, **_kw(case))
        return qo * 2, ko * 2, adaln_modulate(x, scale, shift, eps=1e-6) * 2

    compiled = torch.compile(block, fullgraph=True, dynamic=False)
    eager = block(q, k, x, scale, shift)
    traced = compiled(q, k, x, scale, shift)
    for a, b in zip(eager, traced, strict=True):
        assert torch.equal(a, b)


def test_graph_replay_tracks_new_inputs():
    case = QK_CASES[0]
    q, k, qw, kw, table = _qk_inputs(2, 1056, 30, 30, True, "complex", False)
    x, scale, shift = _adaln_inputs((2, 500, 1536), "sample")
    static = [t.clone() for t in (q, k, table, x, scale, shift)]

    def run():
        qo, ko = qk_norm_rope(static[0], static[1], qw, kw, static[2], **_kw(case))
        return qo, ko, adaln_modulate(static[3], static[4], static[5], eps=1e-6)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    for seed in (1, 2):
        q2, k2, _, _, t2 = _qk_inputs(2, 1056, 30, 30, True, "complex", False, seed=seed)
        x2, s2, sh2 = _adaln_inputs((2, 500, 1536), "sample", seed=seed)
        for dst, src in zip(static, (q2, k2, t2, x2, s2, sh2), strict=True):
            dst.copy_(src)
        graph.replay()
        want = (
            *qk_norm_rope_reference(q2, k2, qw, kw, t2, **_kw(case)),
            adaln_modulate_reference(x2, s2, sh2, eps=1e-6),
        )
        for got, ref in zip(outs, want, strict=True):
            assert torch.equal(got, ref)


def test_dit_models_with_the_kernels_installed_are_bitwise_unchanged():
    from diffusers import WanTransformer3DModel
    from omnirt.stages.diffusion.fused import install, uninstall
    from omnirt.stages.diffusion.wan_loader import _cast_keeping_fp32

    from .dit_models import tiny_zimage

    zimage = tiny_zimage()
    with torch.device("cuda"):
        wan = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=128, in_channels=16,
            out_channels=16, text_dim=64, freq_dim=256, ffn_dim=1024, num_layers=2, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
        ).eval()  # fmt: skip
        _cast_keeping_fp32(wan, BF16)  # as the loader does: rope, norms and tables stay fp32
    g = torch.Generator(device="cuda").manual_seed(1)
    latents = [torch.randn(16, 1, 32, 32, device="cuda", dtype=BF16, generator=g) for _ in range(2)]
    caption = [torch.randn(n, 64, device="cuda", dtype=BF16, generator=g) for n in (7, 19)]
    t = torch.tensor([0.3, 0.7], device="cuda", dtype=BF16)
    video = torch.randn(2, 16, 5, 16, 24, device="cuda", dtype=BF16, generator=g)
    text = torch.randn(2, 32, 64, device="cuda", dtype=BF16, generator=g)
    steps = torch.tensor([300.0, 700.0], device="cuda")
    with torch.no_grad():
        for model, call, sites in (
            (zimage, lambda: torch.stack(zimage(latents, t, caption, return_dict=False)[0]), 3 * (2 + 1 + 1)),
            (wan, lambda: wan(video, steps, text, return_dict=False)[0], 4),
        ):
            ref = call()
            assert install(model) == sites
            assert torch.equal(call(), ref)
            uninstall(model)
            assert torch.equal(call(), ref)
