"""FP8 attention (``kernels/fp8_attention.py``) on the CPU: the per-tensor quantization (eager, and
its Triton kernels under the interpreter), the fp8 reference against exact attention, the cuDNN
graph as built (its execution needs a GPU: ``tests/gpu/test_fp8_attention_gpu.py``) and the
dispatcher's answer off CUDA."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F
from omnirt.kernels import fp8_attention, settings
from omnirt.kernels.w8a8 import quantize_rows

from .conftest import interpreted


def _snr_db(got: torch.Tensor, want: torch.Tensor) -> float:
    noise = (got.float() - want.float()).pow(2).mean()
    return 10 * math.log10(want.float().pow(2).mean() / noise)


def _dit_qkv(batch: int, tokens: int, heads: int, dim: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Queries and keys of unit RMS per head (what a DiT's QK norm hands attention), values not
    normalised, with a few large ones."""
    g = torch.Generator().manual_seed(seed)
    q = F.rms_norm(torch.randn(batch, tokens, heads, dim, generator=g), (dim,)) * 1.5
    k = F.rms_norm(torch.randn(batch, tokens, heads, dim, generator=g), (dim,)) * 1.5
    v = torch.randn(batch, tokens, heads, dim, generator=g)
    v[0, 3, 0, :4] = 12.0
    return q, k, v


def test_a_tensor_is_quantized_with_its_peak_at_448():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 50, 3, 32, generator=g, dtype=torch.float32).to(torch.bfloat16)
    x[1, 7, 2, 5] = -40.0
    values, scale = fp8_attention.quantize_tensor_reference(x)
    assert values.shape == x.shape and values.dtype == torch.float8_e4m3fn and scale.shape == (1,)
    assert scale.item() == pytest.approx(40.0 / 448.0, rel=1e-6)
    assert values.float().abs().max().item() == 448.0 and values[1, 7, 2, 5].item() == -448.0
    back = values.float() * scale
    normal = x.float().abs() >= scale * 2.0**-6  # e4m3's normal range: 3 mantissa bits
    assert ((back - x.float()).abs() <= x.float().abs() * 2.0**-4)[normal].all()
    zeros, tiny = fp8_attention.quantize_tensor_reference(torch.zeros(4, 2, 8))
    assert torch.equal(zeros.float(), torch.zeros(4, 2, 8)) and 0 < tiny.item() < 1e-14


@interpreted
def test_quantize_tensor_kernels_are_bitwise_the_eager_chain():
    """The interpreter has no fp8: the same kernels in their int8 form against the same chain."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 37, 3, 40, generator=g) * 3
    x[1, 30, 2, 39] = 250.0  # the peak in the last block of rows and columns
    packed = torch.randn(2, 19, 3, 5, 16, generator=g)  # [B, S, (q, k, v), H, D]
    value = packed.unbind(2)[2]  # a view: rows of H * D at a stride of 3 * H * D
    wide = torch.randn(1, 3, 2, 1024, generator=g)  # rows wider than one block of columns
    for t in (x, value, wide, torch.zeros(3, 4, 2, 8)):
        got, got_scale = fp8_attention.quantize_tensor_triton(t, "int8")
        want, want_scale = quantize_rows(t.reshape(1, -1), "int8")
        assert got.shape == t.shape and torch.equal(got.reshape(1, -1), want)
        assert torch.equal(got_scale, want_scale.view(1))
        # the peak given (found by the product that wrote t): the values kernel alone, the same bits
        known = fp8_attention.quantize_tensor_triton(t, "int8", peak=t.abs().amax().float().view(1))
        assert torch.equal(known[0], got) and torch.equal(known[1], got_scale)
    # a given peak is taken as it is (no pass of its own over the values)
    _, scale = fp8_attention.quantize_tensor_triton(x, "int8", peak=torch.full((1,), 127.0 * 4))
    assert scale.item() == 4.0


@pytest.mark.parametrize("batch, masked", [(1, False), (2, True)])
def test_fp8_attention_reference_is_close_to_exact_attention(batch, masked):
    heads, dim, tokens = 4, 64, 300
    q, k, v = _dit_qkv(batch, tokens, heads, dim, seed=5)
    lengths = torch.tensor([tokens, 211], dtype=torch.int32)[:batch] if masked else None
    got = fp8_attention.fp8_attention_reference(q.bfloat16(), k.bfloat16(), v.bfloat16(), lengths)
    mask = None
    if masked:
        mask = (torch.arange(tokens)[None, :] < lengths[:, None])[:, None, None, :]
    want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
    want = want.transpose(1, 2)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    # e4m3's 3 mantissa bits: Q alone costs about 27 dB here, K 26, V 31, P 36 (bf16 SDPA: 46)
    assert _snr_db(got, want) > 20.0
    # the masked keys take no part: changing them changes nothing
    if masked:
        k2, v2 = k.clone(), v.clone()
        k2[1, 211:] = 100.0
        v2[1, 211:] = -100.0
        moved = fp8_attention.fp8_attention_reference(q.bfloat16(), k2.bfloat16(), v2.bfloat16(), lengths)
        exact = F.scaled_dot_product_attention(
            q.transpose(1, 2), k2.transpose(1, 2), v2.transpose(1, 2), mask
        ).transpose(1, 2)
        assert _snr_db(moved[1], exact[1]) > 18.0


def test_an_e4m3_output_costs_a_little_more():
    q, k, v = (t.bfloat16() for t in _dit_qkv(1, 200, 2, 64, seed=6))
    wide = fp8_attention.fp8_attention_reference(q, k, v)
    narrow = fp8_attention.fp8_attention_reference(q, k, v, fp8_out=True)
    exact = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    exact = exact.transpose(1, 2)
    assert 18.0 < _snr_db(narrow, exact) < _snr_db(wide, exact)
    assert _snr_db(narrow, wide) > 25.0


def test_grouped_keys_are_repeated_over_their_query_heads():
    q, _, _ = _dit_qkv(1, 64, 4, 32, seed=7)
    _, k, v = _dit_qkv(1, 64, 2, 32, seed=8)
    got = fp8_attention.fp8_attention_reference(q, k, v)
    want = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True
    ).transpose(1, 2)
    assert _snr_db(got, want) > 20.0


@pytest.mark.parametrize("per_head", [True, False])
def test_normed_scale_bounds_every_normed_rotated_element(per_head):
    """A row with all of its weight on the element of the largest norm weight reaches the bound
    (within the roundings): it stays within 448 of the scale, as every random row does."""
    from omnirt.kernels.qk_norm_rope import qk_norm_rope_reference

    heads, dim = 4, 64
    g = torch.Generator().manual_seed(12)
    width = dim if per_head else heads * dim
    weight = (torch.randn(width, generator=g) * 0.5 + 1.0).bfloat16()
    top = int(weight.float().abs().argmax())
    q = torch.randn(1, 40, heads, dim, generator=g).bfloat16()
    for row in range(8):  # one-hot rows: the norm puts sqrt(n) on the heaviest weight's element
        q[0, row] = 0
        q[0, row].view(-1)[top % dim if per_head else top] = 3.0 * (row + 1)
    angles = torch.rand(1, 40, dim // 2, generator=g) * 6
    table = torch.cat([angles.cos(), angles.sin()], dim=-1).bfloat16()
    norm = dict(norm="composite", rope="io") if per_head else dict(norm="fused", rope="io")
    out, _ = qk_norm_rope_reference(q, q, weight, weight, table, eps=1e-6, interleaved=True,
                                    per_head=per_head, **norm)  # fmt: skip
    scale = fp8_attention.normed_scale(weight, width if not per_head else dim)
    peak = out.float().abs().max() / scale
    assert 400 < peak <= 448  # the one-hot rows come close to the bound, none past it
    # a random row's elements: 448 / sqrt(n) in RMS, times the weights' RMS over their peak, far
    # above e4m3's subnormals (below 2^-6)
    typical = out.float()[0, 8:].pow(2).mean().sqrt() / scale
    spread = weight.float().pow(2).mean().sqrt() / weight.float().abs().max()
    assert 0.8 < typical / (448 / math.sqrt(width if not per_head else dim) * spread) < 1.0
    assert fp8_attention.normed_scale(None, 128).item() == pytest.approx(math.sqrt(128) * (1 + 2**-5) / 448)


def test_fp8_attention_does_not_apply_off_cuda():
    q, k, v = (t.bfloat16() for t in _dit_qkv(1, 16, 2, 64, seed=9))
    assert not fp8_attention.supported(q, k, v) and not fp8_attention.applies(q, k, v)
    with pytest.raises(RuntimeError, match="does not apply"):
        fp8_attention.fp8_attention(q, k, v)


def test_the_setting_takes_on_and_off_only():
    before = settings.FP8_ATTENTION
    try:
        settings.set_fp8_attention("on")
        assert settings.FP8_ATTENTION == "on"
        with pytest.raises(ValueError, match="fp8 attention must be one of on, off"):
            settings.set_fp8_attention("auto")
        assert settings.FP8_ATTENTION == "on"
    finally:
        settings.set_fp8_attention(before)


def test_the_cudnn_graph_of_each_shape_is_built():
    """The graph as far as the front end builds it without a GPU: the fp8 attention node with its
    scales, the key lengths where masked, the output and its peak marked as outputs."""
    try:
        import cudnn
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip("nvidia-cudnn-frontend is not installed (the cudnn extra)")
    for masked in (False, True):
        shape = fp8_attention._Shape(2, 30, 30, 4128, 4128, 128, torch.bfloat16, masked, 0, 128**-0.5)
        graph = fp8_attention.build_graph(cudnn, shape)
        (node,) = graph.nodes
        assert node.node_type == cudnn.NodeType.SDPA_FP8
        assert node.params["attn_scale"] == 128**-0.5 and node.params.get("use_padding_mask", False) is masked
        tensors = {t.uid: t for t in graph.tensors.values() if not t.is_virtual}
        out, peak = tensors[fp8_attention._O], tensors[fp8_attention._O_AMAX]
        assert list(out.dim) == [2, 30, 4128, 128] and list(out.stride) == [4128 * 30 * 128, 128, 30 * 128, 1]
        assert out.data_type == cudnn.data_type.BFLOAT16 and peak.data_type == cudnn.data_type.FLOAT
        q = tensors[fp8_attention._Q]
        assert q.data_type == cudnn.data_type.FP8_E4M3 and list(q.stride) == list(out.stride)
        assert (fp8_attention._SEQ_KV in tensors) == masked and (fp8_attention._SEQ_Q in tensors) == masked
        assert len(tensors) == 11 + 2 * masked  # Q, K, V, six scales, O and its peak; the lengths
