"""Fake pipelines of the other kinds, for the scheduler and multi-pipeline engine tests.

:class:`FramePipeline` is realtime with a frame clock (a duplex stand-in): each active request gets
one frame per step, and the next step is due one ``period`` after the last was due.
:class:`JobPipeline` is batch (a diffusion stand-in): each step advances every job by one of its
steps and costs ``cost`` seconds. Both spend time through a clock, real or simulated.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass

from omnirt.stages.pipeline import CallCounter, Priority, RequestRejected
from omnirt.stages.types import Finished, ModelInfo, Output, TextDelta, Usage


class RealClock:
    def now(self) -> float:
        return time.monotonic()

    def spend(self, seconds: float) -> None:
        time.sleep(seconds)


class FakeClock:
    """Simulated time: ``spend`` advances it, nothing sleeps."""

    def __init__(self) -> None:
        self.t = 100.0

    def now(self) -> float:
        return self.t

    def spend(self, seconds: float) -> None:
        self.t += seconds


@dataclass
class FrameRequest:
    request_id: str
    frames: int = 10


@dataclass
class JobRequest:
    request_id: str
    steps: int = 3


def _info(kind: str) -> ModelInfo:
    return ModelInfo(id=f"{kind}-test", architecture=kind, random_weights=True, source="tests")


class _Fake:
    kind: str
    priority: Priority

    def __init__(self, clock: RealClock | FakeClock, request_type: type, *, slots: int, cost: float) -> None:
        self.clock = clock
        self.request_type = request_type
        self.slots = slots
        self.cost = cost
        self.info = _info(self.kind)
        self.calls: CallCounter = collections.Counter()
        self.left: dict[str, int] = {}  # request id -> steps still to run
        self.done: dict[str, int] = {}
        self.added: list[str] = []
        self.removed: list[str] = []
        self.prepare_threads: list[str] = []
        #: When set, ``step`` raises.
        self.explode = False

    def accepts(self, request: object) -> bool:
        return isinstance(request, self.request_type)

    def prepare(self, request: FrameRequest | JobRequest) -> int:
        self.prepare_threads.append(threading.current_thread().name)
        count = request.frames if isinstance(request, FrameRequest) else request.steps
        if count < 1:
            raise RequestRejected("nothing to do")
        return count

    def can_add(self) -> bool:
        return len(self.left) < self.slots

    def add(self, request: FrameRequest | JobRequest, prepared: int) -> None:
        self.left[request.request_id] = prepared
        self.done[request.request_id] = 0
        self.added.append(request.request_id)

    def has_work(self) -> bool:
        return bool(self.left)

    def step_cost(self) -> float:
        return self.cost

    def step(self) -> list[tuple[str, Output]]:
        if self.explode:
            raise RuntimeError(f"{self.kind} boom")
        self.calls[self.kind, len(self.left)] += 1
        self.clock.spend(self.cost)
        out: list[tuple[str, Output]] = []
        for rid in list(self.left):
            self.done[rid] += 1
            self.left[rid] -= 1
            out.append((rid, TextDelta(f"{self.kind} {self.done[rid]}")))
            if not self.left[rid]:
                del self.left[rid]
                out.append((rid, Finished("stop", Usage(output_text_tokens=self.done[rid]))))
        return out

    def remove(self, request_id: str) -> Usage | None:
        self.removed.append(request_id)
        if self.left.pop(request_id, None) is None:
            return None
        return Usage(output_text_tokens=self.done[request_id])


class FramePipeline(_Fake):
    kind = "duplex"
    priority = Priority.REALTIME

    def __init__(
        self, clock: RealClock | FakeClock, *, period: float = 0.08, cost: float = 0.01, slots: int = 8
    ) -> None:
        super().__init__(clock, FrameRequest, slots=slots, cost=cost)
        self.period = period
        self.due: float | None = None
        #: How late each step started after it was due.
        self.lateness: list[float] = []

    def add(self, request: FrameRequest, prepared: int) -> None:  # type: ignore[override]
        super().add(request, prepared)
        if self.due is None:
            self.due = self.clock.now()

    def next_deadline(self) -> float | None:
        return self.due

    def step(self) -> list[tuple[str, Output]]:
        assert self.due is not None
        self.lateness.append(self.clock.now() - self.due)
        self.due += self.period
        out = super().step()
        if not self.left:
            self.due = None
        return out


class JobPipeline(_Fake):
    kind = "diffusion"
    priority = Priority.BATCH

    def __init__(self, clock: RealClock | FakeClock, *, cost: float = 0.2, slots: int = 4) -> None:
        super().__init__(clock, JobRequest, slots=slots, cost=cost)

    def next_deadline(self) -> float | None:
        return None
