"""Per-slot sampling parameters and draw counters on the device, for graph-captured decode steps.

Each request's sampling (temperature, top-k, top-p, seed) is written into its slot's row once,
at admission; a decode step reads rows ``0..B-1`` and :func:`~.sampling.sample_rows` draws one
token per row from counter-based randomness keyed by (seed, counter, stream). A row's counter
counts its draws, so the same seed draws the same tokens whatever the batch or the slot. The
thinker, the talker and the code predictor draw on streams of their own (the predictor's groups
of one frame on consecutive counters of its stream); so do the duplex LM's text token and its
depth decoder's audio codes. Shared by the speech and duplex pipelines.
"""

from __future__ import annotations

import secrets

import torch

from .sampling import draw_rows, philox_uniforms, sample_rows

#: The Philox stream of each model's draws.
THINKER_STREAM, TALKER_STREAM, PREDICTOR_STREAM = 0, 1, 2
DUPLEX_TEXT_STREAM, DUPLEX_AUDIO_STREAM = 3, 4


def fresh_seed(seed: int | None) -> int:
    """The request's seed as a signed 64-bit value, or a random one."""
    value = secrets.randbits(63) if seed is None else int(seed)
    return (value + 2**63) % 2**64 - 2**63


class SlotSampling:
    """Sampling parameters and counters of ``num_slots`` slots (device tensors, rows = slots)."""

    def __init__(self, num_slots: int, device: torch.device) -> None:
        self.temperature = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.top_p = torch.ones(num_slots, dtype=torch.float32, device=device)
        self.seed = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.counter = torch.zeros(num_slots, dtype=torch.long, device=device)

    def set(self, slot: int, *, temperature: float, top_k: int, top_p: float, seed: int) -> None:
        """A new request's parameters in ``slot``; its counter starts at zero."""
        self.temperature[slot] = float(temperature)
        self.top_k[slot] = int(top_k)
        self.top_p[slot] = float(top_p)
        self.seed[slot] = int(seed)
        self.counter[slot] = 0

    def draw(self, logits: torch.Tensor, start: int, stream: int) -> torch.Tensor:
        """One token per row of ``logits`` [B, V] for slots ``start..start+B-1``."""
        rows = slice(start, start + logits.shape[0])
        return sample_rows(
            logits,
            self.temperature[rows],
            self.top_k[rows],
            self.top_p[rows],
            self.seed[rows],
            self.counter[rows],
            stream,
        )

    def uniforms(self, batch: int, draws: int, stream: int) -> torch.Tensor:
        """``draws`` uniforms [B, draws] for slots ``0..B-1`` from one Philox call: draw ``j``
        uses counter ``counter * draws + j`` (for steps that draw several times per count, like
        the code predictor's groups of one frame)."""
        return philox_uniforms(self.seed[:batch], self.counter[:batch], draws, stream)

    def draw_with(self, logits: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
        """One token per row of ``logits`` [B, V] (slots ``0..B-1``) with the uniforms given [B]."""
        rows = slice(0, logits.shape[0])
        return draw_rows(logits, self.temperature[rows], self.top_k[rows], self.top_p[rows], uniform)

    def advance(self, active: torch.Tensor) -> None:
        """Counts one draw for each active row of slots ``0..B-1``."""
        self.counter[: active.shape[0]] += active.long()

    def advance_slot(self, slot: int) -> None:
        self.counter[slot] += 1

    def copy_row(self, source: int, target: int) -> None:
        """Slot ``target`` takes slot ``source``'s parameters, seed and counter (on the device, no
        sync), so its draws continue where ``source``'s would have."""
        for row in (self.temperature, self.top_k, self.top_p, self.seed, self.counter):
            row[target] = row[source]
