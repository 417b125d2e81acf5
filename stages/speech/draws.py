"""Per-slot sampling parameters and draw counters on the device, for graph-captured decode steps.

Each request's sampling (temperature, top-k, top-p, seed) is written into its slot's row once,
at admission; a decode step reads rows ``0..B-1`` and :func:`~.sampling.sample_rows` draws one
token per row from counter-based randomness keyed by (seed, counter, stream). A row's counter
counts its draws, so the same seed draws the same tokens whatever the batch or the slot. The
thinker, the talker and each code-predictor group draw on streams of their own.
"""

from __future__ import annotations

import secrets

import torch

from .sampling import sample_rows

#: First Philox stream of each model's draws (code-predictor groups use PREDICTOR + group).
THINKER_STREAM, TALKER_STREAM, PREDICTOR_STREAM = 0, 1, 16


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

    def advance(self, active: torch.Tensor) -> None:
        """Counts one draw for each active row of slots ``0..B-1``."""
        self.counter[: active.shape[0]] += active.long()

    def advance_slot(self, slot: int) -> None:
        self.counter[slot] += 1
