"""The thinker side of the speech pipeline: the prompt pass (the encoders and the embedding
merge eagerly, then the layers as one static-length pass) and the batched decode step (one
token for every decoding slot), both replayed from CUDA graphs.

Per-slot device state: the KV cache (:class:`~.slots.SlotDecoder`), the token drawn but not yet
fed (``next_token``), the RoPE position of that token, the sampling rows
(:class:`~.draws.SlotSampling`) and the allowed-token masks (:class:`~.token_masks.SlotMasks`,
all ones but for constrained replies). A decode step reads and advances them in place for the active
rows of slots ``0..B-1``, so its only input is the exec mask and its output is a view of the
persistent ``next_token`` buffer: no per-step uploads of tokens or positions, no host sync.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..draws import THINKER_STREAM, SlotSampling
from ..graphs import upload
from .audio_encoder import AudioCall, AudioEncoder, AudioPlan
from .hf_compat import thinker_rope_index, thinker_text_model
from .prompt import PromptInputs
from .slots import PieceCall, PromptPass, SlotDecoder, decode_runner, prompt_example, token_runs
from .token_masks import SlotMasks

#: What a prefill's pieces ask their driver to run (``prefill.advance``), and its answers.
Call = PieceCall | AudioCall
Answer = dict[str, torch.Tensor] | torch.Tensor


@dataclass
class ThinkerPrefill:
    """A prompt's prefill (see :meth:`Thinker.forward_prompt`); :meth:`Thinker.load` ends it."""

    length: int  # prompt tokens (their keys/values are in the slot already)
    next_position: torch.Tensor  # 0-d: the RoPE position of the first reply token
    token: torch.Tensor  # 0-d: the first reply token, drawn on the device
    input_ids: torch.Tensor  # [L] prompt ids on the device
    embeds: torch.Tensor  # [L, H] the prompt's input embeddings (for the talker)
    accepted: torch.Tensor | None  # [L, H] hidden state ``accept_layer`` (for the talker)


class Thinker:
    def __init__(
        self,
        model: nn.Module,
        *,
        max_slots: int,
        max_len: int,
        batch_buckets: list[int],
        graphs: bool,
        pool: object | None,
        accept_layer: int = 0,
        prompt_chunk: int = 512,
    ) -> None:
        self.model = model
        self.thinker = model.thinker
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.kv = SlotDecoder(
            thinker_text_model(self.thinker), num_slots=max_slots, max_len=max_len, device=self.device,
            dtype=self.dtype,
        )
        self.embed_tokens = self.thinker.get_input_embeddings()
        self.lm_head = self.thinker.lm_head
        self.sampling = SlotSampling(max_slots, self.device)
        self.masks = SlotMasks(max_slots, int(self.lm_head.out_features), self.device)
        self.next_token = torch.zeros(max_slots, dtype=torch.long, device=self.device)
        self.position = torch.zeros(max_slots, dtype=torch.long, device=self.device)
        self.runner = decode_runner(
            self._step, self._example, batch_buckets=batch_buckets, max_len=max_len, graphs=graphs, pool=pool
        )
        self.accept_layer = accept_layer
        vision = self.thinker.config.vision_config
        self.deepstack = len(getattr(vision, "deepstack_visual_indexes", None) or ())
        self.prompt = PromptPass(
            self._prompt_step, self._prompt_example, chunk=prompt_chunk, max_len=max_len, graphs=graphs,
            pool=pool,
        )
        tower = getattr(self.thinker.model, "audio_tower", None)
        #: The audio encoder over static windows (CUDA graphs per window count), if it hears.
        self.audio = AudioEncoder(tower, graphs=graphs, pool=pool) if tower is not None else None

    def state(self) -> dict[str, torch.Tensor]:
        """Every tensor a decode step changes, by name."""
        return {
            **self.kv.state("kv"),
            "next_token": self.next_token,
            "position": self.position,
            "counter": self.sampling.counter,
        }

    def _example(self, batch: int, length: int = 0) -> dict[str, torch.Tensor]:
        return {"active": torch.zeros(batch, dtype=torch.bool, device=self.device)}

    def forward_prompt(
        self, slot: int, prompt: PromptInputs, allowed: torch.Tensor | None = None, start: int = 0
    ) -> Generator[Call | None, Answer | None, ThinkerPrefill]:
        """Reads a prompt into ``slot``'s cache entries and draws the first reply token with the
        slot's sampling row (and the bitmask ``allowed``, [words] int32 on the host, when the
        reply is constrained): the audio encoder (an :class:`~.audio_encoder.AudioCall` it
        yields), the vision encoder and the embedding merge, then the layers in static-length
        pieces of ``prompt_chunk`` tokens (:class:`~.slots.PromptPass`, whose pieces it yields as
        :class:`~.slots.PieceCall`); a generator that yields None between pieces, so a long prompt
        is read over several ticks (``prefill.advance`` drives it). With ``start``, the slot
        holds the prompt's first ``start`` entries already (a reused prefix): only the rest is
        read, and audio parts that end before it are not encoded. Writes only the slot's own
        cache entries, which no decode step touches while the slot waits for its prompt;
        :meth:`load` then sets the slot's length and tokens."""
        # Inputs go up in stream order, and the RoPE index is computed on the host from the host
        # ids: past the encoders, a prefill enqueues its work without waiting for the GPU.
        host = prompt.model_kwargs()
        ids = upload(prompt.input_ids, self.device)
        audio = ("input_features", "feature_attention_mask")  # encoded from the host tensors
        extra: dict[str, Any] = {k: upload(v, self.device) for k, v in host.items() if k not in audio}
        if "pixel_values" in extra:
            extra["pixel_values"] = extra["pixel_values"].to(self.dtype)
        mask = torch.ones_like(prompt.input_ids)
        audio_lengths = host["feature_attention_mask"].sum(-1) if "feature_attention_mask" in host else None
        positions, _ = thinker_rope_index(self.thinker)(
            prompt.input_ids, host.get("image_grid_thw"), None, mask, False, audio_lengths, None
        )
        positions = upload(positions, self.device)
        audio = None
        plan, at = self.audio_parts(prompt.input_ids, host, start)
        if plan is not None:  # encoded by the driver, with the audio of prompts read beside it
            assert self.audio is not None
            audio = ((yield AudioCall(self.audio, plan)), at)
        embeds, deepstack = self._prompt_embeds(ids, extra, audio)
        out = yield from self.prompt.run(embeds, positions, slot, {"deepstack": deepstack}, start)
        logits = self.lm_head(out["last"])
        if allowed is not None:
            logits = self.masks.apply_bits(logits, allowed.to(self.device, non_blocking=True)[None])
        token = self.sampling.draw(logits, slot, THINKER_STREAM)[0]
        accepted = out["accepted"] if self.accept_layer else None
        return ThinkerPrefill(ids.shape[1], positions.max() + 1, token, ids[0], embeds, accepted)

    def audio_parts(
        self, input_ids: torch.Tensor, host: dict[str, Any], start: int = 0
    ) -> tuple[AudioPlan | None, torch.Tensor]:
        """The windows of the prompt's audio parts that end after ``start`` (those before it are
        in the slot already: their positions keep the placeholder's embedding, which the pass
        does not read), and the positions [N] of their tokens in the prompt; (None, empty) when
        none is needed. From the host tensors (``input_ids`` [1, L], the audio features)."""
        none = (None, torch.empty(0, dtype=torch.long))
        if "input_features" not in host:
            return none
        spans = token_runs(input_ids[0], self.thinker.config.audio_token_id)
        needed = [k for k, (_, end) in enumerate(spans) if end > start]
        if not needed:
            return none
        assert self.audio is not None
        plan = self.audio.plan(host["input_features"][needed], host["feature_attention_mask"][needed])
        return plan, torch.cat([torch.arange(*spans[k]) for k in needed])  # the parts' positions, in order

    def _prompt_embeds(
        self, ids: torch.Tensor, extra: dict[str, Any], audio: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt's input embeddings [L, H] with the audio tokens (``audio``: the encoded
        tokens [N, H] and their positions [N], see :meth:`audio_parts`) and image features merged
        in, and the visual deepstack features placed at the image positions [n, L, H] (zeros
        elsewhere), as ``Qwen3OmniMoeThinkerModel.forward`` builds them."""
        model = self.thinker.model
        embeds = model.get_input_embeddings()(ids)
        if audio is not None:
            tokens, at = audio
            embeds[0, upload(at, embeds.device)] = tokens.to(embeds.dtype)
        deepstack = embeds.new_zeros((self.deepstack, ids.shape[1], embeds.shape[-1]))
        if "pixel_values" in extra:
            image = model.get_image_features(extra["pixel_values"], extra["image_grid_thw"], return_dict=True)
            image_embeds = torch.cat(image.pooler_output, dim=0).to(embeds.device, embeds.dtype)
            image_mask, _, _ = model.get_placeholder_mask(
                ids, inputs_embeds=embeds, image_features=image_embeds
            )
            embeds = embeds.masked_scatter(image_mask, image_embeds)
            at = image_mask[0, :, 0]
            for i, features in enumerate(image.deepstack_features[: self.deepstack]):
                deepstack[i, at] = torch.cat(features, dim=0).to(deepstack.dtype)
        return embeds[0], deepstack

    def _prompt_example(self, batch: int, length: int, chunk: int | None) -> dict[str, torch.Tensor]:
        hidden = self.embed_tokens.embedding_dim
        example = prompt_example(batch, length, hidden, self.dtype, self.device, chunk)
        count = example["embeds"].shape[1]
        example["deepstack"] = torch.zeros(
            (batch, self.deepstack, count, hidden), device=self.device, dtype=self.dtype
        )
        return example

    def _prompt_step(self, inputs: dict[str, torch.Tensor], bucket: int) -> dict[str, torch.Tensor]:
        last, accepted = self.kv.prompt_step(
            inputs["embeds"],
            inputs["positions"],
            inputs["slot"],
            inputs["length"],
            start=inputs.get("start"),
            attend=bucket,
            keep=self.accept_layer or None,
            deepstack=inputs["deepstack"],
        )
        out = {"last": last}
        if accepted is not None:
            out["accepted"] = accepted
        return out

    def load(self, slot: int, prefill: ThinkerPrefill) -> None:
        """Ends a prefill in ``slot`` (on the engine thread, in stream order)."""
        self.kv.set_length(slot, prefill.length)
        self.position[slot] = prefill.next_position
        self.next_token[slot] = prefill.token
        self.sampling.advance_slot(slot)

    def move(self, source: int, target: int, *, swap: bool = False) -> None:
        """A request's state moves from slot ``source`` to free slot ``target`` (between steps, on
        the engine thread): its cache, next token, position, sampling row (seed and draws made,
        so its draws go on as they would have) and mask; ``swap``: ``target``'s cache entries go
        to ``source`` (a prefix kept). No device sync."""
        self.kv.move(source, target, swap=swap)
        for row in (self.next_token, self.position):
            row[target] = row[source]
        self.sampling.copy_row(source, target)
        self.masks.move(source, target)

    def decode(self, slots: list[int], batch: int) -> torch.Tensor:
        """One token for each of ``slots`` (all below ``batch``): returns a view [batch] of the
        drawn tokens on the device (other rows: their undrawn next token)."""
        active = torch.zeros(batch, dtype=torch.bool, pin_memory=self.device.type == "cuda")
        active[slots] = True
        active = active.to(self.device, non_blocking=True)
        length = self.kv.longest(slots) + 1
        self.masks.upload()  # constrained rows' next masks, written on the host last tick
        out = self.runner({"active": active}, length)["token"]
        self.kv.advance_host(slots)
        return out

    def _step(self, inputs: dict[str, torch.Tensor], attend: int) -> dict[str, torch.Tensor]:
        active = inputs["active"]
        batch = active.shape[0]
        embeds = self.embed_tokens(self.next_token[:batch])
        hidden = self.kv.step(embeds, self.position[:batch], active, attend)
        token = self.sampling.draw(self.masks.apply(self.lm_head(hidden)), 0, THINKER_STREAM)
        next_token = self.next_token[:batch]
        next_token.copy_(torch.where(active, token, next_token))
        self.position[:batch] += active.long()
        self.sampling.advance(active)
        return {"token": next_token}
