"""One streaming code2wav step for a whole pool of streams: a pure tensor function.

``code2wav_step(model, state, codes, exec_mask)`` decodes one frame of codes per row and
returns ``[rows, samples_per_frame]`` samples; it writes the new per-stream state in place
into ``state`` (tensors from :func:`.state.allocate_state`), only on rows where ``exec_mask``
is true. It has no Python branching on tensor values and no host synchronisation, so it can
be captured in a CUDA graph together with its static ``state`` and input tensors.

Exactness. Every operation mirrors transformers' ``Qwen3OmniMoeCode2Wav`` on the same window
of inputs, so a stream decoded frame by frame equals the offline decode up to float rounding
(reduction orders differ, the values reduced do not):

- transformer: one token per step, K/V kept after RoPE in a ring of ``sliding_window``
  entries per layer (a query at position ``p`` sees keys ``p - W + 1 .. p``, as in
  transformers' sliding-window mask);
- causal convolutions: the last ``(kernel - 1) * dilation`` inputs are kept;
- trimmed transposed convolutions (kernel ``m * stride``): the last ``m - 1`` inputs are kept;
  each step emits the output blocks whose inputs are all known, so the output of every such
  convolution lags its input (see :class:`.model.StreamGeometry`);
- positions before the stream start (the lagged part of a stream's first step) are zeroed
  where they enter a convolution, which is what transformers' zero padding sees there. The
  samples at those positions in the first step's output are not part of the stream: the
  caller drops the first ``model.held_back`` samples of a stream (see ``streamer.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ...kernels.rms_norm import add_rms_norm
from ..streaming import commit
from .model import (
    CausalConv,
    Code2WavModel,
    ConvNeXtBlock,
    DecoderBlock,
    RMSNorm,
    SnakeBeta,
    StreamGeometry,
    TransConv,
    Transformer,
)

State = dict[str, Tensor]


def _started(frame: Tensor, geometry: StreamGeometry, offsets: Tensor) -> Tensor | None:
    """``[rows, 1, per_frame]``: which positions of this step are at or after the stream start
    (``offsets``: ``0 .. n - 1`` for some ``n >= per_frame``)."""
    if geometry.delay == 0:
        return None
    positions = frame[:, None] * geometry.per_frame - geometry.delay + offsets[: geometry.per_frame]
    return (positions >= 0)[:, None, :]


def _zero_before_start(x: Tensor, started: Tensor | None) -> Tensor:
    return x if started is None else torch.where(started, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _snake(act: SnakeBeta, x: Tensor) -> Tensor:
    return x + act.inv_beta * torch.pow(torch.sin(x * act.exp_alpha), 2)


def _causal_conv(conv: CausalConv, x: Tensor, history: Tensor | None, exec_mask: Tensor) -> Tensor:
    if conv.history:
        x = torch.cat([history, x], dim=-1)
        commit(history, x[..., x.shape[-1] - conv.history :], exec_mask)
    return F.conv1d(x, conv.conv.weight, conv.conv.bias, dilation=conv.dilation, groups=conv.groups)


def _trans_conv(up: TransConv, x: Tensor, previous: Tensor | None, exec_mask: Tensor) -> Tensor:
    new = x.shape[-1]
    if up.lookahead:
        x = torch.cat([previous, x], dim=-1)
        commit(previous, x[..., x.shape[-1] - up.lookahead :], exec_mask)
    y = F.conv_transpose1d(x, up.conv.weight, up.conv.bias, stride=up.stride)
    start = up.lookahead * up.stride
    return y[..., start : start + new * up.stride]


def _convnext(block: ConvNeXtBlock, x: Tensor, history: Tensor, exec_mask: Tensor) -> Tensor:
    h = _causal_conv(block.dwconv, x, history, exec_mask).permute(0, 2, 1)
    h = block.pwconv2(F.gelu(block.pwconv1(block.norm(h))))
    h = block.gamma * h
    return x + h.permute(0, 2, 1)


def _add_norm(norm: RMSNorm, x: Tensor, delta: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(x + delta, norm(x + delta))`` (``delta`` None: ``(x, norm(x))``): transformers' residual
    add and RMSNorm, one launch on CUDA (``kernels/rms_norm.py``, the eager chain's bits)."""
    return add_rms_norm(x, delta, norm.weight, norm.eps)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _repeat_kv(x: Tensor, groups: int) -> Tensor:
    """``[rows, kv_heads, n, d]`` -> ``[rows, kv_heads * groups, n, d]``, head ``h`` reading
    KV head ``h // groups`` (an expand, no host sync)."""
    if groups == 1:
        return x
    rows, heads, n, d = x.shape
    return x[:, :, None].expand(rows, heads, groups, n, d).reshape(rows, heads * groups, n, d)


def _transformer(t: Transformer, x: Tensor, frame: Tensor, state: State, exec_mask: Tensor) -> Tensor:
    """``x``: ``[rows, 1, hidden]`` (one token per stream at position ``frame``)."""
    rows = x.shape[0]
    window = t.sliding_window
    freqs = frame[:, None, None].float() * t.inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos().to(x.dtype)[:, None]  # [rows, 1, 1, head_dim]
    sin = emb.sin().to(x.dtype)[:, None]
    ring = t.ring_index
    write = ((ring == (frame % window)[:, None]) & exec_mask[:, None])[:, None, :, None]
    visible = (ring <= frame[:, None])[:, None, None, :]  # every ring entry once p >= W - 1

    pending: Tensor | None = None  # the last MLP's scaled output, added with the next norm
    for i, layer in enumerate(t.layers):
        attn = layer.self_attn
        x, h = _add_norm(layer.input_layernorm, x, pending)
        q = attn.q_proj(h).view(rows, 1, attn.num_heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(rows, 1, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(h).view(rows, 1, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        keys, values = state[f"pre_transformer.layers.{i}.k"], state[f"pre_transformer.layers.{i}.v"]
        keys.copy_(torch.where(write, k, keys))
        values.copy_(torch.where(write, v, values))
        groups = attn.num_heads // attn.num_kv_heads
        scores = torch.matmul(q, _repeat_kv(keys, groups).transpose(2, 3)) * attn.scaling
        scores = torch.where(visible, scores, float("-inf"))
        weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(weights, _repeat_kv(values, groups))
        out = attn.o_proj(out.transpose(1, 2).reshape(rows, 1, -1))
        x, h = _add_norm(layer.post_attention_layernorm, x, layer.self_attn_layer_scale.scale * out)
        h = layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(h)) * layer.mlp.up_proj(h))
        pending = layer.mlp_layer_scale.scale * h
    return _add_norm(t.norm, x, pending)[1]


def _decoder_block(
    index: int, block: DecoderBlock, x: Tensor, started_in: Tensor | None, started_out: Tensor | None,
    state: State, exec_mask: Tensor,
) -> Tensor:
    """``started_in`` / ``started_out``: :func:`_started` at the block's input / output geometry."""
    act, up, *units = block.block
    h = _zero_before_start(_snake(act, x), started_in)
    x = _trans_conv(up, h, state.get(f"decoder.{index}.block.1"), exec_mask)
    for u, unit in enumerate(units, start=2):
        h = _zero_before_start(_snake(unit.act1, x), started_out)
        h = _causal_conv(unit.conv1, h, state[f"decoder.{index}.block.{u}.conv1"], exec_mask)
        h = _causal_conv(unit.conv2, _snake(unit.act2, h), None, exec_mask)
        x = h + x
    return x


def code2wav_step(model: Code2WavModel, state: State, codes: Tensor, exec_mask: Tensor) -> Tensor:
    """Decodes one frame per row: ``codes`` ``[rows, num_quantizers]`` (int64, in range),
    ``exec_mask`` ``[rows]`` bool. Returns ``[rows, samples_per_frame]`` in the model dtype,
    clamped to [-1, 1]; rows whose ``exec_mask`` is false return junk and keep their state."""
    frame = state["frame"]
    x = model.code_embedding(codes + model.code_offset).mean(1)[:, None, :]
    x = _transformer(model.pre_transformer, x, frame, state, exec_mask).permute(0, 2, 1)
    for j, (up, convnext) in enumerate(model.upsample):
        x = _trans_conv(up, x, None, exec_mask)
        x = _convnext(convnext, x, state[f"upsample.{j}.1.dwconv"], exec_mask)

    started = [_started(frame, geometry, model.sample_offsets) for geometry in model.block_geometry]
    first, *blocks, act, last = model.decoder
    x = _causal_conv(first, x, state["decoder.0"], exec_mask)
    for i, block in enumerate(blocks, start=1):
        x = _decoder_block(i, block, x, started[i - 1], started[i], state, exec_mask)
    x = _zero_before_start(_snake(act, x), started[-1])
    wav = _causal_conv(last, x, state[f"decoder.{len(model.decoder) - 1}"], exec_mask)
    frame.add_(exec_mask.to(frame.dtype))
    return wav.clamp(min=-1, max=1)[:, 0]
