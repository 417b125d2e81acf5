"""The parameters of a Moshi LM (temporal and depth transformers), named as in the checkpoint.

:class:`MoshiWeights` is a plain parameter tree whose ``state_dict()`` keys are exactly those
``MoshiForConditionalGeneration.save_pretrained`` writes for the LM (everything but
``audio_encoder.*``): ``decoder.model.embed_tokens.weight``, ``decoder.model.layers.N.*``,
``decoder.model.norm.weight``, ``decoder.lm_head.weight``, ``embed_tokens.N.weight`` (``2K``
audio tables: the model's stream ``0..K-1``, then the user's ``K..2K-1``) and
``depth_decoder.*`` (text and ``K - 1`` audio embeddings, the per-codebook input projections,
layers and heads, each a ``[K, out, in]`` stack of one matrix per codebook). The math lives in
:mod:`.lm`; this module only holds and shapes the tensors.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import MoshiConfig


class _Linear(nn.Module):
    """``MoshiLinear`` of the temporal transformer: one matrix, stored as ``linear.weight``."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=False)


class _Flexible(nn.Module):
    """``MoshiFlexibleLinear``: one matrix per codebook, ``weight`` [K, out, in]."""

    def __init__(self, in_features: int, out_features: int, codebooks: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(codebooks, out_features, in_features))


class _FlexibleProj(nn.Module):
    """``MoshiLinear`` of the depth transformer: ``linear.weight`` [K, out, in]."""

    def __init__(self, in_features: int, out_features: int, codebooks: int) -> None:
        super().__init__()
        self.linear = _Flexible(in_features, out_features, codebooks)


class _Norm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, codebooks: int | None) -> None:
        super().__init__()

        def proj(i: int, o: int) -> nn.Module:
            return _Linear(i, o) if codebooks is None else _FlexibleProj(i, o, codebooks)

        self.q_proj = proj(hidden, heads * head_dim)
        self.k_proj = proj(hidden, kv_heads * head_dim)
        self.v_proj = proj(hidden, kv_heads * head_dim)
        self.o_proj = proj(heads * head_dim, hidden)


class _Mlp(nn.Module):
    def __init__(self, hidden: int, ffn: int, codebooks: int | None) -> None:
        super().__init__()
        if codebooks is None:
            self.fc1: nn.Module = nn.Linear(hidden, ffn, bias=False)
            self.fc2: nn.Module = nn.Linear(ffn // 2, hidden, bias=False)
        else:
            self.fc1 = _Flexible(hidden, ffn, codebooks)
            self.fc2 = _Flexible(ffn // 2, hidden, codebooks)


class _Layer(nn.Module):
    def __init__(self, config, codebooks: int | None) -> None:
        super().__init__()
        self.self_attn = _Attention(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            codebooks,
        )
        self.mlp = _Mlp(config.hidden_size, config.ffn_dim, codebooks)
        self.input_layernorm = _Norm(config.hidden_size)
        self.post_attention_layernorm = _Norm(config.hidden_size)


class _TemporalModel(nn.Module):
    def __init__(self, config: MoshiConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size + 1, config.hidden_size)
        self.layers = nn.ModuleList(_Layer(config, None) for _ in range(config.num_hidden_layers))
        self.norm = _Norm(config.hidden_size)


class _Decoder(nn.Module):
    def __init__(self, config: MoshiConfig) -> None:
        super().__init__()
        self.model = _TemporalModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


class _DepthDecoder(nn.Module):
    def __init__(self, config: MoshiConfig) -> None:
        super().__init__()
        depth = config.depth_decoder_config
        k = config.num_codebooks
        self.text_embed_tokens = nn.Embedding(config.vocab_size + 1, depth.hidden_size)
        self.embed_tokens = nn.ModuleList(
            nn.Embedding(config.audio_vocab_size + 1, depth.hidden_size) for _ in range(k - 1)
        )
        self.input_projections = _Flexible(config.hidden_size, depth.hidden_size, k)
        self.layers = nn.ModuleList(_Layer(depth, k) for _ in range(depth.num_hidden_layers))
        self.lm_heads = _Flexible(depth.hidden_size, config.audio_vocab_size, k)


class MoshiWeights(nn.Module):
    """Every LM parameter of a ``MoshiForConditionalGeneration`` checkpoint (see module doc)."""

    def __init__(self, config: MoshiConfig) -> None:
        super().__init__()
        check_config(config)
        self.decoder = _Decoder(config)
        self.embed_tokens = nn.ModuleList(
            nn.Embedding(config.audio_vocab_size + 1, config.hidden_size)
            for _ in range(2 * config.num_codebooks)
        )
        self.depth_decoder = _DepthDecoder(config)


def check_config(config: MoshiConfig) -> None:
    """ValueError for a config this LM does not implement. A config built in code may lack
    ``audio_vocab_size`` (``MoshiConfig()`` does); it is then set from the codec's codebook size,
    as a round trip through ``config.json`` sets it."""
    if config.audio_vocab_size is None:
        config.audio_vocab_size = config.audio_encoder_config.codebook_size
    problems = []
    rope = dict(config.rope_parameters or {})
    if rope.get("rope_type", "default") != "default":
        problems.append(f"rope_type={rope.get('rope_type')!r} (only 'default')")
    depth = config.depth_decoder_config
    if depth.input_size != config.hidden_size or depth.num_codebooks != config.num_codebooks:
        problems.append("depth_decoder_config disagrees with the temporal config (input_size, num_codebooks)")
    for name, cfg in (("temporal", config), ("depth", depth)):
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            problems.append(f"{name}: num_attention_heads must be a multiple of num_key_value_heads")
        if cfg.ffn_dim % 2:
            problems.append(f"{name}: ffn_dim must be even")
    if config.num_codebooks < 2:
        problems.append("num_codebooks must be at least 2 (a semantic and an acoustic codebook)")
    if problems:
        raise ValueError("unsupported Moshi config: " + "; ".join(problems))
