"""The native full-duplex pipeline: Moshi-style conversations in 80 ms lockstep.

Each admitted :class:`~.types.DuplexRequest` holds one slot (the lowest free one, from the one
slot allocator, :class:`~omnirt.codecs.streaming.SlotAllocator`) in the LM and in a
:class:`~omnirt.codecs.mimi.MimiSlotPool`; rows of every batched call are slots ``0..B-1``, ``B``
one past the highest busy slot, with an exec mask ``active [B]``. The LM and the Mimi pool pad
``B`` to their own batch buckets (their CUDA graphs); on CPU the pipeline gives Mimi at least
``CPU_MIN_ROWS`` rows, as the LM does for itself, since MKL's small-batch kernels would move
a row's last bits with the batch size (so a session's output is bitwise the same alone and in
a batch on CPU, and at the same bucket on CUDA).

Compaction: when sessions leave from the middle (``remove``, or the end of their input), the
batch would still cover the highest busy slot. So whenever the batch bucket that covers the busy
slots is larger than the bucket the busy count needs, the highest sessions move down into the
lowest free slots (:meth:`SlotAllocator.compaction`; ``lm.move`` and ``pool.move`` copy their
state rows in place on the device) until it is not: one session left in slot 63 of 64 goes on in
slot 0, at the smallest bucket. Moves happen on the engine thread between batched calls, and a
moved session's stream is exactly what it would have been in its old slot (bitwise on CPU; on
CUDA at the same bucket: graphs of another bucket may round differently).

The clock: a step is due one frame period (80 ms; configurable) after the last one was due, so
the cadence does not drift with scheduling delays; after an idle pause (no session had input) or
a step late by a whole period, the cadence restarts at the step. Each step advances every
admitted session that has a whole frame (1920 samples) of input waiting, one frame each, in one
batched call per model, with no host sync between them:

1. Mimi encode of the input frames -> the LM's ``K`` codebooks of user audio;
2. ``lm.step`` (temporal + depth transformers): one text token and one frame of model codes per row;
3. Mimi decode of the rows whose codes are ready (a slot's first step has none: acoustic delay).

Sessions whose input is late (less than a frame waiting) and held sessions (a client behind
reading, see ``hold``) are masked off: their state does not move, the others' tick is not
delayed. Per stepped session the step yields a :class:`TextDelta` when its text token is not
padding and completed some text (incremental detokenisation), then an :class:`AudioDelta` of one
80 ms frame (int16; silence for the delay frame, so output frames match input frames one to one)
whose ``text_chars`` counts the session's text so far. :class:`Started` comes at admission. Once a
session's input has ended (``LiveInput.end``) and been consumed (the last partial frame padded
with zeros) it ends with ``Finished("stop")``. A conversation has no length limit: the LM
attends to a window of its last ``max_frames`` frames (see ``lm.py``).
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from omnirt.codecs.audio import float_to_int16
from omnirt.codecs.mimi import MimiSlotPool, StreamingMimi
from omnirt.codecs.streaming import SlotAllocator

from ..codec_graphs import capture_mimi
from ..live import LiveInput
from ..pipeline import CallCounter, Priority, RequestRejected, StepTimer
from ..speech.detok import IncrementalDetokenizer
from ..types import AudioDelta, Finished, ModelInfo, Output, Started, TextDelta, Usage
from .lm import CPU_MIN_ROWS
from .types import DuplexRequest

if TYPE_CHECKING:
    from .lm import DuplexLM, DuplexSampling

log = logging.getLogger(__name__)

#: Seconds of audio per frame of the Moshi architecture (12.5 Hz).
FRAME_SECONDS = 0.08


@dataclass(eq=False)
class _Session:
    request: DuplexRequest
    slot: int
    detok: IncrementalDetokenizer
    usage: Usage = field(default_factory=Usage)
    text_chars: int = 0
    started: bool = False
    held: bool = False

    @property
    def input(self) -> LiveInput:
        return self.request.input


class DuplexPipeline:
    kind = "duplex"
    priority = Priority.REALTIME

    def __init__(
        self,
        lm: DuplexLM,
        mimi: StreamingMimi,
        tokenizer: Any,
        *,
        info: ModelInfo,
        sampling: DuplexSampling,
        frame_seconds: float = FRAME_SECONDS,
        cuda_graphs: bool = True,
    ) -> None:
        """``lm``: the duplex LM (its ``max_slots`` sizes every pool); ``mimi``: a streaming Mimi
        with the LM's ``num_codebooks`` quantizers; ``tokenizer``: the LM's text tokenizer;
        ``sampling``: what requests without their own get; ``frame_seconds``: the tick period
        (tests run faster than real time); ``cuda_graphs``: capture the LM's and Mimi's steps at
        start when on CUDA."""
        if mimi.num_quantizers != lm.num_codebooks:
            raise ValueError(
                f"Mimi has {mimi.num_quantizers} quantizers, the LM {lm.num_codebooks} codebooks: "
                "build Mimi with num_quantizers=lm.num_codebooks"
            )
        if frame_seconds <= 0:
            raise ValueError(f"frame_seconds must be positive, got {frame_seconds}")
        self.lm = lm
        self.tokenizer = tokenizer
        self.info = info
        self.sampling = sampling
        self.period = frame_seconds
        self.max_slots = lm.max_slots
        self.frame = mimi.frame_size
        self.pool = MimiSlotPool(mimi, lm.max_slots, check_codes=False)
        self.device = self.pool.device
        #: Fewest rows of a Mimi call (see the module doc).
        self.min_rows = 1 if self.device.type == "cuda" else min(CPU_MIN_ROWS, lm.max_slots)
        self.calls: CallCounter = collections.Counter()
        self.timer = StepTimer()
        self.clock = time.monotonic
        self._slots = SlotAllocator(lm.max_slots)
        #: The batch sizes the calls run at (the LM's buckets, Mimi's above ``min_rows``):
        #: compaction moves sessions while the busy slots' bucket exceeds the busy count's.
        self.buckets = sorted(set(lm.buckets) | {b for b in self.pool.buckets if b >= self.min_rows})
        self._sessions: dict[str, _Session] = {}
        #: When the next step is due (None: at once).
        self._due: float | None = None
        if cuda_graphs and self.device.type == "cuda":
            self.capture()

    def capture(self) -> None:
        """Captures the LM's and Mimi's one-frame steps as CUDA graphs (idle pipeline only)."""
        if self._sessions:
            raise RuntimeError("capture needs an idle pipeline")
        self.lm.capture()
        capture_mimi(self.pool)

    # -- admission ---------------------------------------------------------------------------
    def accepts(self, request: object) -> bool:
        return isinstance(request, DuplexRequest)

    def prepare(self, request: DuplexRequest) -> None:
        if not isinstance(request.input, LiveInput):
            raise RequestRejected("a duplex request needs a LiveInput (open it with EngineClient.open)")
        return None

    def can_add(self) -> bool:
        return len(self._slots) > 0

    @property
    def free_slots(self) -> int:
        return len(self._slots)

    def add(self, request: DuplexRequest, prepared: Any = None) -> None:
        rid = request.request_id
        if rid in self._sessions:
            raise RequestRejected(f"request id {rid!r} is already in flight")
        if not self._slots:
            raise RequestRejected("no free duplex slot")
        slot = self._slots.take()
        try:
            self.lm.start(slot, request.sampling or self.sampling)
        except ValueError as exc:
            self._slots.give(slot)
            raise RequestRejected(str(exc)) from None
        self.pool.reset(slot)
        self._sessions[rid] = _Session(request, slot, IncrementalDetokenizer(self.tokenizer))
        log.debug("duplex %s: slot %d", rid, slot)

    def hold(self, request_id: str, held: bool) -> None:
        session = self._sessions.get(request_id)
        if session is not None:
            session.held = held

    def remove(self, request_id: str) -> Usage | None:
        session = self._sessions.pop(request_id, None)
        if session is None:
            return None
        self._free(session)
        self.compact()
        return session.usage

    def _free(self, session: _Session) -> None:
        self.lm.stop(session.slot)
        self._slots.give(session.slot)

    # -- compaction --------------------------------------------------------------------------
    def move(self, request_id: str, slot: int) -> None:
        """Moves a live session into free slot ``slot`` (its LM and Mimi state, in place on the
        device); its stream goes on as it would have in its old slot. Engine thread, between
        steps. ValueError, nothing changed, for an unknown session or a slot that is not free."""
        session = self._sessions.get(request_id)
        if session is None:
            raise ValueError(f"no duplex session {request_id!r}")
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.max_slots:
            raise ValueError(f"slot must be an int in [0, {self.max_slots}), got {slot!r}")
        if slot in self._slots:
            raise ValueError(f"cannot move session {request_id!r} to slot {slot}: it is in use")
        source = session.slot
        self.lm.move(source, slot)
        self.pool.move(source, slot)
        self._slots.move(source, slot)
        session.slot = slot
        self.calls["move", 1] += 1
        log.debug("duplex %s: slot %d -> %d", request_id, source, slot)

    def compact(self) -> int:
        """Moves the highest sessions into the lowest free slots while the batch bucket that
        covers the busy slots is larger than the one the busy count needs; the moves made."""
        moves = 0
        while (planned := self._slots.compaction(self.buckets)) is not None:
            source, target = planned
            rid = next(rid for rid, s in self._sessions.items() if s.slot == source)
            self.move(rid, target)
            moves += 1
        return moves

    # -- scheduling --------------------------------------------------------------------------
    def _due_now(self, s: _Session) -> bool:
        """Whether ``s`` has something for the next step: its start, a frame, or its end."""
        if not s.started:
            return True
        if s.held:
            return False
        return s.input.ready(self.frame) or s.input.drained()

    def has_work(self) -> bool:
        return any(self._due_now(s) for s in self._sessions.values())

    def next_deadline(self) -> float | None:
        return self._due

    def step_cost(self) -> float:
        return self.timer.seconds

    def _advance_clock(self) -> None:
        now = self.clock()
        due = self._due
        base = due if due is not None and now - due < self.period else now
        self._due = base + self.period

    # -- the tick ----------------------------------------------------------------------------
    def step(self) -> list[tuple[str, Output]]:
        t0 = time.perf_counter()
        out: list[tuple[str, Output]] = []
        stepping: list[_Session] = []
        ended = False
        for rid, s in list(self._sessions.items()):
            if not s.started:
                s.started = True
                out.append((rid, Started(Usage())))
            if s.held:
                continue
            if s.input.ready(self.frame):
                stepping.append(s)
            elif s.input.drained():
                out.append((rid, self._end(rid)))
                ended = True
        if ended:
            self.compact()  # before the batched calls: the stepping sessions' slots may change
        if stepping:
            self._advance_clock()
            out += self._frames(stepping)
            self.timer.record(time.perf_counter() - t0)
        return out

    def _end(self, request_id: str) -> Finished:
        """The session's input ended and was all consumed (text bytes the detokenizer still holds
        back, an unfinished character, are dropped: no frame follows to carry them)."""
        session = self._sessions.pop(request_id)
        self._free(session)
        return Finished("stop", session.usage)

    @torch.no_grad()
    def _frames(self, stepping: list[_Session]) -> list[tuple[str, Output]]:
        rows = max(self._slots.rows(), self.min_rows)
        audio = np.zeros((rows, self.frame), dtype=np.float32)
        active = torch.zeros(rows, dtype=torch.bool)
        ready = torch.zeros(rows, dtype=torch.bool)  # the LM gives a whole frame (not a first step)
        for s in stepping:
            pcm = s.input.take(self.frame)
            assert pcm is not None  # ready() said so, and only this thread takes
            audio[s.slot] = pcm
            active[s.slot] = True
            ready[s.slot] = self.lm.frames(s.slot) > 0
        n, speaking = len(stepping), int(ready.sum())
        busy = self._slots.rows()  # the LM pads to its own buckets
        codes = self.pool.encode(torch.from_numpy(audio).to(self.device), active.to(self.device))
        self.calls["mimi_encode", n] += 1
        result = self.lm.step(codes[:busy, :, 0], active[:busy])
        self.calls["lm", n] += 1
        self.calls["lm_rows", busy] += 1
        decoded = None
        if speaking:
            ready_dev = ready.to(self.device)
            model_codes = codes.new_zeros((rows, self.lm.num_codebooks, 1))
            # rows without a frame hold whatever (BOS codes, an idle row's garbage): zeros instead
            model_codes[:busy, :, 0] = torch.where(ready_dev[:busy, None], result.audio, 0)
            decoded = self.pool.decode(model_codes, ready_dev).cpu().numpy()
            self.calls["mimi_decode", speaking] += 1
        text = result.text.cpu().tolist()
        pads = self.lm.text_pad_ids
        out: list[tuple[str, Output]] = []
        for s in stepping:
            rid = s.request.request_id
            s.usage.input_audio_tokens += 1
            token = int(text[s.slot])
            if token not in pads:
                s.usage.output_text_tokens += 1
                piece = s.detok.push(token)
                if piece:
                    s.text_chars += len(piece)
                    out.append((rid, TextDelta(piece)))
            if decoded is not None and bool(ready[s.slot]):
                pcm = float_to_int16(decoded[s.slot])
                s.usage.output_audio_tokens += 1
            else:
                pcm = np.zeros(self.frame, dtype=np.int16)
            out.append((rid, AudioDelta(pcm, s.text_chars)))
        return out

    # -- introspection (tests, metrics) ------------------------------------------------------
    def slot_of(self, request_id: str) -> int | None:
        session = self._sessions.get(request_id)
        return None if session is None else session.slot
