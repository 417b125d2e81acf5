"""What the engine needs of a model pipeline.

A pipeline holds one family of models (speech, duplex, diffusion) and the per-request GPU state
(slots) of the requests it serves. Several pipelines share one engine; the
:class:`~omnirt.stages.scheduler.Scheduler` decides which of them runs at each tick.

The life of a request:

1. ``accepts(request)`` routes it: each request type is served by one pipeline.
2. ``prepare(request)`` does the CPU prompt work (validation, tokenising, audio features, image
   decoding) on a worker thread, off the engine thread, and returns an opaque prepared value
   for ``add``. Bad input raises :class:`RequestRejected`. It must not touch slot or GPU state,
   since the engine thread may be running ``step`` at the same time.
3. The request then waits in its pipeline's own queue until ``can_add()``; ``add(request,
   prepared)`` takes its slot (engine thread).
4. ``step`` advances every admitted request of the pipeline by one tick (batched into shared
   model calls) and returns their outputs. A request ends when ``step`` returns a
   :class:`~omnirt.stages.types.Finished` for it; the pipeline has then already freed its state.
   ``remove`` drops a request at once (cancel, or its pipeline's step failed), freeing its slot.

The scheduler orders the work by ``priority``, ``next_deadline()`` and ``step_cost()``, and each
pipeline counts its batched model calls in ``calls`` (``/metrics``, benchmarks, tests).
Everything but ``accepts`` and ``prepare`` is called from the engine thread only.
"""

from __future__ import annotations

import collections
import enum
import time
from typing import Any, Protocol, TypeVar

import torch

from .types import ModelInfo, Usage


class RequestRejected(ValueError):
    """The request cannot run (bad input, over a limit). The message is shown to the client."""


class Priority(enum.Enum):
    """A pipeline's scheduling class."""

    #: Steps run when due (deadline ordered); others wait for them.
    REALTIME = "realtime"
    #: Steps fill the time left before the next realtime deadline (diffusion).
    BATCH = "batch"


class Request(Protocol):
    """What the engine needs of any request: an id unique among the requests in flight.

    A request may also have a ``background`` attribute: when true, nobody waits to hear it
    (input transcription), and its pipeline admits it after every waiting request without one."""

    @property
    def request_id(self) -> str: ...


def is_background(request: Request) -> bool:
    return bool(getattr(request, "background", False))


def runs_early(pipeline: object) -> bool:
    """See :meth:`Pipeline.next_deadline`."""
    return bool(getattr(pipeline, "runs_early", False))


Req = TypeVar("Req", bound=Request, contravariant=True)
Out = TypeVar("Out", covariant=True)

#: Batched model calls of a pipeline: ``calls[name, rows] += 1`` for each call of model ``name``
#: over ``rows`` requests (a prefill of one prompt is one row).
CallCounter = collections.Counter[tuple[str, int]]


class Pipeline(Protocol[Req, Out]):
    #: Names the pipeline in the scheduler, stats and metrics: "speech", "duplex", "diffusion".
    kind: str
    priority: Priority
    info: ModelInfo
    calls: CallCounter

    def accepts(self, request: object) -> bool:
        """True for the request types this pipeline serves (any thread; no side effects)."""
        ...

    def prepare(self, request: Req) -> Any:
        """Prompt work off the engine thread; raises :class:`RequestRejected` for bad input.
        The result goes to :meth:`add` unchanged."""
        ...

    def can_add(self) -> bool:
        """True when a slot is free for one more request."""
        ...

    def add(self, request: Req, prepared: Any) -> None:
        """Admit a prepared request into a slot; raises :class:`RequestRejected` when it cannot
        (the request then holds nothing)."""
        ...

    def has_work(self) -> bool: ...

    def next_deadline(self) -> float | None:
        """``time.monotonic()`` at which the next step is due; None: no deadline, as soon as
        possible. Only asked while ``has_work()``. A realtime pipeline whose steps may also run
        before their deadline (turn-based speech: audio ahead of playback) says so with a
        ``runs_early = True`` attribute: the scheduler then steps it at once whenever no batch
        work is waiting, and keeps its deadline only to fit batch steps in before it."""
        ...

    def step_cost(self) -> float:
        """Estimated seconds of the next step (e.g. a moving average of measured steps)."""
        ...

    def step(self) -> list[tuple[str, Out]]:
        """One tick: advance all admitted requests; outputs tagged by request id, in order."""
        ...

    def remove(self, request_id: str) -> Usage | None:
        """Drop a request now (cancel). Returns its usage so far, or None if unknown."""
        ...

    # Optional: ``hold(request_id, held: bool) -> None``. A held request takes no steps (and
    # counts for neither ``has_work`` nor ``next_deadline``) until released, its state kept: the
    # engine holds the requests of a realtime client that has fallen behind reading what they
    # made, so a client that does not read gets no compute (see :func:`can_hold`).
    #
    # Optional, for batch pipelines whose steps are pieces of longer work: ``fit(seconds: float |
    # None) -> None`` sizes the next step to at most ``seconds`` where it can (None: its own
    # size); ``step_cost()`` then says what that step takes. It holds until the next ``step()`` or
    # ``fit()``. The scheduler fits each batch step to the time before the next realtime deadline
    # (see :func:`can_fit`).


def can_fit(pipeline: object) -> bool:
    """Whether ``pipeline`` can size its next step to a time (the optional ``fit`` of
    :class:`Pipeline`)."""
    return callable(getattr(pipeline, "fit", None))


class StepTimer:
    """Exponential moving average of a pipeline's measured step times: its ``step_cost()``."""

    def __init__(self, alpha: float = 0.2) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        #: 0 until the first step is measured.
        self.seconds = 0.0
        self._measured = False

    def record(self, seconds: float) -> None:
        if self._measured:
            self.seconds += self.alpha * (seconds - self.seconds)
        else:
            self.seconds, self._measured = seconds, True


class PhaseTimes:
    """Host seconds a pipeline's steps spent in each named phase, summed until :meth:`take`
    (benchmarks read it to see which phase of a tick holds the host: launching, or waiting for
    the device at a sync). ``begin(name)`` ends the phase running and starts ``name``; ``end()``
    ends it. Two clock reads a phase, cheap enough to stay on; while ``torch.profiler`` records,
    each phase is also a ``record_function`` range, so its kernels' GPU time can be told apart."""

    def __init__(self) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()
        self._phase: str | None = None
        self._t = 0.0
        self._range: Any = None

    def begin(self, phase: str) -> None:
        self.end()
        self._phase, self._t = phase, time.perf_counter()
        if torch.autograd.profiler._is_profiler_enabled:
            self._range = torch.profiler.record_function(phase)
            self._range.__enter__()

    def end(self) -> None:
        if self._phase is None:
            return
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        self.seconds[self._phase] += time.perf_counter() - self._t
        self._phase = None

    def take(self) -> collections.Counter[str]:
        taken, self.seconds = self.seconds, collections.Counter()
        return taken


def can_hold(pipeline: object) -> bool:
    """Whether ``pipeline`` can hold requests (the optional ``hold`` of :class:`Pipeline`)."""
    return callable(getattr(pipeline, "hold", None))
