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
    """Sampling parameters and counters of ``num_slots`` slots (device tensors, rows = slots). The
    parameters are kept as what a draw derives from them (:class:`~.sampling.DrawParams`: made once
    at :meth:`set`, not in every draw of a step)."""

    def __init__(self, num_slots: int, device: torch.device) -> None:
        self.seed = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.counter = torch.zeros(num_slots, dtype=torch.long, device=device)
        greedy = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self._params = draw_params(greedy, torch.zeros_like(self.seed), torch.ones_like(greedy))

    def set(self, slot: int, *, temperature: float, top_k: int, top_p: float, seed: int) -> None:
        """A new request's parameters in ``slot``; its counter starts at zero. The draw parameters
        are made on the host (the same elementwise arithmetic as on the device) and written as
        scalars: no copy that would wait for the device."""
        made = draw_params(
            torch.tensor([float(temperature)]), torch.tensor([int(top_k)]), torch.tensor([float(top_p)])
        )
        for name, row in vars(self._params).items():
            row[slot] = getattr(made, name).reshape(-1)[0].item()
        self.seed[slot] = int(seed)
        self.counter[slot] = 0

    def params(self, rows: slice) -> DrawParams:
        """The draw parameters of the slots ``rows`` (views)."""
        p = self._params
        return DrawParams(p.sampled[rows], p.scale[rows], p.top_k[rows], p.cut[rows])

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
        for row in (self.seed, self.counter, *vars(self._params).values()):
            row[target] = row[source]
