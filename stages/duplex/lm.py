"""The Moshi LM as a batched, slot-pooled streaming step: one 80 ms frame per slot per call.

Architecture (transformers' ``MoshiForConditionalGeneration``, whose checkpoint layout
:mod:`.weights` holds): a temporal transformer over frames and a depth transformer over the
``K`` codebooks of one frame. Exactly as the reference computes it:

* **Temporal input at position p**: ``embed_tokens[0..K-1]`` of the model's delayed codes at
  ``p``, then ``embed_tokens[K..2K-1]`` of the user's, summed in codebook order, plus the text
  embedding of ``text[p]``. RoPE at the absolute position ``p``; RMSNorm in float32; gated MLP
  (``act(fc1[:half]) * fc1[half:]``). The final-norm hidden state ``h[p]`` gives the text logits
  (``lm_head``) of ``text[p+1]``.
* **Depth at position p**: ``K`` sub-steps, causal over the sub-steps, no RoPE, per-codebook
  weights (sub-step ``k`` uses matrix ``k`` of every flexible linear). Sub-step 0 reads
  ``text_embed_tokens(text[p+1]) + input_projections[0](h[p])``, sub-step ``k`` reads
  ``embed_tokens[k-1](code k-1) + input_projections[k](h[p])``; ``lm_heads[k]`` gives code
  ``k``. The ``K`` codes are the model's delayed codes at ``p + 1``.
* **Delays** (``get_unconditional_inputs`` + ``build_delay_pattern_mask``): position 0 is the
  unconditional input (text id ``vocab_size``, every audio code ``audio_vocab_size``). In both
  streams codebook 0 (semantic) is not delayed and codebooks ``1..K-1`` (acoustic) are delayed
  by one position, ``audio_vocab_size`` (BOS) where nothing is there yet. So the delayed codes at
  ``p`` hold frame ``p``'s semantic code and frame ``p - 1``'s acoustic codes, frame 0 being the
  unconditional frame.

**Where the user's frames enter.** Step ``n`` of a slot (``n = frames(slot)`` before the call)
runs temporal position ``n``. The user's frame given at step ``n >= 1`` is the user frame of
position ``n``: its semantic code enters position ``n``, its acoustic codes position ``n + 1``.
In transformers' terms, the user codes of step ``n`` are ``user_audio_codes[..., n - 1]`` of a
prompt that ``generate`` prefixes with the unconditional frame. Position 0 is the unconditional
frame whatever the user sent, so the frame given at step 0 is dropped (Kyutai's ``LMGen`` drops
it too: the first frame of each stream is overwritten by the initial token). Step ``n`` samples
``text[n+1]`` and the delayed model codes at ``n + 1``: the semantic code of model frame
``n + 1`` and the acoustic codes of frame ``n``; it returns text ``text[n+1]`` and the whole
model frame ``n`` (semantic from step ``n - 1``, acoustic from this step). Frame 0 is the
unconditional frame, so step 0 has no audio (``audio_ready`` False) and the acoustic codes it
samples are replaced by BOS in the next input, as ``generate``'s delay mask does.

**Slots.** Rows are slots ``0..B-1`` with an exec mask ``active [B]``; inactive rows compute
garbage that is never kept: their keys/values go to a scratch column past the window, their
delay buffers, position and draw counters stay. Per slot on the device: the temporal KV cache
``[slots, kv_heads, window + 1, head_dim]`` per layer, a ring over the last ``max_frames``
positions (position ``p`` in column ``p % max_frames``; RoPE keeps the absolute position; a
query attends to the ``min(p + 1, max_frames)`` entries of its window, as Kyutai's streaming
does), the delay buffers (``text[p]``, the model's delayed codes at ``p``, the user's acoustic
codes of frame ``p - 1``), the position and the sampling rows. ``start`` resets them in place.

**Static shapes.** The step (temporal transformer, text sampling, the whole depth loop with its
sampling, the state updates) has no host sync and no dynamic shape. Attention
(``kernels/decode_attention.py``) takes an attention-length bucket ``attend`` covering every
active row and each row's valid length ``min(p + 1, max_frames)`` as a device tensor: on CUDA a
split-window Triton kernel that reads only a row's valid entries, elsewhere (or with
``attention_kernel=False``) the masked torch reference over the first ``attend`` columns. With
graphs on CUDA it is one CUDA graph per (batch bucket, attention bucket)
(:class:`~..graphs.LengthBucketedRunner`). Eager steps run at the same padded buckets, so graph
and eager compute the same thing.

**KV storage** (``kv_dtype``). ``auto``: the model's dtype, exact (what transformers computes).
``fp8``: e4m3 values with one fp32 scale per stored vector (slot, layer, head, position: the
vector's peak maps to 448), written once when the position is written and never revisited, as a
ring that appends one position per step needs; 0.52x the bytes of bf16 (132 B per 128-dim
vector instead of 256 B). The kernel widens fp8 to the query's dtype in registers and applies
the scales to the scores and the probabilities. The error it adds is measured in
``tests/kernels/test_decode_attention.py`` and ``tests/duplex/test_duplex_lm.py`` (docs/duplex.md).

**Sampling.** Per row: text temperature/top-k and audio temperature/top-k (0: greedy, exactly
``argmax``), counter-based Philox draws keyed by the slot's seed (:mod:`~..sampling`,
:mod:`~..draws`; the text on one stream, the ``K`` codes of a frame on consecutive counters of
another), so a seed gives the same stream whatever the batch or the slot.

**Batch invariance on CPU.** MKL's GEMM takes another kernel below about 12 rows, which moves
the last bits of a row with the batch size; CPU steps therefore run at least 16 rows (padding
rows idle), so a slot's stream is bitwise the same alone and in a batch.

**Text padding.** Moshi's text stream is mostly padding: Kyutai's tokenizer uses id 3 as padding
(``existing_text_padding_id``) and id 0 as end of padding (a word follows). They are read from
the config's extra keys ``existing_text_padding_id`` and ``existing_text_end_padding_id`` when
present, else these defaults, and exposed as ``text_pad_ids``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import MoshiConfig
from transformers.activations import ACT2FN

from ...kernels.decode_attention import FP8, decode_attention, quantize_kv
from ...kernels.rms_norm import add_rms_norm
from ..draws import DUPLEX_AUDIO_STREAM, DUPLEX_TEXT_STREAM, SlotSampling, fresh_seed
from ..graphs import LengthBucketedRunner, batch_buckets, length_buckets
from .weights import MoshiWeights, check_config

#: Kyutai's text padding id and end-of-padding id (used when the config names none).
TEXT_PAD_ID, TEXT_END_PAD_ID = 3, 0
#: Fewest rows a CPU step runs (see the module doc: batch invariance on CPU).
CPU_MIN_ROWS = 16
#: Temporal KV storage: ``auto`` the model's dtype (exact), ``fp8`` e4m3 with one fp32 scale per
#: stored vector (half the memory; see the module doc).
KV_DTYPES = ("auto", "fp8")


@dataclass(frozen=True)
class DuplexSampling:
    text_temperature: float = 0.7  # 0: greedy
    text_top_k: int = 25
    audio_temperature: float = 0.8  # 0: greedy
    audio_top_k: int = 250
    seed: int | None = None  # None: a fresh random seed


@dataclass(frozen=True)
class DuplexStep:
    """One step's outputs for rows (= slots) ``0..B-1``, device tensors."""

    text: torch.Tensor  # [B] int64: the text token of this step (may be a padding id)
    audio: torch.Tensor  # [B, K] int64: the model's codes of one whole frame, undelayed
    audio_ready: torch.Tensor  # [B] bool: False on a slot's first step (no whole frame yet)
    #: [B, K] int64: what the depth decoder sampled this step, in the delayed layout (codebook 0
    #: of the next frame, codebooks 1..K-1 of this one).
    delayed: torch.Tensor | None = None


def text_pad_ids(config: MoshiConfig) -> frozenset[int]:
    """The text ids that are padding, not text (see the module doc)."""
    pad = getattr(config, "existing_text_padding_id", None)
    end = getattr(config, "existing_text_end_padding_id", None)
    return frozenset((TEXT_PAD_ID if pad is None else int(pad), TEXT_END_PAD_ID if end is None else int(end)))


def add_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + delta, MoshiRMSNorm(x + delta))`` (``delta`` None: no add): float32 math, the result
    in ``x``'s dtype; one launch on CUDA (``kernels/rms_norm.py``, the ``moshi`` chain: ATen's
    sums, the eager chain's bits), the eager chain elsewhere."""
    return add_rms_norm(x, delta, weight, eps, "moshi")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DuplexLM:
    """Per-slot streaming state and the batched step of a Moshi LM (see the module doc)."""

    def __init__(
        self,
        weights: MoshiWeights,
        config: MoshiConfig,
        *,
        max_slots: int,
        device: torch.device | str,
        dtype: torch.dtype,
        graphs: bool = True,
        max_frames: int | None = None,
        kv_dtype: str = "auto",
        attention_kernel: bool = True,
    ) -> None:
        check_config(config)
        if max_slots < 1:
            raise ValueError(f"max_slots must be at least 1, got {max_slots}")
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
        window = max_frames or config.sliding_window or config.max_position_embeddings
        if window < 1:
            raise ValueError(f"max_frames must be at least 1, got {window}")
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.weights = weights.to(device=self.device, dtype=dtype).eval().requires_grad_(False)
        self.num_codebooks = config.num_codebooks
        self.max_slots = max_slots
        self.max_frames = int(window)
        self.text_pad_ids = text_pad_ids(config)
        self.vocab_size = config.vocab_size
        self.audio_vocab_size = config.audio_vocab_size
        self._prepare_weights(config)
        self.kv_dtype = kv_dtype
        #: Attention through ``kernels/decode_attention.py``'s kernel where it applies (CUDA),
        #: else its torch reference (False: the reference everywhere, for comparisons).
        self.attention_kernel = attention_kernel

        k, slots = self.num_codebooks, max_slots
        shape = (slots, config.num_key_value_heads, self.max_frames + 1, config.head_dim)
        layers = config.num_hidden_layers
        store = FP8 if kv_dtype == "fp8" else dtype
        self._check_memory(config, shape)
        self.keys = [torch.zeros(shape, device=self.device, dtype=store) for _ in range(layers)]
        self.values = [torch.zeros(shape, device=self.device, dtype=store) for _ in range(layers)]
        #: fp8: one fp32 scale per stored vector, [slots, kv_heads, window + 1] per layer.
        self.key_scales: list[torch.Tensor] | None = None
        self.value_scales: list[torch.Tensor] | None = None
        if kv_dtype == "fp8":
            self.key_scales = [torch.ones(shape[:3], device=self.device) for _ in range(layers)]
            self.value_scales = [torch.ones(shape[:3], device=self.device) for _ in range(layers)]
        self.position = torch.zeros(slots, dtype=torch.long, device=self.device)
        self.text_prev = torch.zeros(slots, dtype=torch.long, device=self.device)
        self.model_prev = torch.zeros((slots, k), dtype=torch.long, device=self.device)
        self.user_prev = torch.zeros((slots, k - 1), dtype=torch.long, device=self.device)
        self.text_sampling = SlotSampling(slots, self.device)
        self.audio_sampling = SlotSampling(slots, self.device)
        self._rows = torch.arange(slots, device=self.device)
        self._frames = [0] * slots
        self._started = [False] * slots

        minimum = 1 if self.device.type == "cuda" else min(CPU_MIN_ROWS, slots)
        self.buckets = [b for b in batch_buckets(slots) if b >= minimum]
        self._runner = self._make_runner(graphs)

    def _make_runner(self, graphs: bool) -> LengthBucketedRunner:
        return LengthBucketedRunner(
            self._step,
            self._example,
            batch_buckets=self.buckets,
            length_buckets=length_buckets(self.max_frames),
            enabled=graphs,
            clone_outputs=True,
        )

    # -- weights ---------------------------------------------------------------------------------
    def _prepare_weights(self, config: MoshiConfig) -> None:
        w = self.weights
        depth = config.depth_decoder_config
        self._heads, self._kv_heads, self._head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self._eps = config.rms_norm_eps
        self._act = ACT2FN[config.hidden_act]
        self._depth_heads, self._depth_kv_heads, self._depth_head_dim = (
            depth.num_attention_heads,
            depth.num_key_value_heads,
            depth.head_dim,
        )
        self._depth_eps = depth.rms_norm_eps
        self._depth_act = ACT2FN[depth.hidden_act]
        self._depth_hidden = depth.hidden_size
        # The K input projections as one matrix: one GEMM for all sub-steps.
        proj = w.depth_decoder.input_projections.weight
        self._depth_in = proj.reshape(-1, proj.shape[-1])
        rope = dict(config.rope_parameters or {})
        theta = float(rope.get("rope_theta", 10_000.0))
        dim = self._head_dim
        self._inv_freq = (1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))).to(self.device)

    @property
    def kv_bytes(self) -> int:
        """Bytes of the temporal KV cache of all slots (fp8: with the scales)."""
        tensors = [*self.keys, *self.values, *(self.key_scales or ()), *(self.value_scales or ())]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _check_memory(self, config: MoshiConfig, shape: tuple[int, ...]) -> None:
        """CUDA: ValueError before allocating a KV cache that cannot fit in free memory."""
        if self.device.type != "cuda":
            return
        need = shape[0] * shape[2] * self.kv_bytes_per_frame(config, self.kv_dtype, self.dtype)
        free, _ = torch.cuda.mem_get_info(self.device)
        if need > free:
            raise ValueError(
                f"the duplex KV cache of {shape[0]} slots x {shape[2] - 1} frames ({self.kv_dtype}) needs "
                f"{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB are free: fewer sessions, a shorter "
                "window (--duplex-max-frames) or fp8 (--duplex-kv-dtype fp8)"
            )

    @staticmethod
    def kv_bytes_per_frame(config: MoshiConfig, kv_dtype: str, dtype: torch.dtype) -> int:
        """Temporal KV bytes one slot holds per frame of its window (keys and values of every
        layer; fp8: with the fp32 scales)."""
        per_vector = config.head_dim + 4 if kv_dtype == "fp8" else config.head_dim * dtype.itemsize
        return 2 * config.num_hidden_layers * config.num_key_value_heads * per_vector

    # -- slots -----------------------------------------------------------------------------------
    def _check_slot(self, slot: int) -> int:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.max_slots:
            raise ValueError(f"slot must be an int in [0, {self.max_slots}), got {slot!r}")
        return slot

    def start(self, slot: int, sampling: DuplexSampling) -> None:
        """A new conversation in ``slot``, reset in place (no device sync)."""
        self._check_slot(slot)
        _check_sampling(sampling)
        seed = fresh_seed(sampling.seed)
        self.text_sampling.set(
            slot, temperature=sampling.text_temperature, top_k=sampling.text_top_k, top_p=1.0, seed=seed
        )
        self.audio_sampling.set(
            slot, temperature=sampling.audio_temperature, top_k=sampling.audio_top_k, top_p=1.0, seed=seed
        )
        self.position[slot] = 0
        self.text_prev[slot] = self.vocab_size
        self.model_prev[slot] = self.audio_vocab_size
        self.user_prev[slot] = self.audio_vocab_size
        self._frames[slot] = 0
        self._started[slot] = True

    def move(self, source: int, target: int) -> None:
        """Moves the conversation of slot ``source`` into free slot ``target``, in place on the
        device with no sync: the ring's valid columns (and their fp8 scales), the position, the
        delay buffers, both sampling rows (seed and counter included) and the step count. The
        conversation goes on in ``target`` exactly as it would have in ``source`` (bitwise on
        CPU; on CUDA as long as the step runs at the same batch bucket); ``source`` is stopped.
        Between steps only (captured graphs read the buffers in place, their addresses do not
        change). ValueError, nothing changed, unless ``source`` has a conversation and
        ``target`` is another slot without one."""
        self._check_slot(source)
        self._check_slot(target)
        if not self._started[source]:
            raise ValueError(f"cannot move from slot {source}: it has no conversation")
        if self._started[target]:
            raise ValueError(f"cannot move to slot {target}: it has a conversation (stop it first)")
        valid = min(self._frames[source], self.max_frames)  # the ring's valid columns: 0..valid-1
        caches = [*self.keys, *self.values]
        for cache in caches:
            raw = cache.view(torch.uint8) if cache.dtype == FP8 else cache  # copies fp8 as bytes
            raw[target, :, :valid] = raw[source, :, :valid]
        for scales in (*(self.key_scales or ()), *(self.value_scales or ())):
            scales[target, :, :valid] = scales[source, :, :valid]
        for state in (self.position, self.text_prev, self.model_prev, self.user_prev):
            state[target] = state[source]
        self.text_sampling.copy_row(source, target)
        self.audio_sampling.copy_row(source, target)
        self._frames[target] = self._frames[source]
        self._started[target] = True
        self._started[source] = False

    def stop(self, slot: int) -> None:
        """Ends ``slot``'s conversation: it may not be stepped until started again."""
        self._started[self._check_slot(slot)] = False

    def frames(self, slot: int) -> int:
        """Steps the slot has taken since its start."""
        return self._frames[self._check_slot(slot)]

    def fast_forward(self, slot: int, frames: int) -> None:
        """Benchmarks: puts a started slot at ``frames`` steps into its conversation without
        running them: position and step count, and (for ``frames > 0``) delay buffers as in mid
        conversation (the text padding token, code 0 in every codebook of both streams). Its KV
        cache keeps whatever it holds, so what follows costs what a conversation of that length
        costs, with meaningless outputs."""
        self._check_slot(slot)
        if not self._started[slot]:
            raise ValueError(f"slot {slot} has no conversation (call start first)")
        if isinstance(frames, bool) or not isinstance(frames, int) or frames < 0:
            raise ValueError(f"frames must be an int >= 0, got {frames!r}")
        self.position[slot] = frames
        self._frames[slot] = frames
        if frames:
            self.text_prev[slot] = min(self.text_pad_ids)
            self.model_prev[slot] = 0
            self.user_prev[slot] = 0

    # -- the step --------------------------------------------------------------------------------
    def step(self, user_codes: torch.Tensor, active: torch.Tensor) -> DuplexStep:
        """One frame for each active row of slots ``0..B-1``: ``user_codes`` [B, K] int64, the
        user's newest frame (undelayed, as Mimi encodes it), ``active`` [B] bool. Inactive rows
        keep their state untouched. ``active`` is read on the host (give a CPU tensor: a device
        one costs a sync); codes on the CPU are range-checked, device codes are trusted (they
        come from our Mimi encode). Bad arguments raise ValueError before anything changes."""
        rows = self._check_step(user_codes, active)
        batch = user_codes.shape[0]
        bucket = next(b for b in self.buckets if b >= batch)
        attend = max((min(self._frames[i] + 1, self.max_frames) for i in rows), default=1)
        codes = user_codes.to(self.device, torch.long)
        mask = active.to(self.device)
        if bucket > batch:
            codes = F.pad(codes, (0, 0, 0, bucket - batch))
            mask = F.pad(mask, (0, bucket - batch))
        out = self._runner({"user_codes": codes, "active": mask}, attend)
        for i in rows:
            self._frames[i] += 1
        return DuplexStep(
            text=out["text"][:batch],
            audio=out["audio"][:batch],
            audio_ready=out["audio_ready"][:batch],
            delayed=out["delayed"][:batch],
        )

    def _check_step(self, user_codes: torch.Tensor, active: torch.Tensor) -> list[int]:
        k = self.num_codebooks
        if not isinstance(user_codes, torch.Tensor) or not isinstance(active, torch.Tensor):
            raise ValueError("user_codes and active must be tensors")
        if (
            user_codes.dim() != 2
            or user_codes.shape[1] != k
            or not 1 <= user_codes.shape[0] <= self.max_slots
        ):
            raise ValueError(
                f"user_codes must be [B, {k}] with 1 <= B <= {self.max_slots}, got {tuple(user_codes.shape)}"
            )
        if user_codes.is_floating_point() or user_codes.is_complex() or user_codes.dtype == torch.bool:
            raise ValueError(f"user_codes must be integer codes, got {user_codes.dtype}")
        if active.dtype != torch.bool or tuple(active.shape) != (user_codes.shape[0],):
            raise ValueError(
                f"active must be a bool tensor of shape ({user_codes.shape[0]},), "
                f"got {active.dtype} {tuple(active.shape)}"
            )
        flags = active.tolist()
        rows = [i for i, on in enumerate(flags) if on]
        idle = [i for i in rows if not self._started[i]]
        if idle:
            raise ValueError(f"slots {idle} are active but have no conversation (call start first)")
        if user_codes.device.type == "cpu" and rows:
            live = user_codes[rows]
            if bool(((live < 0) | (live >= self.audio_vocab_size)).any()):
                raise ValueError(f"user codes must be in [0, {self.audio_vocab_size})")
        return rows

    def capture(self, batches: Sequence[int] | None = None, lengths: Sequence[int] | None = None) -> None:
        """CUDA: captures the step per (batch bucket, attention bucket), or only the given batch
        buckets and the attention buckets holding ``lengths``; no-op on CPU or with graphs off.
        Captured on all-idle inputs: no slot's state changes."""
        self._runner.capture(batches=batches, lengths=lengths)

    def use_graphs(self, enabled: bool) -> None:
        """Replay captured graphs (True) or run every step eagerly (False)."""
        self._runner.enabled = enabled

    def set_attention_kernel(self, enabled: bool) -> None:
        """The decode-attention kernel (True, where it applies) or the torch reference (False).
        Captured graphs hold the previous choice: they are dropped (capture again)."""
        if enabled != self.attention_kernel:
            self.attention_kernel = enabled
            self._runner = self._make_runner(self._runner.enabled)

    @property
    def graphs(self) -> int:
        return self._runner.graphs

    @property
    def last_path(self) -> str:
        """``"graph"`` or ``"eager"``: how the last step ran."""
        return self._runner.last_path

    def _example(self, batch: int, attend: int) -> dict[str, torch.Tensor]:
        return {
            "user_codes": torch.zeros((batch, self.num_codebooks), dtype=torch.long, device=self.device),
            "active": torch.zeros(batch, dtype=torch.bool, device=self.device),
        }

    def _step(self, inputs: dict[str, torch.Tensor], attend: int) -> dict[str, torch.Tensor]:
        codes, active = inputs["user_codes"], inputs["active"]
        batch = codes.shape[0]
        av = self.audio_vocab_size
        w = self.weights
        position = self.position[:batch]
        first = position == 0
        text_in = self.text_prev[:batch]
        model_in = self.model_prev[:batch]
        user_acoustic = self.user_prev[:batch]
        user_semantic = torch.where(first, av, codes[:, 0])
        audio_in = torch.cat((model_in, user_semantic[:, None], user_acoustic), dim=1)  # [B, 2K]
        x = w.embed_tokens[0](audio_in[:, 0])
        for cb in range(1, audio_in.shape[1]):  # in codebook order, as transformers sums them
            x = x + w.embed_tokens[cb](audio_in[:, cb])
        x = x + w.decoder.model.embed_tokens(text_in)
        hidden = self._temporal(x, position, active, attend)
        text_logits = F.linear(hidden, w.decoder.lm_head.weight)
        uniform = self.text_sampling.uniforms(batch, 1, DUPLEX_TEXT_STREAM)[:, 0]
        text = self.text_sampling.draw_with(text_logits, uniform)
        delayed = self._depth(hidden, text)  # [B, K]

        audio = torch.cat((model_in[:, :1], delayed[:, 1:]), dim=1)
        keep = active[:, None]
        next_model = torch.cat((delayed[:, :1], torch.where(first[:, None], av, delayed[:, 1:])), dim=1)
        next_user = torch.where(first[:, None], av, codes[:, 1:])
        text_in.copy_(torch.where(active, text, text_in))
        model_in.copy_(torch.where(keep, next_model, model_in))
        user_acoustic.copy_(torch.where(keep, next_user, user_acoustic))
        position.add_(active.long())
        self.text_sampling.advance(active)
        self.audio_sampling.advance(active)
        return {"text": text, "audio": audio, "audio_ready": ~first, "delayed": delayed}

    def _temporal(
        self, x: torch.Tensor, position: torch.Tensor, active: torch.Tensor, attend: int
    ) -> torch.Tensor:
        """The temporal transformer at each row's position: [B, H] -> final-norm hidden [B, H]."""
        batch = x.shape[0]
        heads, kv_heads, dim = self._heads, self._kv_heads, self._head_dim
        freqs = position[:, None].float() * self._inv_freq  # as MoshiRotaryEmbedding: float32
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(x.dtype).view(batch, 1, 1, dim)
        sin = emb.sin().to(x.dtype).view(batch, 1, 1, dim)
        window = self.max_frames
        write_at = torch.where(active, position % window, window)
        lengths = (position + 1).clamp(max=window)  # the ring's valid entries: columns 0..n-1
        rows = self._rows[:batch]
        scale = 1.0 / math.sqrt(dim)
        pending: torch.Tensor | None = None  # the last MLP's output, added with the next norm
        for i, layer in enumerate(self.weights.decoder.model.layers):
            attn = layer.self_attn
            x, h = add_norm(x, pending, layer.input_layernorm.weight, self._eps)
            q = F.linear(h, attn.q_proj.linear.weight).view(batch, heads, 1, dim)
            k = F.linear(h, attn.k_proj.linear.weight).view(batch, kv_heads, 1, dim)
            v = F.linear(h, attn.v_proj.linear.weight).view(batch, kv_heads, dim)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            k_scale = v_scale = None
            if self.key_scales is None:
                self.keys[i][rows, :, write_at] = k[:, :, 0]
                self.values[i][rows, :, write_at] = v
            else:  # fp8 bytes written through a uint8 view (index_put has no fp8 kernels)
                k_scale, v_scale = self.key_scales[i], self.value_scales[i]
                for cache, scales, new in ((self.keys[i], k_scale, k[:, :, 0]), (self.values[i], v_scale, v)):
                    quantized, factor = quantize_kv(new)
                    cache.view(torch.uint8)[rows, :, write_at] = quantized.view(torch.uint8)
                    scales[rows, :, write_at] = factor
            out = decode_attention(
                q.view(batch, heads, dim),
                self.keys[i],
                self.values[i],
                lengths,
                attend,
                scale,
                k_scale,
                v_scale,
                use_kernel=self.attention_kernel,
            )
            attended = F.linear(out, attn.o_proj.linear.weight)
            x, h = add_norm(x, attended, layer.post_attention_layernorm.weight, self._eps)
            gate = F.linear(h, layer.mlp.fc1.weight).view(batch, 2, -1)
            pending = F.linear(self._act(gate[:, 0]) * gate[:, 1], layer.mlp.fc2.weight)
        return add_norm(x, pending, self.weights.decoder.model.norm.weight, self._eps)[1]

    def _depth(self, hidden: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """The depth loop: ``K`` codes per row from the temporal hidden state and the text token."""
        batch = hidden.shape[0]
        k_total = self.num_codebooks
        depth = self.weights.depth_decoder
        heads, kv_heads, dim = self._depth_heads, self._depth_kv_heads, self._depth_head_dim
        group = heads // kv_heads
        projected = F.linear(hidden, self._depth_in).view(batch, k_total, self._depth_hidden)
        uniforms = self.audio_sampling.uniforms(batch, k_total, DUPLEX_AUDIO_STREAM)
        layers = list(depth.layers)
        keys = [hidden.new_empty((batch, kv_heads, k_total, dim)) for _ in layers]
        values = [hidden.new_empty((batch, kv_heads, k_total, dim)) for _ in layers]
        scale = 1.0 / math.sqrt(dim)
        codes: list[torch.Tensor] = []
        for k in range(k_total):
            embed = depth.text_embed_tokens(text) if k == 0 else depth.embed_tokens[k - 1](codes[-1])
            x = embed + projected[:, k]
            pending = None
            for i, layer in enumerate(layers):
                attn = layer.self_attn
                x, h = add_norm(x, pending, layer.input_layernorm.weight, self._depth_eps)
                q = F.linear(h, attn.q_proj.linear.weight[k]).view(batch, kv_heads, group, dim)
                keys[i][:, :, k] = F.linear(h, attn.k_proj.linear.weight[k]).view(batch, kv_heads, dim)
                values[i][:, :, k] = F.linear(h, attn.v_proj.linear.weight[k]).view(batch, kv_heads, dim)
                scores = torch.matmul(q, keys[i][:, :, : k + 1].transpose(-1, -2)) * scale
                probs = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
                out = torch.matmul(probs, values[i][:, :, : k + 1]).reshape(batch, heads * dim)
                attended = F.linear(out, attn.o_proj.linear.weight[k])
                x, h = add_norm(x, attended, layer.post_attention_layernorm.weight, self._depth_eps)
                gate = F.linear(h, layer.mlp.fc1.weight[k]).view(batch, 2, -1)
                pending = F.linear(self._depth_act(gate[:, 0]) * gate[:, 1], layer.mlp.fc2.weight[k])
            logits = F.linear(x + pending if pending is not None else x, depth.lm_heads.weight[k])
            codes.append(self.audio_sampling.draw_with(logits, uniforms[:, k]))
        return torch.stack(codes, dim=1)


def _check_sampling(sampling: DuplexSampling) -> None:
    if not isinstance(sampling, DuplexSampling):
        raise ValueError(f"sampling must be a DuplexSampling, got {type(sampling).__name__}")
    for name in ("text_temperature", "audio_temperature"):
        value = getattr(sampling, name)
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value < 0
        ):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    for name in ("text_top_k", "audio_top_k"):
        value = getattr(sampling, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0 (0: off), got {value!r}")
    if sampling.seed is not None and (isinstance(sampling.seed, bool) or not isinstance(sampling.seed, int)):
        raise ValueError(f"seed must be an int or None, got {sampling.seed!r}")
