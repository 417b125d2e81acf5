"""The thinker side of the speech pipeline: prompt prefill (eager, one HF forward) and the
batched decode step (one token for every decoding slot), replayed from CUDA graphs.

Per-slot device state: the KV cache (:class:`~.slots.SlotDecoder`), the token drawn but not yet
fed (``next_token``), the RoPE position of that token, and the sampling rows
(:class:`~.draws.SlotSampling`). A decode step reads and advances them in place for the active
rows of slots ``0..B-1``, so its only input is the exec mask and its output is a view of the
persistent ``next_token`` buffer: no per-step uploads of tokens or positions, no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..graphs import LengthBucketedRunner
from .draws import THINKER_STREAM, SlotSampling
from .hf_compat import output_cache, thinker_rope_index, thinker_text_model
from .prompt import PromptInputs
from .slots import SlotDecoder, length_buckets


@dataclass
class ThinkerPrefill:
    """A prompt's prefill, before it is loaded into its slot (see :meth:`Thinker.forward_prompt`)."""

    cache: Any  # the HF cache of the prompt (one row)
    next_position: torch.Tensor  # 0-d: the RoPE position of the first reply token
    token: torch.Tensor  # 0-d: the first reply token, drawn on the device
    input_ids: torch.Tensor  # [L] prompt ids on the device
    hidden_states: tuple[torch.Tensor, ...] | None  # all layers' hidden states (for the talker)


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
        self.next_token = torch.zeros(max_slots, dtype=torch.long, device=self.device)
        self.position = torch.zeros(max_slots, dtype=torch.long, device=self.device)
        self.runner = LengthBucketedRunner(
            self._step,
            self._example,
            batch_buckets=batch_buckets,
            length_buckets=length_buckets(max_len),
            enabled=graphs,
            pool=pool,
        )

    def state(self) -> dict[str, torch.Tensor]:
        """Every tensor a decode step changes, by name."""
        return {
            **self.kv.state("kv"),
            "next_token": self.next_token,
            "position": self.position,
            "counter": self.sampling.counter,
        }

    def _example(self, batch: int) -> dict[str, torch.Tensor]:
        return {"active": torch.zeros(batch, dtype=torch.bool, device=self.device)}

    @torch.no_grad()
    def forward_prompt(self, slot: int, prompt: PromptInputs, *, hidden_states: bool) -> ThinkerPrefill:
        """Reads a prompt (one HF forward, audio and vision encoders included) and draws the first
        reply token with ``slot``'s sampling row. Writes no shared state, so it may run on
        another thread and CUDA stream while decode steps run; :meth:`load` then fills the slot."""
        ids = prompt.input_ids.to(self.device)
        mask = torch.ones_like(ids)
        extra: dict[str, Any] = {k: v.to(self.device) for k, v in prompt.model_kwargs().items()}
        for key in ("input_features", "pixel_values"):
            if key in extra:
                extra[key] = extra[key].to(self.dtype)
        audio_lengths = extra["feature_attention_mask"].sum(-1) if "feature_attention_mask" in extra else None
        positions, _ = thinker_rope_index(self.thinker)(
            ids, extra.get("image_grid_thw"), None, mask, False, audio_lengths, None
        )
        result = self.thinker(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            output_hidden_states=hidden_states,
            **extra,
        )
        token = self.sampling.draw(result.logits[:, -1], slot, THINKER_STREAM)[0]
        return ThinkerPrefill(
            output_cache(result),
            positions.max() + 1,
            token,
            ids[0],
            result.hidden_states if hidden_states else None,
        )

    def load(self, slot: int, prefill: ThinkerPrefill) -> None:
        """Fills ``slot`` from a prefill (on the engine thread, in stream order)."""
        self.kv.load(slot, prefill.cache)
        self.position[slot] = prefill.next_position
        self.next_token[slot] = prefill.token
        self.sampling.advance_slot(slot)

    def decode(self, slots: list[int], batch: int) -> torch.Tensor:
        """One token for each of ``slots`` (all below ``batch``): returns a view [batch] of the
        drawn tokens on the device (other rows: their undrawn next token)."""
        active = torch.zeros(batch, dtype=torch.bool, pin_memory=self.device.type == "cuda")
        active[slots] = True
        active = active.to(self.device, non_blocking=True)
        length = self.kv.longest(slots) + 1
        out = self.runner({"active": active}, length)["token"]
        self.kv.advance_host(slots)
        return out

    def _step(self, inputs: dict[str, torch.Tensor], attend: int) -> dict[str, torch.Tensor]:
        active = inputs["active"]
        batch = active.shape[0]
        embeds = self.embed_tokens(self.next_token[:batch])
        hidden = self.kv.step(embeds, self.position[:batch], active, attend)
        token = self.sampling.draw(self.lm_head(hidden), 0, THINKER_STREAM)
        next_token = self.next_token[:batch]
        next_token.copy_(torch.where(active, token, next_token))
        self.position[:batch] += active.long()
        self.sampling.advance(active)
        return {"token": next_token}
