"""Batched one-token decode over a Hugging Face Qwen3-Omni decoder, with a static KV slot pool.

The thinker's text model and the talker's model share one layer shape (RMSNorm, attention with
per-head q/k norms and multimodal RoPE, then a dense or MoE MLP). :class:`SlotDecoder` reads the
weights of such a model's layers and runs one decode token for any set of slots in one batched
call: each row has its own cache length and its own position. The cache is allocated once
(``[slots, kv_heads, max_len, head_dim]`` per layer) and a slot is reset by setting its length
to zero, so nothing is reallocated while serving.

The talker's code predictor has the same layer shape with a plain 1D RoPE
(``multimodal_rope=False``): it runs through this class too, one slot per request, reset for
every frame.

Decode positions: after a prompt, Qwen3-Omni continues with the same position on all three
multimodal RoPE axes (temporal, height, width), so the decode rotation is an ordinary 1D RoPE
at that position; it is computed with the model's own rotary module, exactly as ``generate``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import apply_rotary_pos_emb


class SlotDecoder:
    """Per-slot KV state plus a batched decode step over ``layers`` of an HF decoder model."""

    def __init__(
        self,
        model: nn.Module,
        *,
        num_slots: int,
        max_len: int,
        device: torch.device,
        dtype: torch.dtype,
        multimodal_rope: bool = True,
    ) -> None:
        self.model = model
        self.layers = list(model.layers)
        self.multimodal_rope = multimodal_rope
        for i, layer in enumerate(self.layers):
            if getattr(layer.self_attn, "sliding_window", None):
                raise ValueError(
                    f"layer {i} uses sliding-window attention, which SlotDecoder does not implement"
                )
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.num_heads = attn.q_proj.out_features // self.head_dim
        self.num_kv_heads = attn.k_proj.out_features // self.head_dim
        self.scaling = attn.scaling
        self.max_len = max_len
        shape = (num_slots, self.num_kv_heads, max_len, self.head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in self.layers]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in self.layers]
        self.lengths = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.host_lengths = [0] * num_slots  # the same, on the host: no device sync to read it

    def reset(self, slots: int | Sequence[int], index: torch.Tensor | None = None) -> None:
        """Empties ``slots`` (``index``: the same slots as a device tensor, when the caller has
        one; then no index is copied to the device, so nothing syncs with the host)."""
        for slot in [slots] if isinstance(slots, int) else slots:
            self.host_lengths[slot] = 0
        if index is not None:
            self.lengths.index_fill_(0, index, 0)
        else:
            self.lengths[slots if isinstance(slots, int) else list(slots)] = 0

    def length(self, slot: int) -> int:
        return self.host_lengths[slot]

    def load(self, slot: int, cache: object) -> None:
        """Copies a single-row HF cache (``DynamicCache`` after a prefill) into ``slot``."""
        layers = cache.layers  # type: ignore[attr-defined]
        n = layers[0].keys.shape[-2]
        if n > self.max_len:
            raise ValueError(f"prompt of {n} tokens exceeds the slot length {self.max_len}")
        for i, layer in enumerate(layers):
            self.keys[i][slot, :, :n] = layer.keys[0]
            self.values[i][slot, :, :n] = layer.values[0]
        self.lengths[slot] = n
        self.host_lengths[slot] = n

    @torch.no_grad()
    def step(
        self,
        slots: Sequence[int],
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One token for each row: ``inputs_embeds`` [B, H] at ``positions`` [B] in ``slots`` [B]
        (``index``: the same slots as a device tensor, when the caller has one).

        Appends each row's key/value to its slot and returns the final-norm hidden states [B, H].
        """
        batch = inputs_embeds.shape[0]
        longest = max(self.host_lengths[s] for s in slots)
        if longest >= self.max_len:
            raise RuntimeError("a slot's KV cache is full")
        if index is None:
            index = torch.tensor(list(slots), device=inputs_embeds.device)
        x = inputs_embeds.unsqueeze(1)
        pos = (
            positions.view(1, batch, 1).expand(3, batch, 1)
            if self.multimodal_rope
            else positions.view(batch, 1)
        )
        cos, sin = self.model.rotary_emb(x, pos)
        write_at = self.lengths[index]
        total = longest + 1
        visible = torch.arange(total, device=x.device).view(1, 1, 1, total) <= write_at.view(batch, 1, 1, 1)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_norm(attn.q_proj(h).view(batch, 1, -1, self.head_dim)).transpose(1, 2)
            k = attn.k_norm(attn.k_proj(h).view(batch, 1, -1, self.head_dim)).transpose(1, 2)
            v = attn.v_proj(h).view(batch, 1, -1, self.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            self.keys[i][index, :, write_at] = k[:, :, 0].to(self.keys[i].dtype)
            self.values[i][index, :, write_at] = v[:, :, 0].to(self.values[i].dtype)
            keys = self.keys[i][index, :, :total]
            values = self.values[i][index, :, :total]
            out = F.scaled_dot_product_attention(
                q,
                keys,
                values,
                attn_mask=visible,
                scale=self.scaling,
                enable_gqa=self.num_kv_heads != self.num_heads,
            )
            x = x + attn.o_proj(out.transpose(1, 2).reshape(batch, 1, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        self.lengths[index] = write_at + 1
        for slot in slots:
            self.host_lengths[slot] += 1
        return self.model.norm(x)[:, 0]
