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

from .sampling import DrawParams, draw_params, draw_prepared, philox_uniforms

#: The Philox stream of each model's draws.
THINKER_STREAM, TALKER_STREAM, PREDICTOR_STREAM = 0, 1, 2
DUPLEX_TEXT_STREAM, DUPLEX_AUDIO_STREAM = 3, 4


def fresh_seed(seed: int | None) -> int:
    """The request's seed as a signed 64-bit value, or a random one."""
    value = secrets.randbits(63) if seed is None else int(seed)
    return (value + 2**63) % 2**64 - 2**63


class SlotSampling:
    """Sampling parameters and counters of ``num_slots`` slots (device tensors, rows = slots), and
    what a draw derives from the parameters alone (:class:`~.sampling.DrawParams`, made once at
    :meth:`set` instead of in every draw of a step)."""

    def __init__(self, num_slots: int, device: torch.device) -> None:
        self.temperature = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.top_p = torch.ones(num_slots, dtype=torch.float32, device=device)
        self.seed = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.counter = torch.zeros(num_slots, dtype=torch.long, device=device)
        self._derived = draw_params(self.temperature, self.top_k, self.top_p)

    def set(self, slot: int, *, temperature: float, top_k: int, top_p: float, seed: int) -> None:
        """A new request's parameters in ``slot``; its counter starts at zero."""
        self.temperature[slot] = float(temperature)
        self.top_k[slot] = int(top_k)
        self.top_p[slot] = float(top_p)
        self.seed[slot] = int(seed)
        self.counter[slot] = 0
        row = slice(slot, slot + 1)
        made = draw_params(self.temperature[row], self.top_k[row], self.top_p[row])
        for name in ("sampled", "scale", "top_k", "cut"):  # in place: captured graphs read them
            getattr(self._derived, name)[row] = getattr(made, name)

    def params(self, rows: slice) -> DrawParams:
        """The draw parameters of the slots ``rows`` (views)."""
        d = self._derived
        return DrawParams(d.sampled[rows], d.scale[rows], d.top_k[rows], d.cut[rows])

    def draw(self, logits: torch.Tensor, start: int, stream: int) -> torch.Tensor:
        """One token per row of ``logits`` [B, V] for slots ``start..start+B-1``: the token
        :func:`~.sampling.sample_rows` draws with the slots' parameters, seeds and counters."""
        rows = slice(start, start + logits.shape[0])
        uniform = philox_uniforms(self.seed[rows], self.counter[rows], 1, stream)[:, 0]
        return draw_prepared(logits, self.params(rows), uniform)

    def uniforms(self, batch: int, draws: int, stream: int) -> torch.Tensor:
        """``draws`` uniforms [B, draws] for slots ``0..B-1`` from one Philox call: draw ``j``
        uses counter ``counter * draws + j`` (for steps that draw several times per count, like
        the code predictor's groups of one frame)."""
        return philox_uniforms(self.seed[:batch], self.counter[:batch], draws, stream)

    def draw_with(self, logits: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
        """One token per row of ``logits`` [B, V] (slots ``0..B-1``) with the uniforms given [B]:
        :func:`~.sampling.draw_rows` of the slots' parameters, which are prepared already."""
        return draw_prepared(logits, self.params(slice(0, logits.shape[0])), uniform)

    def advance(self, active: torch.Tensor) -> None:
        """Counts one draw for each active row of slots ``0..B-1``."""
        self.counter[: active.shape[0]] += active.long()

    def advance_slot(self, slot: int) -> None:
        self.counter[slot] += 1

    def copy_row(self, source: int, target: int) -> None:
        """Slot ``target`` takes slot ``source``'s parameters, seed and counter (on the device, no
        sync), so its draws continue where ``source``'s would have."""
        d = self._derived
        for row in (self.temperature, self.top_k, self.top_p, self.seed, self.counter, *vars(d).values()):
            row[target] = row[source]
