"""Batched one-token decode over a Hugging Face Qwen3-Omni decoder, with a static KV slot pool.

The thinker's text model, the talker's model and the talker's code predictor share one layer
shape (RMSNorm, attention with per-head q/k norms and RoPE, then a dense or MoE MLP).
:class:`SlotDecoder` reads the weights of such a model's layers and runs one decode token for
the first ``B`` slots of its pool in one batched call, gpt-fast style, so that the step has
static shapes and can be captured in a CUDA graph:

* **Rows are slots.** Row ``i`` of a step is slot ``i``; ``B`` is a captured batch bucket that
  covers the highest busy slot. An exec mask ``active [B]`` says which rows decode now; idle
  rows compute garbage that is never kept: their key/value go to a scratch column
  (``max_len``) and their length does not move. So padding never writes into a real slot.
  They run on zero inputs with their attention zeroed, so they are the same whatever their
  slot held before (the MoE routing of idle rows sizes the expert matmuls active rows share).
* **KV read in place.** Attention reads ``keys[:B, :, :attend]`` (a view, no gather copy) for a
  static ``attend`` length bucket that the caller picks to cover every active row, with a
  mask built on the device from the slots' lengths. On CUDA it is one split-window launch
  (``kernels/decode_attention.py``: each row reads only the entries it holds), elsewhere the
  eager chain of matmuls, mask and softmax.
* **Fused norms.** Each residual add and the RMSNorm after it are one launch on CUDA
  (``kernels/rms_norm.py``, bitwise transformers' chain): in a step of a few rows, launches, not
  bytes, set the time.
* **Grouped-query attention without repeating K/V**: queries are viewed as
  ``[B, kv_heads, group, head_dim]`` against the ``[B, kv_heads, attend, head_dim]`` cache.

The cache is allocated once (``[slots, kv_heads, max_len + 1, head_dim]`` per layer) and a slot
is reset by setting its length to zero, so nothing is reallocated while serving and captured
graphs stay valid.

Decode positions: after a prompt, Qwen3-Omni continues with the same position on all three
multimodal RoPE axes (temporal, height, width), so the decode rotation is an ordinary 1D RoPE
at that position; it is computed with the model's own rotary module, exactly as ``generate``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import apply_rotary_pos_emb

from ...kernels.decode_attention import decode_attention
from ...kernels.decode_attention import kernel_applies as decode_attention_applies
from ...kernels.qk_norm_rope import (
    fused_qk_norm_rope,
    kernel_applies,
    qk_norm_rope_to_cache,
    table_from_halves,
    to_cache_applies,
)
from ...kernels.rms_norm import add_rms_norm
from ..graphs import LengthBucketedRunner, length_buckets, upload
from .merged import MergedLayer, merge_layer


def decode_runner(
    step: Callable[[dict[str, torch.Tensor], int], dict[str, torch.Tensor]],
    example: Callable[[int, int], dict[str, torch.Tensor]],
    *,
    batch_buckets: Sequence[int],
    max_len: int,
    graphs: bool,
    pool: object | None,
) -> LengthBucketedRunner:
    """Graphs of a decode step: per batch bucket and attention-length bucket; its outputs are
    views of persistent per-slot buffers."""
    return LengthBucketedRunner(
        step, example, batch_buckets=batch_buckets, length_buckets=length_buckets(max_len),
        enabled=graphs, pool=pool,
    )


def prompt_pieces(length: int, chunk: int) -> list[tuple[int, int]]:
    """The pieces ``(start, count)`` of a ``length``-token prompt read ``chunk`` tokens at a time."""
    return [(start, min(chunk, length - start)) for start in range(0, length, chunk)]


def token_runs(ids: torch.Tensor, token: int) -> list[tuple[int, int]]:
    """The runs ``(start, end)`` of ``token`` in ``ids`` [L] (one per audio or image part: the
    template closes each part's placeholders with an end token)."""
    hits = (ids == token).int()
    edges = torch.diff(hits, prepend=hits.new_zeros(1), append=hits.new_zeros(1)).nonzero().flatten().tolist()
    return list(zip(edges[::2], edges[1::2], strict=True))


def prompt_inputs(
    embeds: torch.Tensor, positions: torch.Tensor, slot: int, bucket: int, start: int | None = None
) -> dict[str, torch.Tensor]:
    """A prompt piece's graph inputs: ``embeds`` [L, H] and ``positions`` [3, 1, L] padded to the
    ``bucket`` length, the slot, the piece's length and, for a piece after the first, where it
    starts in the slot (see :meth:`SlotDecoder.prompt_step`). Positions go in as float32 (exact
    for integers): transformers gives audio prompts float positions and text prompts integer
    ones, and a graph takes one dtype."""
    pad = bucket - embeds.shape[0]
    device = embeds.device
    inputs = {
        "embeds": F.pad(embeds, (0, 0, 0, pad))[None],
        "positions": F.pad(positions[:, 0].float(), (0, pad))[None],
        "slot": upload(torch.tensor([slot]), device),
        "length": upload(torch.tensor([embeds.shape[0]]), device),
    }
    if start is not None:
        inputs["start"] = upload(torch.tensor([start]), device)
    return inputs


def prompt_example(
    batch: int, length: int, hidden: int, dtype: torch.dtype, device: torch.device, chunk: int | None = None
) -> dict[str, torch.Tensor]:
    """Example inputs of a prompt piece with :func:`prompt_inputs`' layout: the first piece of
    ``length`` tokens, or with ``chunk`` a later piece of ``chunk`` tokens (padded) attending
    over ``length`` entries. Capture runs the pass on them, which writes zeros-derived entries into
    slot 0: harmless while no slot is in use (``SpeechPipeline.capture`` needs an idle pipeline)."""
    count = length if chunk is None else chunk
    example = {
        "embeds": torch.zeros((batch, count, hidden), device=device, dtype=dtype),
        "positions": torch.zeros((batch, 3, count), dtype=torch.float32, device=device),
        "slot": torch.zeros(batch, dtype=torch.long, device=device),
        "length": torch.ones(batch, dtype=torch.long, device=device),
    }
    if chunk is not None:
        example["start"] = torch.full((batch,), length - chunk, dtype=torch.long, device=device)
    return example



def _norm_rope(
    attn: nn.Module,
    merged: MergedLayer,
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    table: torch.Tensor | None,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys and values of ``h`` [B, T, hidden] for attention, [B, heads, T, D]: projected
    (one product: :mod:`.merged`), then :func:`_normed_rotated`."""
    q, k, v = merged.project(attn, h, head_dim)
    return _normed_rotated(attn, q, k, v, cos, sin, table)


def _normed_rotated(
    attn: nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    table: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Projected ``q``, ``k``, ``v`` [B, T, heads, D] -> [B, heads, T, D] with each query and key
    head RMSNorm-ed and rotated. On CUDA one fused launch (``kernels/qk_norm_rope.py``, bitwise
    transformers' chain) where it applies (``table``: the packed rotary table, None off CUDA);
    elsewhere transformers' own ``q_norm``/``k_norm`` and ``apply_rotary_pos_emb``."""
    v = v.transpose(1, 2)
    qw, kw = attn.q_norm.weight, attn.k_norm.weight
    if table is not None and kernel_applies(q, k, qw, kw, table):
        eps = attn.q_norm.variance_epsilon
        q, k = fused_qk_norm_rope(q, k, qw, kw, table, eps=eps, interleaved=False)
        return q.transpose(1, 2), k.transpose(1, 2), v
    q, k = apply_rotary_pos_emb(attn.q_norm(q).transpose(1, 2), attn.k_norm(k).transpose(1, 2), cos, sin)
    return q, k, v


def _add_norm(
    norm: nn.Module, x: torch.Tensor, delta: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + delta, norm(x + delta))`` (``delta`` None: ``(x, norm(x))``): a layer's residual add
    and the next RMSNorm, one launch on CUDA (``kernels/rms_norm.py``, bitwise transformers'
    chain), else the module itself."""
    if type(norm).__name__.endswith("RMSNorm") and hasattr(norm, "variance_epsilon"):
        return add_rms_norm(x, delta, norm.weight, norm.variance_epsilon)
    if delta is not None:
        x = x + delta
    return x, norm(x)


#: A step's rotary tables: ``cos``, ``sin`` [B or 1, T, D] and the kernel's packed table (None off
#: CUDA).
Rope = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


@dataclass
class PieceCall:
    """A prompt piece that :meth:`PromptPass.run` asks its driver to run (it yields one and is
    sent the piece's outputs): alone, or in one pass with other prompts' first pieces of the same
    :class:`PromptPass` (:meth:`PromptPass.execute`), so their weights are read once."""

    owner: PromptPass
    embeds: torch.Tensor  # [count, H] the piece
    positions: torch.Tensor  # [3, 1, count]
    slot: int
    per_token: dict[str, torch.Tensor]  # each [n, count, H]
    start: int | None  # where a later piece begins in the slot; None for a first piece

    @property
    def count(self) -> int:
        return int(self.embeds.shape[0])


class PromptPass:
    """A prompt pass read in pieces of ``chunk`` tokens, so that a long prompt never takes a
    whole tick: the first piece of a prompt read from its start through ``first`` (graphs per
    piece-length bucket up to ``chunk``, and per batch of up to ``batch`` prompts read
    together), every other piece through ``later`` (graphs per piece-length bucket and
    attention-length bucket, one prompt at a time): the later pieces of a long prompt, and
    every piece of a prompt read after a prefix already in the slot (a reused prefix: see
    :mod:`.prefix_cache`). ``step(inputs, n)`` runs one piece (``n``: the bucket: the piece's
    length for the first, the attention length for later ones, whose inputs hold ``start``);
    ``example(batch, n, piece)`` makes its example inputs (``piece`` None for a first piece,
    else the later piece's length bucket)."""

    def __init__(
        self,
        step: Callable[[dict[str, torch.Tensor], int], dict[str, torch.Tensor]],
        example: Callable[[int, int, int | None], dict[str, torch.Tensor]],
        *,
        chunk: int,
        max_len: int,
        graphs: bool,
        pool: object | None,
        batch: int = 2,
    ) -> None:
        self.chunk = min(chunk, max_len)
        self.max_len = max_len
        self.batch = batch

        def runner(lengths: list[int], piece: int | None, batches: list[int]) -> LengthBucketedRunner:
            # Outputs live in the shared pool, so they are cloned.
            return LengthBucketedRunner(
                step, lambda batch, n: example(batch, n, piece), batch_buckets=batches,
                length_buckets=lengths, enabled=graphs, pool=pool, clone_outputs=True,
            )

        pieces = length_buckets(self.chunk, smallest=64)
        #: First pieces, per piece-length bucket from 64 tokens to ``chunk``, per batch.
        self.first = runner(pieces, None, list(range(1, batch + 1)))
        #: Later pieces, per piece-length bucket (the same as ``first``), each per
        #: attention-length bucket from ``2 * chunk`` to ``max_len``.
        attend = length_buckets(max_len, smallest=2 * self.chunk)
        self.later = {piece: runner([n for n in attend if n >= piece], piece, [1]) for piece in pieces}

    @property
    def runners(self) -> list[LengthBucketedRunner]:
        return [self.first, *self.later.values()]

    def pieces(self, length: int, start: int = 0) -> int:
        return -(-(length - start) // self.chunk)

    def run(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        slot: int,
        per_token: dict[str, torch.Tensor] | None = None,
        start: int = 0,
    ) -> Generator[PieceCall | None, dict[str, torch.Tensor] | None, dict[str, torch.Tensor]]:
        """Reads the prompt ``embeds`` [L, H] at ``positions`` [3, 1, L] into ``slot`` from
        position ``start`` on (the slot holds the first ``start`` entries already), a piece per
        resumption: it yields each piece as a :class:`PieceCall` (its driver runs it and sends
        back its outputs), and None between pieces (a tick ends). ``per_token`` tensors
        [n, L, H] go in sliced like the prompt. Returns the last piece's outputs, with
        ``accepted`` (when the step keeps a layer's output) joined over the pieces [L - start, H]."""
        length = embeds.shape[0]
        if length > self.max_len:
            raise ValueError(f"prompt of {length} positions exceeds the slot length {self.max_len}")
        if not 0 <= start < length:
            raise ValueError(f"a prompt of {length} positions cannot be read from position {start}")
        kept: list[torch.Tensor] = []
        out: dict[str, torch.Tensor] = {}
        for n, (at, count) in enumerate(prompt_pieces(length - start, self.chunk)):
            if n:
                yield None
            at += start
            piece = slice(at, at + count)
            sliced = {name: value[:, piece] for name, value in (per_token or {}).items()}
            call = PieceCall(self, embeds[piece], positions[..., piece], slot, sliced, at or None)
            got = yield call
            assert got is not None, "a PieceCall is answered with its outputs"
            out = got
            if "accepted" in out:
                kept.append(out["accepted"][0, :count])
        if kept:
            out["accepted"] = torch.cat(kept)
        return out

    def execute(self, calls: Sequence[PieceCall]) -> list[dict[str, torch.Tensor]]:
        """Runs ``calls`` (pieces of this pass, other prompts'), returning each one's outputs
        (leading dimension 1): first pieces in passes of up to ``batch`` prompts, padded to the
        longest one's bucket; later pieces one by one."""
        if any(c.owner is not self for c in calls):
            raise ValueError("a PromptPass runs its own pieces only")
        outs: dict[int, dict[str, torch.Tensor]] = {}
        first = [k for k, c in enumerate(calls) if c.start is None]
        for k, call in enumerate(calls):
            if call.start is not None:
                bucket = self.first.length_for(call.count)
                outs[k] = self.later[bucket](self._inputs(call, bucket), call.start + call.count)
        for group in (first[i : i + self.batch] for i in range(0, len(first), self.batch)):
            bucket = self.first.length_for(max(calls[k].count for k in group))
            parts = [self._inputs(calls[k], bucket) for k in group]
            inputs = {name: torch.cat([p[name] for p in parts]) for name in parts[0]}
            out = self.first(inputs, bucket)
            for row, k in enumerate(group):
                outs[k] = {name: value[row : row + 1] for name, value in out.items()}
        return [outs[k] for k in range(len(calls))]

    @staticmethod
    def _inputs(call: PieceCall, bucket: int) -> dict[str, torch.Tensor]:
        inputs = prompt_inputs(call.embeds, call.positions, call.slot, bucket, call.start)
        for name, value in call.per_token.items():
            inputs[name] = F.pad(value, (0, 0, 0, bucket - call.count))[None]
        return inputs


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
        #: Each layer's q, k, v (and a dense MLP's gate, up) as one product (:mod:`.merged`).
        self.merged = [merge_layer(layer) for layer in self.layers]
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.num_heads = attn.q_proj.out_features // self.head_dim
        self.num_kv_heads = attn.k_proj.out_features // self.head_dim
        self.group = self.num_heads // self.num_kv_heads
        self.scaling = attn.scaling
        self.num_slots = num_slots
        self.max_len = max_len
        # One more column than max_len: idle rows write their key/value there (never attended).
        shape = (num_slots, self.num_kv_heads, max_len + 1, self.head_dim)
        #: Every layer's keys and values in one tensor [2, layers, *shape], so that a slot's
        #: entries move between slots in one copy (a reused prefix: :meth:`copy_prefix`).
        self.cache = torch.zeros((2, len(self.layers), *shape), device=device, dtype=dtype)
        self.keys = [self.cache[0, i] for i in range(len(self.layers))]
        self.values = [self.cache[1, i] for i in range(len(self.layers))]
        self.lengths = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.host_lengths = [0] * num_slots  # the same, on the host: no device sync to read it
        self._rows = torch.arange(num_slots, device=device)
        self._columns = torch.arange(max_len + 1, device=device)
        #: Decode attention through ``kernels/decode_attention.py`` on CUDA (one split-window
        #: launch and its combine for the chain of matmuls, softmax and masks; close to that chain,
        #: not bitwise, as flash attention is); False: the eager chain (a benchmark's baseline).
        self.attention_kernel = True

    def state(self, prefix: str) -> dict[str, torch.Tensor]:
        """Every tensor a step changes, by name (tests compare graph and eager steps on them)."""
        named = {f"{prefix}.lengths": self.lengths}
        for i, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            named[f"{prefix}.keys[{i}]"], named[f"{prefix}.values[{i}]"] = k, v
        return named

    @property
    def kv_bytes(self) -> int:
        return self.cache.numel() * self.cache.element_size()

    def reset(self, slot: int) -> None:
        """Empties ``slot`` (no device sync)."""
        self.host_lengths[slot] = 0
        self.lengths[slot] = 0

    def length(self, slot: int) -> int:
        return self.host_lengths[slot]

    def longest(self, slots: Sequence[int]) -> int:
        return max((self.host_lengths[s] for s in slots), default=0)

    def advance_host(self, slots: Sequence[int]) -> None:
        """Mirrors on the host the length each active row gained in a :meth:`step`."""
        for slot in slots:
            self.host_lengths[slot] += 1

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> Rope:
        cos, sin = self.model.rotary_emb(x, positions)
        return cos, sin, table_from_halves(cos, sin) if cos.is_cuda else None

    @torch.no_grad()
    def shared_rope(self, position: int) -> Rope:
        """The rotary tables of one position for every row of a step (broadcast over the rows),
        for a caller whose rows all stand at the same position (the code predictor's groups): a
        :meth:`step` given them computes none. The same values :meth:`step` computes per row."""
        weight = self.layers[0].input_layernorm.weight
        x = torch.zeros((1, 1, weight.shape[-1]), dtype=weight.dtype, device=weight.device)
        at = torch.full((1, 1), position, dtype=torch.long, device=weight.device)
        return self._rope(x, at.expand(3, 1, 1) if self.multimodal_rope else at)

    def _decode_qkv(
        self, i: int, h: torch.Tensor, rope: Rope, rows: torch.Tensor, write_at: torch.Tensor
    ) -> torch.Tensor:
        """Layer ``i``'s queries [B, heads, 1, D] of a decode step's ``h`` [B, 1, hidden], as
        :func:`_norm_rope` makes them; its keys and values go to entry ``write_at[b]`` of slot
        ``rows[b]``. On CUDA the norms, the rotation and both writes are one launch
        (``kernels/qk_norm_rope.qk_norm_rope_to_cache``, the same bits) where it applies."""
        attn, merged = self.layers[i].self_attn, self.merged[i]
        cos, sin, table = rope
        cache_k, cache_v = self.keys[i], self.values[i]
        q, k, v = merged.project(attn, h, self.head_dim)
        qw, kw = attn.q_norm.weight, attn.k_norm.weight
        if table is not None and to_cache_applies(q, k, v, qw, kw, table, cache_k, cache_v, write_at):
            eps = attn.q_norm.variance_epsilon
            caches = (cache_k, cache_v, write_at)
            q = qk_norm_rope_to_cache(q, k, v, qw, kw, table, *caches, eps=eps, interleaved=False)
            return q.transpose(1, 2)
        q, k, v = _normed_rotated(attn, q, k, v, cos, sin, table)
        cache_k[rows, :, write_at] = k[:, :, 0].to(cache_k.dtype)
        cache_v[rows, :, write_at] = v[:, :, 0].to(cache_v.dtype)
        return q

    @torch.no_grad()
    def step(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        active: torch.Tensor,
        attend: int,
        rope: Rope | None = None,
    ) -> torch.Tensor:
        """One token for each active row of slots ``0..B-1``: ``inputs_embeds`` [B, H] at
        ``positions`` [B], ``active`` [B] bool; attention over the first ``attend`` cache
        entries, which must cover every active row's length + 1 (the caller checks on the host:
        :meth:`longest`). ``rope``: the rotary tables of ``positions`` where every row stands at
        the same one (:meth:`shared_rope`), else computed here. Appends the active rows'
        key/value to their slots and returns the final-norm hidden states [B, H] (idle rows:
        garbage). Never syncs with the host; the host mirror is advanced by
        :meth:`advance_host`."""
        batch = inputs_embeds.shape[0]
        # Idle rows compute on zeros and attend to nothing, so what they compute (and the MoE
        # routing of their garbage, which sizes the grouped expert matmuls that active rows
        # share) never depends on what a slot held before: same active rows, same bits.
        keep = active.view(batch, 1, 1)
        x = torch.where(keep, inputs_embeds.unsqueeze(1), 0)
        pos = (
            positions.view(1, batch, 1).expand(3, batch, 1)
            if self.multimodal_rope
            else positions.view(batch, 1)
        )
        cos, sin, table = rope if rope is not None else self._rope(x, pos)
        lengths = self.lengths[:batch]
        write_at = torch.where(active, lengths, self.max_len)
        rows = self._rows[:batch]
        heads = (batch, self.num_heads, self.head_dim)
        kernel = self.attention_kernel and decode_attention_applies(
            x.new_empty(heads), self.keys[0], self.values[0], lengths
        )
        if kernel:  # entries each row sees: its cache and its new one (idle rows none: zeros out)
            visible = torch.where(active, lengths + 1, 0)
        else:  # the same as a mask [B, 1, 1, attend]
            hidden = torch.finfo(torch.float32).min
            masked = self._columns[:attend].view(1, attend) > write_at.view(batch, 1)
            masked = masked.view(batch, 1, 1, attend)
        pending: torch.Tensor | None = None  # the last MLP's output, added with the next norm
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x, h = _add_norm(layer.input_layernorm, x, pending)
            q = self._decode_qkv(i, h, (cos, sin, table), rows, write_at)
            cache_k, cache_v = self.keys[i], self.values[i]
            if kernel:
                out = decode_attention(q.reshape(heads), cache_k, cache_v, visible, attend, self.scaling)
            else:
                keys = cache_k[:batch, :, :attend]
                values = cache_v[:batch, :, :attend]
                qg = q.reshape(batch, self.num_kv_heads, self.group, self.head_dim).to(keys.dtype)
                scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * self.scaling
                probs = scores.masked_fill(masked, hidden).softmax(dim=-1)
                probs = torch.where(keep.view(batch, 1, 1, 1), probs, 0.0).to(values.dtype)
                out = torch.matmul(probs, values).to(x.dtype)  # [B, kv_heads, group, head_dim]
            attended = self.merged[i].attention_output(attn, out.reshape(batch, 1, -1))
            x, h = _add_norm(layer.post_attention_layernorm, x, attended)
            pending = self.merged[i].mlp(layer.mlp, h)
        lengths.add_(active.long())
        return _add_norm(self.model.norm, x, pending)[1][:, 0]

    @torch.no_grad()
    def prompt_step(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        slot: torch.Tensor,
        length: torch.Tensor,
        *,
        start: torch.Tensor | None = None,
        attend: int = 0,
        keep: int | None = None,
        deepstack: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Prompt pieces through the layers, each into its slot, at a static length bucket ``P``:
        ``embeds`` [B, P, H] (each piece, then padding), ``positions`` [B, 3, P] (multimodal) or
        [B, P], ``slot`` and ``length`` (each piece's tokens) [B] device tensors.

        First pieces (``start`` None) write their keys/values into their slots' first ``P``
        cache entries and attend causally to themselves; ``B`` of them (other prompts) share
        the pass, so the weights are read once for all. A later piece (``B`` = 1; ``start``: a
        1-element device tensor, where it begins) writes them at ``start..start + P - 1`` (the
        scratch column past ``max_len`` for padding beyond it) and attends to the slot's first
        ``attend`` entries, each query to the entries up to its own position: the prompt read so
        far and the piece itself. Entries past the prompt are padding, beyond the slot's length
        and overwritten later; the slot's length is the caller's to set (:meth:`set_length`), so
        this writes nothing a decode step of other slots touches. ``deepstack`` [B, n, P, H] is
        added to the output of layers ``0..n-1`` (Qwen3-Omni's visual features; zeros elsewhere).
        Returns each piece's final-norm hidden state at ``length - 1`` [B, H] and, with
        ``keep = j``, the output of layer ``j - 1`` [B, P, H] (``j = 0``: the embeddings; what
        transformers records as hidden state ``j``)."""
        batch, count = embeds.shape[:2]
        if start is not None and batch != 1:
            raise ValueError(f"a later piece runs alone, got {batch}")
        x = embeds
        pos = positions.transpose(0, 1) if self.multimodal_rope else positions.reshape(batch, count)
        cos, sin, table = self._rope(x, pos)
        kept = x if keep == 0 else None
        gqa = self.num_kv_heads != self.num_heads
        if start is not None:
            at = start + self._columns[:count]  # [P] the piece's positions in the slot
            write_at = at.clamp_max(self.max_len)
            # [1, 1, P, attend]: each query sees the entries up to its own position.
            visible = (self._columns[:attend].view(1, attend) <= at.view(count, 1)).view(1, 1, count, attend)
        pending: torch.Tensor | None = None  # the last MLP's output, added with the next norm
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x, h = _add_norm(layer.input_layernorm, x, pending)
            q, k, v = _norm_rope(attn, self.merged[i], h, cos, sin, table, self.head_dim)
            cache_k, cache_v = self.keys[i], self.values[i]
            if start is None:
                cache_k[:, :, :count].index_copy_(0, slot, k.to(cache_k.dtype))
                cache_v[:, :, :count].index_copy_(0, slot, v.to(cache_v.dtype))
                out = F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=self.scaling, enable_gqa=gqa
                )
            else:
                cache_k[slot, :, write_at] = k[0].transpose(0, 1).to(cache_k.dtype)
                cache_v[slot, :, write_at] = v[0].transpose(0, 1).to(cache_v.dtype)
                keys = cache_k[:, :, :attend].index_select(0, slot).to(q.dtype)
                values = cache_v[:, :, :attend].index_select(0, slot).to(q.dtype)
                out = F.scaled_dot_product_attention(
                    q, keys, values, attn_mask=visible, scale=self.scaling, enable_gqa=gqa
                )
            attended = attn.o_proj(out.transpose(1, 2).reshape(batch, count, -1))
            x, h = _add_norm(layer.post_attention_layernorm, x, attended)
            pending = self.merged[i].mlp(layer.mlp, h)
            visual = deepstack is not None and i < deepstack.shape[1]
            if keep == i + 1 or visual:
                x, pending = x + pending, None
            if keep == i + 1:
                kept = x
            if visual:
                x = x + deepstack[:, i].to(x.dtype)
        # Only each piece's last position is read: its row of the sum, then the final norm.
        rows = torch.arange(batch, device=x.device)
        last = x[rows, length - 1]
        if pending is not None:
            pending = pending[rows, length - 1]
        return _add_norm(self.model.norm, last, pending)[1], kept

    def copy_prefix(self, source: int, target: int, length: int) -> None:
        """Copies the first ``length`` cache entries of slot ``source`` into slot ``target`` (a
        reused prompt prefix; no device sync). Sets no length: the prefill that reads the rest
        of the prompt into ``target`` ends with :meth:`set_length`."""
        if length > self.max_len:
            raise ValueError(f"a prefix of {length} entries exceeds the slot length {self.max_len}")
        if source == target or length <= 0:
            return
        self.cache[:, :, target, :, :length].copy_(self.cache[:, :, source, :, :length])

    def move(self, source: int, target: int, *, swap: bool = False) -> None:
        """Slot ``target`` takes slot ``source``'s entries and length (the whole row: a step's
        cache, as the code predictor's, may run ahead of the host's count); ``source`` is left
        empty, or with ``swap`` holding ``target``'s entries (a prefix kept there). No device
        sync."""
        if source == target:
            return
        kept = self.cache[:, :, target].clone() if swap else None
        self.cache[:, :, target].copy_(self.cache[:, :, source])
        if kept is not None:
            self.cache[:, :, source].copy_(kept)
        self.lengths[target] = self.lengths[source]
        self.host_lengths[target] = self.host_lengths[source]
        self.reset(source)

    def set_length(self, slot: int, length: int) -> None:
        """After :meth:`prompt_step`: the slot holds ``length`` entries (host and device)."""
        if length > self.max_len:
            raise ValueError(f"prompt of {length} tokens exceeds the slot length {self.max_len}")
        self.lengths[slot] = length
        self.host_lengths[slot] = length
