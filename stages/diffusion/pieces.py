"""The pieces of split transformer calls and VAE decodes, planned from their parts' measured costs.

A split call (:class:`~.denoiser.SplitDenoiser`) runs as its start, its blocks and its finish; a
split decode (:class:`~.denoiser.SplitDecoder`) as its start with its first part, its other parts
and its finish. :class:`PieceCosts` keeps the measured seconds of each kind of part per (what,
shape, rows) and plans the next piece: as many parts as fit a time budget by those costs, at
least one; a part never measured at that shape and row count runs alone first, so it is measured
before it is grouped. After a piece ran, :meth:`PieceCosts.record` attributes its time to its
parts. :class:`~.pipeline.DiffusionPipeline` runs the pieces; this module only counts.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass

from ..pipeline import StepTimer
from .denoiser import Shape

#: What a cost is kept for: ("transformer" | "vae", shape, rows).
PartsKey = tuple[str, Shape, int]


@dataclass(frozen=True)
class Piece:
    """What one step of a split call or decode runs: the start (or not), its blocks ``first`` to
    ``stop - 1``, its finish (or not)."""

    start: bool
    first: int
    stop: int
    finish: bool

    @property
    def blocks(self) -> int:
        return self.stop - self.first


class PieceCosts:
    """Measured seconds of the start, the blocks (by class) and the finish of split calls and
    decodes, per :data:`PartsKey`, and the pieces planned from them."""

    def __init__(self, decode_part_kinds: Callable[[Shape], int] | None = None) -> None:
        """``decode_part_kinds(shape)``: how many classes of parts a decode at ``shape`` cycles
        through (the denoiser's; None: one class, as for a transformer call's blocks)."""
        self._decode_part_kinds = decode_part_kinds
        self._costs: dict[PartsKey, dict[str, StepTimer]] = {}

    def start_cost(self, key: PartsKey) -> float:
        """The measured seconds of the start of a call or decode at ``key`` (it must have run)."""
        return self._costs[key]["start"].seconds

    def next_piece(
        self, key: PartsKey, blocks: int, done: int, *, started: bool, budget: float
    ) -> tuple[Piece, float | None]:
        """The next piece of a call or decode of ``blocks`` blocks (``done`` of them run, its start
        run or not) and its estimated seconds: as many parts as fit ``budget`` seconds by their
        measured costs, at least one; a part never measured at ``key`` runs alone (estimate None).
        Blocks are measured by class (:meth:`block_class`)."""
        costs = self._costs.get(key, {})
        budget *= 1 + 1e-9  # parts that add up to it exactly fit
        spent = 0.0
        if not started:
            if "start" not in costs:
                return Piece(True, 0, 0, False), None
            spent = costs["start"].seconds
        stop = done
        while stop < blocks:
            block = costs.get(self.block_class(key, stop))
            if block is None:
                if started and stop == done:
                    return Piece(False, done, done + 1, False), None
                break
            if not ((started and stop == done) or spent + block.seconds <= budget):
                break
            spent += block.seconds
            stop += 1
        finish = False
        if stop == blocks:
            empty = started and stop == done
            if "finish" not in costs:
                if empty:
                    return Piece(False, done, done, True), None
            elif empty or spent + costs["finish"].seconds <= budget:
                finish = True
                spent += costs["finish"].seconds
        return Piece(not started, done, stop, finish), spent

    def block_class(self, key: PartsKey, index: int) -> str:
        """The cost class of block ``index``: one for a transformer call's blocks; a decode's
        parts cycle through ``decode_part_kinds(shape)`` classes (the stages of a latent frame's
        decoder call, which cost differently), block ``i`` being part ``i + 1``. The first latent
        frame's stages are classes of their own: a causal video VAE's first call makes one frame,
        the others four (at 480p on the H200: 7-12 ms a stage against 8-45)."""
        kinds = self._decode_part_kinds
        count = kinds(key[1]) if key[0] == "vae" and kinds is not None else 1
        if count <= 1:
            return "block"
        part = index + 1
        return f"{'first' if part < count else 'block'}{part % count}"

    def record(self, key: PartsKey, piece: Piece, seconds: float) -> None:
        """Attributes a piece's measured time to its parts: all of it to a part that ran alone,
        else in proportion to the parts' estimates."""
        costs = self._costs.setdefault(key, {})
        counts = collections.Counter(self.block_class(key, i) for i in range(piece.first, piece.stop))
        named = (("start", int(piece.start)), *counts.items(), ("finish", int(piece.finish)))
        parts = [(name, n) for name, n in named if n]
        if len(parts) == 1:
            name, n = parts[0]
            costs.setdefault(name, StepTimer()).record(seconds / n)
            return
        predicted = sum(costs[name].seconds * n for name, n in parts if name in costs)
        if predicted <= 0 or any(name not in costs for name, _ in parts):
            even = seconds / sum(n for _, n in parts)
            for name, _ in parts:
                costs.setdefault(name, StepTimer()).record(even)
            return
        ratio = seconds / predicted
        for name, _ in parts:
            costs[name].record(costs[name].seconds * ratio)
