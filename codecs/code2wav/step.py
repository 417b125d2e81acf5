"""One streaming code2wav step for a whole pool of streams: a pure tensor function.

``code2wav_step(model, state, codes, counts)`` decodes up to ``steps`` frames of codes per row
(``codes`` ``[rows, steps, num_quantizers]``; row ``r`` decodes its first ``counts[r]``, 0 to
``steps``) and returns ``[rows, steps * samples_per_frame]`` samples, of which the first
``counts[r] * samples_per_frame`` of each row are its stream's; it writes the new per-stream
state in place into ``state`` (tensors from :func:`.state.allocate_state`): as of the end of
each row's decoded frames, unchanged bit for bit on rows that decode none. It has no Python
branching on tensor values and no host synchronisation, so it can be captured in a CUDA graph
together with its static ``state`` and input tensors (one graph per ``steps``).

Why several frames a step: the step is a few hundred small kernels whatever it decodes, so on a
GPU its time is their launches; a stream's audio goes out in chunks of several frames anyway
(``stages/speech/code2wav.py``), and decoding a chunk in one step costs about what one frame
does. A row's frames past its ``counts`` are padding: every operation is causal along time (the
transformer's queries see no later key, the convolutions no later input), so they change none of
the row's decoded samples, and the state is taken where the decoded frames end.

Exactness. Every operation mirrors transformers' ``Qwen3OmniMoeCode2Wav`` on the same window
of inputs, so a stream decoded frame by frame equals the offline decode up to float rounding
(reduction orders differ, the values reduced do not):

- transformer: ``steps`` tokens per row, K/V kept after RoPE in a ring of ``sliding_window``
  entries per layer (a query at position ``p`` sees keys ``p - W + 1 .. p``, as in
  transformers' sliding-window mask: those of the ring and this step's own);
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
    """``[rows, 1, n]``: which of this step's ``n`` positions at ``geometry`` are at or after the
    stream start (``offsets``: ``0 .. n - 1``, ``n`` a multiple of ``per_frame``)."""
    if geometry.delay == 0:
        return None
    positions = frame[:, None] * geometry.per_frame - geometry.delay + offsets
    return (positions >= 0)[:, None, :]


def _zero_before_start(x: Tensor, started: Tensor | None) -> Tensor:
    return x if started is None else torch.where(started, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _snake(act: SnakeBeta, x: Tensor) -> Tensor:
    return x + act.inv_beta * torch.pow(torch.sin(x * act.exp_alpha), 2)


def _decoded_tail(x: Tensor, counts: Tensor, steps: int, keep: int) -> Tensor:
    """``x``: ``[rows, channels, keep + steps * per_frame]``, a convolution's kept inputs and then
    this step's. Per row, the ``keep`` inputs that end where its ``counts`` decoded frames end: the
    state its next step needs (a row that decodes none gets its kept inputs back, bit for bit)."""
    per_frame = (x.shape[-1] - keep) // steps
    index = (counts * per_frame)[:, None, None] + torch.arange(keep, device=x.device)
    return x.gather(2, index.expand(-1, x.shape[1], -1))


def _causal_conv(conv: CausalConv, x: Tensor, history: Tensor | None, counts: Tensor, steps: int) -> Tensor:
    if conv.history:
        x = torch.cat([history, x], dim=-1)
        history.copy_(_decoded_tail(x, counts, steps, conv.history))
    return F.conv1d(x, conv.conv.weight, conv.conv.bias, dilation=conv.dilation, groups=conv.groups)


def _trans_conv(up: TransConv, x: Tensor, previous: Tensor | None, counts: Tensor, steps: int) -> Tensor:
    new = x.shape[-1]
    if up.lookahead:
        x = torch.cat([previous, x], dim=-1)
        previous.copy_(_decoded_tail(x, counts, steps, up.lookahead))
    y = F.conv_transpose1d(x, up.conv.weight, up.conv.bias, stride=up.stride)
    start = up.lookahead * up.stride
    return y[..., start : start + new * up.stride]


def _convnext(block: ConvNeXtBlock, x: Tensor, history: Tensor, counts: Tensor, steps: int) -> Tensor:
    h = _causal_conv(block.dwconv, x, history, counts, steps).permute(0, 2, 1)
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


def _transformer(t: Transformer, x: Tensor, frame: Tensor, counts: Tensor, state: State) -> Tensor:
    """``x``: ``[rows, steps, hidden]``, the tokens of positions ``frame .. frame + steps - 1``.

    Each layer attends over its ring (positions ``frame - W .. frame - 1``, entry ``p % W``) and
    this step's keys, then writes into the ring the keys of the row's decoded positions (the last
    one of each ring entry, when ``steps`` passes ``W``)."""
    rows, steps, _ = x.shape
    window = t.sliding_window
    offsets = torch.arange(steps, device=x.device)
    positions = frame[:, None] + offsets  # [rows, steps]
    freqs = positions[..., None].float() * t.inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos().to(x.dtype)[:, None]  # [rows, 1, steps, head_dim]
    sin = emb.sin().to(x.dtype)[:, None]
    # Ring entry s holds position frame - W + ((s - frame) mod W) (negative: never written).
    since = torch.remainder(t.ring_index[None, :] - frame[:, None], window)  # [rows, W]
    held = frame[:, None] - window + since
    ring_visible = (held[:, None, :] >= 0) & (held[:, None, :] > positions[:, :, None] - window)
    later = offsets[None, :] - offsets[:, None]  # [steps (query), steps (key)]: key - query
    own_visible = (later <= 0) & (later > -window)
    visible = torch.cat((ring_visible, own_visible.expand(rows, -1, -1)), dim=-1)[:, None]
    # This step's writes: entry s takes key ``last`` (the latest decoded position ``= s`` mod W).
    left = counts[:, None] - 1 - since
    write = (left >= 0)[:, None, :, None]  # [rows, 1, W, 1]
    last = (since + window * (left.clamp(min=0) // window)).clamp(max=steps - 1)[:, None, :, None]

    pending: Tensor | None = None  # the last MLP's scaled output, added with the next norm
    for i, layer in enumerate(t.layers):
        attn = layer.self_attn
        x, h = _add_norm(layer.input_layernorm, x, pending)
        q = attn.q_proj(h).view(rows, steps, attn.num_heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(rows, steps, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(h).view(rows, steps, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        keys, values = state[f"pre_transformer.layers.{i}.k"], state[f"pre_transformer.layers.{i}.v"]
        groups = attn.num_heads // attn.num_kv_heads
        all_keys = torch.cat((keys, k), dim=2)
        all_values = torch.cat((values, v), dim=2)
        scores = torch.matmul(q, _repeat_kv(all_keys, groups).transpose(2, 3)) * attn.scaling
        scores = torch.where(visible, scores, float("-inf"))
        weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(weights, _repeat_kv(all_values, groups))
        index = last.expand(-1, attn.num_kv_heads, -1, attn.head_dim)
        keys.copy_(torch.where(write, k.gather(2, index), keys))
        values.copy_(torch.where(write, v.gather(2, index), values))
        out = attn.o_proj(out.transpose(1, 2).reshape(rows, steps, -1))
        x, h = _add_norm(layer.post_attention_layernorm, x, layer.self_attn_layer_scale.scale * out)
        h = layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(h)) * layer.mlp.up_proj(h))
        pending = layer.mlp_layer_scale.scale * h
    return _add_norm(t.norm, x, pending)[1]


def _decoder_block(
    index: int, block: DecoderBlock, x: Tensor, started_in: Tensor | None, started_out: Tensor | None,
    state: State, counts: Tensor, steps: int,
) -> Tensor:
    """``started_in`` / ``started_out``: :func:`_started` at the block's input / output geometry."""
    act, up, *units = block.block
    h = _zero_before_start(_snake(act, x), started_in)
    x = _trans_conv(up, h, state.get(f"decoder.{index}.block.1"), counts, steps)
    for u, unit in enumerate(units, start=2):
        h = _zero_before_start(_snake(unit.act1, x), started_out)
        h = _causal_conv(unit.conv1, h, state[f"decoder.{index}.block.{u}.conv1"], counts, steps)
        h = _causal_conv(unit.conv2, _snake(unit.act2, h), None, counts, steps)
        x = h + x
    return x


def code2wav_step(model: Code2WavModel, state: State, codes: Tensor, counts: Tensor) -> Tensor:
    """Decodes up to ``steps`` frames per row: ``codes`` ``[rows, steps, num_quantizers]`` (int64,
    in range), ``counts`` ``[rows]`` (int64, ``0 .. steps``: the frames of each row to decode).
    Returns ``[rows, steps * samples_per_frame]`` in the model dtype, clamped to [-1, 1]: row
    ``r``'s first ``counts[r] * samples_per_frame`` are its stream's next samples, the rest junk;
    rows with ``counts`` 0 keep their state."""
    frame = state["frame"]
    steps = codes.shape[1]
    with torch.no_grad():  # state is not differentiable
        x = model.code_embedding(codes + model.code_offset).mean(2)
        x = _transformer(model.pre_transformer, x, frame, counts, state).permute(0, 2, 1)
        for j, (up, convnext) in enumerate(model.upsample):
            x = _trans_conv(up, x, None, counts, steps)
            x = _convnext(convnext, x, state[f"upsample.{j}.1.dwconv"], counts, steps)

        offsets = torch.arange(steps * model.samples_per_frame, device=codes.device)
        started = [_started(frame, g, offsets[: steps * g.per_frame]) for g in model.block_geometry]
        first, *blocks, act, last = model.decoder
        x = _causal_conv(first, x, state["decoder.0"], counts, steps)
        for i, block in enumerate(blocks, start=1):
            x = _decoder_block(i, block, x, started[i - 1], started[i], state, counts, steps)
        x = _zero_before_start(_snake(act, x), started[-1])
        wav = _causal_conv(last, x, state[f"decoder.{len(model.decoder) - 1}"], counts, steps)
        frame.add_(counts.to(frame.dtype))
    return wav.clamp(min=-1, max=1)[:, 0]
