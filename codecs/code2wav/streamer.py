"""Per-request streaming code2wav for the speech pipeline: slots, validation, output trimming."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from ..streaming import SlotAllocator
from .model import Code2WavModel
from .pool import Code2WavPool


class Code2WavStreamer:
    """Streams of one code2wav model in a fixed pool of ``max_slots`` slots.

    ``model`` is a :class:`.model.Code2WavModel` or a loaded transformers
    ``Qwen3OmniMoeCode2Wav`` (its weights are shared, not copied). Each :meth:`step` decodes
    one or more frames for each given stream in one batched model step over the whole pool,
    always at ``max_slots`` rows, so a stream's output never depends on which other slots are
    busy (bitwise, on one device); slots without frames in it keep their state. :meth:`acquire`
    hands out the lowest free slot. With ``buckets`` (row counts), a step runs only the first
    rows of the pool, the smallest bucket that covers the highest busy slot: far cheaper when
    few streams are busy, at the price of last-bit differences between buckets (the same bucket
    gives the same bits). With ``gather`` (for eager steps), a step whose slots are not the first
    ones runs just those rows, gathered (``pool.step_rows``): its cost follows the streams that
    have frames, whichever slots they and the idle ones hold (last bits as at that batch size).

    A step's frame count (``steps``) is the smallest of ``step_buckets`` that holds the most
    frames a stream gives it (padding the others), or that most when none does; a step of
    several frames costs about what one does on a GPU (its kernels' launches), and its samples
    equal those of one-frame steps to float rounding.

    ``runners[steps]`` runs a step of ``steps`` frames: ``pool.step_io`` when absent; an engine
    may set it to a ``stages.graphs.CudaGraphRunner(pool.step_io, partial(pool.make_inputs,
    steps=steps), buckets=streamer.buckets)`` after ``capture()``, which has the same call
    signature and gives bitwise the same output (``stages/speech/code2wav.py``'s
    ``StreamingVocoder`` does this on CUDA).

    Every method validates all of its arguments before it changes anything: bad input raises
    ``ValueError`` and leaves every stream as it was.
    """

    def __init__(self, model: Code2WavModel | nn.Module, max_slots: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 buckets: Sequence[int] | None = None, gather: bool = False,
                 step_buckets: Sequence[int] = (1,)) -> None:
        if not isinstance(model, Code2WavModel):
            model = Code2WavModel.from_hf(model)
        if buckets is not None and any(not 1 <= b <= max_slots for b in buckets):
            raise ValueError(f"code2wav buckets must lie in [1, {max_slots}], got {list(buckets)}")
        if not step_buckets or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                                   for n in step_buckets):
            raise ValueError(f"code2wav step buckets must be positive frame counts, got {list(step_buckets)}")
        #: Row counts a step runs at: the smallest that covers the highest busy slot.
        self.buckets = sorted({*(buckets or ()), max_slots})
        #: Frame counts a step runs at: the smallest that holds the most frames a stream gives it.
        self.step_buckets = sorted(set(step_buckets))
        self.pool = Code2WavPool(model, max_slots, device, dtype)
        self.model = self.pool.model
        #: A step of ``steps`` frames runs through ``runners[steps]``, or ``pool.step_io``.
        self.runners: dict[int, Callable[[dict[str, Tensor]], dict[str, Tensor]]] = {}
        #: Steps whose slots are not the first ones gather just those rows (``pool.step_rows``)
        #: rather than run a bucket over them. For eager steps; off for captured ``runners``.
        self.gather = gather
        self._slots = SlotAllocator(max_slots)
        self._frames: dict[int, int] = {}  # active slot -> frames decoded (host mirror of state["frame"])

    @property
    def free_slots(self) -> int:
        return len(self._slots)

    def acquire(self) -> int:
        """A fresh stream: a free slot, reset in place."""
        if not len(self._slots):
            raise ValueError(f"no free code2wav slot: all {self.pool.max_slots} are in use")
        slot = self._slots.take()
        self.pool.reset(slot)
        self._frames[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        """Ends a stream without flushing (a cancelled request); the slot becomes free."""
        self._check_slot(slot)
        del self._frames[slot]
        self._slots.give(slot)

    def finish(self, slot: int) -> np.ndarray:
        """Ends a stream and frees its slot; returns the samples left to flush (always none).

        The offline decode of ``S`` frames is ``S * samples_per_frame - held_back`` samples
        long, and exactly that many have been returned by :meth:`step` after ``S`` frames:
        the held-back samples depend on a frame that never comes, and transformers trims
        them. So nothing is left to flush, and the result is empty; it is returned so that
        callers need not know this.
        """
        self._check_slot(slot)
        self.release(slot)
        return np.zeros(0, dtype=np.float32)

    def compact(self) -> list[tuple[int, int]]:
        """Moves the highest streams into the lowest free slots while the bucket that covers the
        busy slots is larger than the one their count needs (``SlotAllocator.compaction``), so a
        step runs no more rows than its streams need; the moves made, ``(source, target)`` in
        order. Each moved stream goes on from its new slot as it would have from its old one (its
        state rows are copied; the same to rounding, as any row of another index). Between steps
        only."""
        moves = []
        while (planned := self._slots.compaction(self.buckets)) is not None:
            source, target = planned
            self.pool.move(source, target)
            self._slots.move(source, target)
            self._frames[target] = self._frames.pop(source)
            moves.append((source, target))
        return moves

    def step(self, frames: Mapping[int, Tensor]) -> dict[int, np.ndarray]:
        """Decodes the frames of codes given for each slot: ``[num_quantizers]`` integers (one
        frame) or ``[n, num_quantizers]`` (``n`` frames, in order), in one batched step.

        Returns each slot's new final samples, float32: ``n * samples_per_frame`` of them, less
        the ``held_back`` of a stream's first frame.
        """
        if not frames:
            return {}
        for slot in frames:
            self._check_slot(slot)
        rows = sorted(frames)
        codes = [self._check_codes(slot, frames[slot]) for slot in rows]
        most = max(len(c) for c in codes)
        steps = next((n for n in self.step_buckets if n >= most), most)
        q = self.model.num_quantizers
        gathered = self.gather and rows != list(range(len(rows)))
        at = list(range(len(rows))) if gathered else rows  # each slot's row of the batch
        batch = len(rows) if gathered else next(b for b in self.buckets if b > rows[-1])
        all_codes = torch.zeros(batch, steps, q, dtype=torch.int64)
        counts = torch.zeros(batch, dtype=torch.int64)
        for row, c in zip(at, codes, strict=True):
            all_codes[row, : len(c)] = c
            counts[row] = len(c)
        device = self.pool.device
        if gathered:
            wav = self.pool.step_rows(rows, all_codes.to(device), counts.to(device))
        else:
            run = self.runners.get(steps, self.pool.step_io)
            wav = run({"codes": all_codes.to(device), "counts": counts.to(device)})["wav"][rows]
        wav = wav.float().cpu().numpy()

        out: dict[int, np.ndarray] = {}
        per_frame, held_back = self.model.samples_per_frame, self.model.held_back
        for row, (slot, c) in enumerate(zip(rows, codes, strict=True)):
            end = len(c) * per_frame
            start = min(end, max(0, held_back - self._frames[slot] * per_frame))
            out[slot] = wav[row, start:end].copy()
            self._frames[slot] += len(c)
        return out

    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or isinstance(slot, bool) or slot not in self._frames:
            raise ValueError(f"unknown code2wav slot {slot!r} (not acquired, or already released)")

    def _check_codes(self, slot: int, codes: Tensor) -> Tensor:
        """The frames of ``slot`` as one ``[n, num_quantizers]`` int64 host tensor, checked."""
        q = self.model.num_quantizers
        codes = torch.as_tensor(codes)
        if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
            raise ValueError(f"code2wav codes for slot {slot} must be integers, got {codes.dtype}")
        if codes.dim() == 1:
            codes = codes[None]
        if codes.dim() != 2 or codes.shape[1] != q or codes.shape[0] < 1:
            raise ValueError(f"code2wav expects {q} codebooks per frame for slot {slot} ([{q}] or "
                             f"[frames, {q}]), got shape {tuple(codes.shape)}")
        codes = codes.to("cpu", torch.int64)
        bad = (codes < 0) | (codes >= self.model.codebook_size)
        if bool(bad.any()):
            low, high = int(codes.min()), int(codes.max())
            size = self.model.codebook_size
            raise ValueError(f"code2wav codes for slot {slot} must lie in [0, {size}), "
                             f"got values in [{low}, {high}]")
        return codes
