"""GPU memory of the speech pipeline's slots, planned before anything is allocated.

Every slot holds a thinker KV cache of ``max_context`` tokens, a talker KV cache of its prompt
plus ``max_audio_frames`` frames, and a code-predictor cache: at real size (Qwen3-Omni-30B-A3B,
bf16) 96 KiB per thinker token and 20 KiB per talker token, so 32 slots of 4096 tokens take
12 GiB of thinker cache alone. :func:`plan_slots` computes what a configuration needs and, when
the context is not fixed by the caller, picks the longest context (a power of two, up to the
default) that fits the free memory; a configuration that cannot fit is refused at start-up with
the numbers, instead of failing on the first busy tick.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GiB = 2**30
#: Free memory kept out of the plan: CUDA graphs' pools, prefill activations, the allocator's
#: fragmentation, the vocoder's state.
DEFAULT_HEADROOM = 0.10
MIN_CONTEXT = 256


def kv_bytes_per_token(decoder_config: Any, element_size: int) -> int:
    """Bytes of keys and values one token takes in a decoder's cache (all layers)."""
    head_dim = getattr(decoder_config, "head_dim", None) or (
        decoder_config.hidden_size // decoder_config.num_attention_heads
    )
    return 2 * decoder_config.num_hidden_layers * decoder_config.num_key_value_heads * head_dim * element_size


@dataclass(frozen=True)
class SlotPlan:
    max_slots: int
    max_context: int
    thinker_bytes: int
    talker_bytes: int
    predictor_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.thinker_bytes + self.talker_bytes + self.predictor_bytes

    def describe(self) -> str:
        return (
            f"{self.max_slots} slots x {self.max_context} context tokens: KV caches "
            f"{self.total_bytes / GiB:.1f} GiB (thinker {self.thinker_bytes / GiB:.1f}, "
            f"talker {self.talker_bytes / GiB:.1f}, code predictor {self.predictor_bytes / GiB:.2f})"
        )


def slot_bytes(
    config: Any, *, max_slots: int, max_context: int, max_audio_frames: int, element_size: int
) -> SlotPlan:
    """What the slots of one configuration take (the sizes :class:`~.pipeline.SpeechPipeline`
    allocates, scratch column included)."""
    thinker = kv_bytes_per_token(config.thinker_config.text_config, element_size) * (max_context + 1)
    talker = predictor = 0
    if getattr(config, "enable_audio_output", True) and getattr(config, "talker_config", None) is not None:
        tcfg = config.talker_config
        talker = kv_bytes_per_token(tcfg.text_config, element_size) * (max_context + max_audio_frames + 17)
        predictor = kv_bytes_per_token(tcfg.code_predictor_config, element_size) * (tcfg.num_code_groups + 2)
    return SlotPlan(max_slots, max_context, thinker * max_slots, talker * max_slots, predictor * max_slots)


def plan_slots(
    config: Any,
    *,
    max_slots: int,
    max_context: int | None,
    default_context: int,
    max_audio_frames: int,
    element_size: int,
    free_bytes: int | None,
    headroom: float = DEFAULT_HEADROOM,
) -> SlotPlan:
    """The slots' plan: ``max_context`` as given, or the longest power-of-two context up to
    ``default_context`` that fits ``free_bytes`` less ``headroom`` (without a number for free
    memory, e.g. on CPU: ``default_context``). Raises ``ValueError`` naming the sizes when
    even the smallest context (or the given one) does not fit."""
    if max_slots < 1:
        raise ValueError(f"max_slots must be at least 1, got {max_slots}")

    def plan(context: int) -> SlotPlan:
        return slot_bytes(
            config, max_slots=max_slots, max_context=context, max_audio_frames=max_audio_frames,
            element_size=element_size,
        )

    if free_bytes is None:
        return plan(max_context or default_context)
    budget = int(free_bytes * (1.0 - headroom))
    if max_context is not None:
        chosen = plan(max_context)
        if chosen.total_bytes > budget:
            raise ValueError(
                f"{chosen.describe()} do not fit the {budget / GiB:.1f} GiB the GPU has free for them "
                f"({free_bytes / GiB:.1f} GiB free after the weights, {headroom:.0%} kept for graphs "
                "and activations): lower --max-sessions or the context"
            )
        return chosen
    context = default_context
    while context >= MIN_CONTEXT:
        chosen = plan(context)
        if chosen.total_bytes <= budget:
            return chosen
        context //= 2
    smallest = plan(MIN_CONTEXT)
    raise ValueError(
        f"{smallest.describe()} do not fit the {budget / GiB:.1f} GiB the GPU has free for them "
        f"({free_bytes / GiB:.1f} GiB free after the weights): lower --max-sessions"
    )
