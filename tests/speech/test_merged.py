"""A decoder layer's projections merged into one product each (stages/speech/merged.py): the modules
keep views of the merged weights (transformers' own forward unchanged, nothing stored twice,
in-place loads write through), the merged products equal the separate ones, and modules of another
shape are left alone. Also the code predictor's shared rotary tables (``SlotDecoder.shared_rope``)
against the per-row ones."""

from __future__ import annotations

import pytest
import torch
from omnirt.stages.speech.merged import merge_layer
from omnirt.stages.speech.slots import SlotDecoder
from torch import nn
from transformers import Qwen3Config, Qwen3Model


def _model(seed: int = 0, **overrides) -> Qwen3Model:
    torch.manual_seed(seed)
    cfg = dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_hidden_layers=2, vocab_size=50, max_position_embeddings=64,
    )  # fmt: skip
    cfg.update(overrides)
    return Qwen3Model(Qwen3Config(**cfg)).eval()


def _layer_out(model: Qwen3Model, x: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(x.shape[1]).view(1, -1)
    with torch.no_grad():
        return model(inputs_embeds=x, position_ids=positions).last_hidden_state


def test_modules_keep_views_and_transformers_forward_is_unchanged():
    model = _model()
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1))
    before = _layer_out(model, x)
    names = sorted(model.state_dict())
    layer = model.layers[0]
    merged = merge_layer(layer)
    attn, mlp = layer.self_attn, layer.mlp
    assert merged.qkv is not None and merged.qkv.shape == (64 + 2 * 32, 64)
    assert merged.gate_up is not None and merged.gate_up.shape == (2 * 96, 64) and merged.inner == 96
    for module in (attn.q_proj, attn.k_proj, attn.v_proj):  # views into the merged tensor
        assert module.weight.untyped_storage().data_ptr() == merged.qkv.untyped_storage().data_ptr()
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == merged.gate_up.untyped_storage().data_ptr()
    assert torch.equal(_layer_out(model, x), before)
    assert sorted(model.state_dict()) == names
    with torch.no_grad():  # a later in-place load writes through to the merged weight
        attn.k_proj.weight.fill_(0.5)
    assert torch.equal(merged.qkv[64:96], torch.full((32, 64), 0.5))


def test_merged_products_equal_the_separate_ones():
    model = _model(seed=2)
    layer = model.layers[1]
    attn, mlp = layer.self_attn, layer.mlp
    h = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = (attn.q_proj(h), attn.k_proj(h), attn.v_proj(h), mlp(h))
        merged = merge_layer(layer)
        q, k, v = merged.project(attn, h, 16)
        got_mlp = merged.mlp(mlp, h)
    assert q.shape == (3, 4, 4, 16) and k.shape == v.shape == (3, 4, 2, 16)
    for got, ref in zip((q.flatten(2), k.flatten(2), v.flatten(2), got_mlp), want, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)


def test_biased_projections_merge_their_biases():
    model = _model(seed=4, attention_bias=True)
    layer = model.layers[0]
    attn = layer.self_attn
    h = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = torch.cat([attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)], dim=-1)
        merged = merge_layer(layer)
        got = torch.cat([t.flatten(2) for t in merged.project(attn, h, 16)], dim=-1)
    assert merged.qkv_bias is not None and attn.v_proj.bias.untyped_storage().data_ptr() == (
        merged.qkv_bias.untyped_storage().data_ptr()
    )
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_other_shapes_are_left_alone():
    model = _model(seed=6)
    layer = model.layers[0]
    layer.mlp.act_fn = nn.GELU()  # not SiLU-gated: the module runs itself
    layer.self_attn.v_proj.bias = nn.Parameter(torch.zeros(32))  # one bias among three: no merge
    merged = merge_layer(layer)
    assert merged.qkv is None and merged.gate_up is None
    h = torch.randn(1, 2, 64)
    with torch.no_grad():
        q, _, v = merged.project(layer.self_attn, h, 16)
        torch.testing.assert_close(v.flatten(2), layer.self_attn.v_proj(h))
        assert torch.equal(merged.mlp(layer.mlp, h), layer.mlp(h))
    assert q.shape == (1, 2, 4, 16)


@pytest.mark.parametrize("position", [0, 7])
def test_shared_rope_is_the_per_row_rope_bitwise(position):
    decoder = SlotDecoder(
        _model(seed=8), num_slots=3, max_len=16, device=torch.device("cpu"), dtype=torch.float32,
        multimodal_rope=False,
    )  # fmt: skip
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(9))
    positions = torch.full((3,), position)
    active = torch.tensor([True, False, True])
    lengths = torch.tensor([position, 2, position])
    outs, caches = [], []
    for rope in (None, decoder.shared_rope(position)):
        decoder.cache.zero_()
        decoder.lengths.copy_(lengths)
        outs.append(decoder.step(x, positions, active, 16, rope))
        caches.append(decoder.cache.clone())
    assert torch.equal(outs[0][[0, 2]], outs[1][[0, 2]])
    assert torch.equal(caches[0], caches[1])
