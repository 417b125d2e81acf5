"""Streaming Mimi transformer: sliding-window causal attention over a bounded KV ring.

Each slot keeps, per layer, keys and values of its last ``ring = sliding_window + tokens - 1``
positions (``tokens``: the tokens a one-frame step adds, 2 for Mimi), plus the absolute
position held by every ring entry. A step first writes its new keys/values into the ring,
then attends over the ring with the mask ``query_pos - sliding_window < key_pos <= query_pos``
-- the mask transformers' full-sequence ``create_sliding_window_causal_mask`` builds. Keys are
stored already rotated (RoPE at their absolute position), as transformers' cache stores them.
Longer chunks are processed ``tokens`` at a time, which a causal stack allows.

The ring has one extra entry per slot that attention never reads: rows outside the exec mask
write their keys, values and positions there, so one scatter per tensor serves every row and
their real entries stay untouched.

Parameter names follow the checkpoint: ``layers.N.self_attn.q_proj.weight``,
``layers.N.mlp.fc1.weight``, ``layers.N.self_attn_layer_scale.scale``... ``alloc_state`` also
fuses q/k/v into one projection (a non-persistent buffer) in the weights' current dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from omnirt.kernels.ring_attention import ring_attention
from torch import nn

from ..streaming import StateSpec, StreamingModule, commit, rope_inv_freq
from .config import MimiCodecConfig

_EMPTY_POSITION = -(1 << 40)
_MASKED = -1e9  # finite, so a row with no visible key (idle rows only) gives no NaN
_ACT = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu}


class LayerScale(nn.Module):
    """Holds the per-channel ``scale`` (applied with ``addcmul`` in ``TransformerLayer``)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(channels))


class Mlp(nn.Module):
    def __init__(self, config: MimiCodecConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.activation = _ACT[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation(self.fc1(x)))


class RingAttention(StreamingModule):
    """Multi-head attention whose keys/values live in a per-slot ring of ``ring`` (+1) entries."""

    def __init__(self, config: MimiCodecConfig, ring: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.attention_head_dim
        self.ring = ring
        self.scaling = self.head_dim**-0.5
        bias = config.attention_bias
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.register_buffer("qkv_weight", None, persistent=False)
        self.register_buffer("qkv_bias", None, persistent=False)

    def state_specs(self) -> dict[str, StateSpec]:
        shape = (self.num_kv_heads, self.ring + 1, self.head_dim)
        return {"keys": StateSpec(shape), "values": StateSpec(shape)}

    def alloc_state(self, max_slots: int, device: torch.device, dtype: torch.dtype) -> None:
        super().alloc_state(max_slots, device, dtype)
        projections = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_weight = torch.cat([p.weight for p in projections]).detach()
        self.qkv_bias = (
            None if self.q_proj.bias is None else torch.cat([p.bias for p in projections]).detach()
        )

    def state_buffers(self) -> dict[str, torch.Tensor]:
        return {name: buffer[:, :, : self.ring] for name, buffer in self._state.items()}

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        bias: torch.Tensor,
        write_index: torch.Tensor,
    ) -> torch.Tensor:
        rows, tokens, _ = x.shape
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias).view(rows, tokens, heads + 2 * kv_heads, dim)
        qkv = qkv.transpose(1, 2)
        qk = qkv[:, : heads + kv_heads]
        # RoPE: x * cos + rotate_half(x) * sin, with rotate_half(x) * sin == roll(x) * [-sin, sin]
        qk = qk * cos + qk.roll(dim // 2, dims=-1) * signed_sin
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :]
        index = write_index[:, None, :, None].expand(rows, kv_heads, tokens, dim)
        keys = self.state("keys", rows)
        values = self.state("values", rows)
        keys.scatter_(2, index, k)
        values.scatter_(2, index, v)
        out = ring_attention(q, keys[:, :, : self.ring], values[:, :, : self.ring], bias, self.scaling)
        return self.o_proj(out)


class TransformerLayer(nn.Module):
    def __init__(self, config: MimiCodecConfig, ring: int) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.self_attn = RingAttention(config, ring)
        self.self_attn_layer_scale = LayerScale(config.hidden_size)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = Mlp(config)
        self.mlp_layer_scale = LayerScale(config.hidden_size)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        bias: torch.Tensor,
        write_index: torch.Tensor,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, signed_sin, bias, write_index)
        x = torch.addcmul(x, self.self_attn_layer_scale.scale, attn)
        return torch.addcmul(x, self.mlp_layer_scale.scale, self.mlp(self.post_attention_layernorm(x)))


class StreamingTransformer(StreamingModule):
    """Stack of layers over [rows, tokens, hidden]; keeps position and ring positions per slot."""

    def __init__(self, config: MimiCodecConfig, tokens_per_step: int) -> None:
        super().__init__()
        self.sliding_window = config.sliding_window
        self.tokens_per_step = tokens_per_step
        self.num_heads = config.num_attention_heads
        self.ring = config.sliding_window + tokens_per_step - 1
        self.layers = nn.ModuleList(
            [TransformerLayer(config, self.ring) for _ in range(config.num_hidden_layers)]
        )
        # A plain attribute, not a buffer: it stays float32 whatever dtype the weights take.
        self.inv_freq = rope_inv_freq(config.rope_theta, config.attention_head_dim)

    def state_specs(self) -> dict[str, StateSpec]:
        return {
            "position": StateSpec((), 0, torch.int64),
            "ring_positions": StateSpec((self.ring + 1,), _EMPTY_POSITION, torch.int64),
        }

    def alloc_state(self, max_slots: int, device: torch.device, dtype: torch.dtype) -> None:
        super().alloc_state(max_slots, device, dtype)
        self.inv_freq = self.inv_freq.to(device)

    def state_buffers(self) -> dict[str, torch.Tensor]:
        return {
            "position": self._state["position"],
            "ring_positions": self._state["ring_positions"][:, : self.ring],
        }

    def forward(self, x: torch.Tensor, exec_mask: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[1]
        if tokens <= self.tokens_per_step:
            return self._step(x, exec_mask)
        chunks = [
            self._step(x[:, i : i + self.tokens_per_step], exec_mask)
            for i in range(0, tokens, self.tokens_per_step)
        ]
        return torch.cat(chunks, dim=1)

    def _step(self, x: torch.Tensor, exec_mask: torch.Tensor) -> torch.Tensor:
        rows, tokens, _ = x.shape
        position = self.state("position", rows)
        ring_positions = self.state("ring_positions", rows)
        query_pos = position[:, None] + torch.arange(tokens, device=x.device)
        freqs = query_pos.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        cos = emb.cos().to(x.dtype)
        sin = freqs.sin()[:, None]
        signed_sin = torch.cat((-sin, sin), dim=-1).to(x.dtype)
        # idle rows write to the spare entry (index ``ring``), which attention never reads
        write_index = torch.where(exec_mask[:, None], query_pos % self.ring, self.ring)
        ring_positions.scatter_(1, write_index, query_pos)
        q, k = query_pos[:, :, None], ring_positions[:, None, : self.ring]
        visible = (k <= q) & (k > q - self.sliding_window)
        bias = torch.where(visible, 0.0, _MASKED).to(x.dtype)[:, None]
        bias = bias.expand(-1, self.num_heads, -1, -1).contiguous()  # once per step, shared by the layers
        for layer in self.layers:
            x = layer(x, cos, signed_sin, bias, write_index)
        commit(position, position + tokens, exec_mask)
        return x
