"""Per-stream state of the streaming code2wav, preallocated for a fixed pool of slots.

Every tensor has the slot as its first dimension, and the whole state is zero for a fresh
stream, so resetting a slot is zeroing its row in place (captured CUDA graphs stay valid).
Keys are module paths of :class:`.model.Code2WavModel`:

- ``frame``: int64 ``[slots]``, frames decoded so far (the RoPE position of the next one);
- ``pre_transformer.layers.{i}.k`` / ``.v``: ``[slots, kv_heads, sliding_window, head_dim]``,
  a ring of keys (after RoPE) and values, the entry of position ``p`` at ``p % sliding_window``;
- a causal conv's path: ``[slots, in_channels, (kernel - 1) * dilation]``, its last inputs;
- a trimmed transposed conv's path: ``[slots, in_channels, kernel / stride - 1]``, its last inputs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .model import Attention, CausalConv, Code2WavModel, TransConv


def allocate_state(model: Code2WavModel, slots: int, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """Zeroed state for ``slots`` streams; ``dtype`` defaults to the model's."""
    dtype = dtype or model.code_embedding.weight.dtype
    state = {"frame": torch.zeros(slots, dtype=torch.int64, device=device)}
    window = model.config.sliding_window
    for name, module in model.named_modules():
        if isinstance(module, Attention):
            shape = (slots, module.num_kv_heads, window, module.head_dim)
            state[name.removesuffix(".self_attn") + ".k"] = torch.zeros(shape, dtype=dtype, device=device)
            state[name.removesuffix(".self_attn") + ".v"] = torch.zeros(shape, dtype=dtype, device=device)
        elif isinstance(module, CausalConv) and module.history:
            shape = (slots, module.conv.in_channels, module.history)
            state[name] = torch.zeros(shape, dtype=dtype, device=device)
        elif isinstance(module, TransConv) and module.lookahead:
            shape = (slots, module.conv.in_channels, module.lookahead)
            state[name] = torch.zeros(shape, dtype=dtype, device=device)
    return state


def reset_slot(state: dict[str, Tensor], slot: int) -> None:
    """Returns one slot to the fresh-stream state, in place."""
    for tensor in state.values():
        tensor[slot].zero_()
