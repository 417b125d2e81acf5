"""The engine thread and its asyncio client.

The engine owns the models (through one or more :class:`~omnirt.stages.pipeline.Pipeline`\\ s)
and runs their steps in a thread of its own; the asyncio loop only does I/O. Requests from every
session and HTTP handler go through one :class:`EngineClient`; their outputs come back into
per-request queues with ``loop.call_soon_threadsafe``.

A request's way through:

1. ``submit`` hands it to a small pool of prompt threads (``omnirt-prepare_N``), which route it to
   the pipeline that accepts it and run that pipeline's ``prepare`` (tokenising, audio features,
   image decoding) while the engine thread keeps stepping. Bad input ends there, with a
   ``rejected`` :class:`~omnirt.stages.types.Finished`, and never reaches the engine thread.
2. The prepared request enters the engine's inbox; the engine thread queues it in its pipeline's
   waiting queue (``overloaded`` when that queue is full) and the
   :class:`~omnirt.stages.scheduler.Scheduler` admits and steps it, tick by tick, in the order it
   decides (realtime work by deadline, then batch work in the time left).

Live requests (duplex sessions) keep getting input while they run. Such a request carries a
:class:`~omnirt.stages.live.LiveInput` in its ``input`` attribute, and is started with
:meth:`EngineClient.open`, which returns a :class:`LiveStream`: a :class:`RequestStream` with
``push(pcm)`` and ``end_input()``. The event loop pushes into the input (bounded: past the bound
a push raises :class:`~omnirt.stages.live.InputBackpressure` and keeps nothing), the pipeline
takes frames out of it on the engine thread as it steps, and each push wakes the engine thread
(``LiveInput.on_data`` is the engine's wake-up), so a pipeline whose ``has_work`` waits for input
is stepped as soon as there is some. The input object is the only state the two threads share;
no inbox message is needed per push.

Cancellation is immediate on the client side: once :meth:`RequestStream.cancel` is called the
stream yields its :class:`Finished` (``cancelled``) and nothing after it, whatever the engine
thread still had in flight. A request still being prepared is dropped when its prompt work ends;
a queued or running one at the engine thread's next step boundary. Sinks are called from the
engine thread, a prompt thread, or (for a cancel during prompt work or a shutdown) the caller's
thread; each request's sink receives nothing after its ``Finished``.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import logging
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .live import LiveInput
from .pipeline import CallCounter, Pipeline, Request, RequestRejected
from .scheduler import Scheduler
from .types import (
    AudioDelta,
    Finished,
    ModelInfo,
    Output,
    Started,
    TextDelta,
    ToolCall,
    Usage,
)

log = logging.getLogger(__name__)

Sink = Callable[[Output], None]

#: Threads running ``Pipeline.prepare``.
PREPARE_THREADS = 2
#: Upper bounds (seconds) of the pipeline-step duration histogram (``EngineStats.step_buckets``).
STEP_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


@dataclass
class EngineStats:
    """Counters read by ``/metrics`` and the benchmarks."""

    requests_submitted: int = 0
    requests_finished: int = 0
    requests_cancelled: int = 0
    requests_failed: int = 0
    active: int = 0
    waiting: int = 0
    #: Per pipeline kind: steps and their wall time.
    steps_by_kind: dict[str, int] = field(default_factory=dict)
    step_seconds_by_kind: dict[str, float] = field(default_factory=dict)
    #: Per pipeline kind, its steps by duration: counts per bucket of :data:`STEP_BUCKETS` (the
    #: last one past them all).
    step_buckets: dict[str, list[int]] = field(default_factory=dict)
    #: Per pipeline kind, its batched model calls: ``{(call name, rows): count}`` (the pipeline's
    #: own counter, which it updates as it calls its models).
    model_calls: dict[str, CallCounter] = field(default_factory=dict)
    #: Per pipeline kind that reads prompts: prompt tokens ``read`` and ``cached`` (a reused
    #: prefix, not read again).
    prompt_tokens: dict[str, collections.Counter[str]] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        """Pipeline steps run, all kinds together."""
        return sum(self.steps_by_kind.values())

    @property
    def step_seconds(self) -> float:
        """Wall time spent in pipeline steps, all kinds together."""
        return sum(self.step_seconds_by_kind.values())

    def rows(self, kind: str, call: str) -> collections.Counter[int]:
        """How many calls of model ``call`` of pipeline ``kind`` ran with each number of rows."""
        calls = dict(self.model_calls.get(kind, {}))  # one copy: the engine thread adds keys
        return collections.Counter({rows: n for (name, rows), n in calls.items() if name == call})


class Engine:
    """Runs the pipelines' steps in a dedicated thread while any request is active.

    ``Engine(pipeline)`` for one pipeline, ``Engine([speech, diffusion, ...])`` for several (one
    per kind; the first is the one whose :attr:`info` describes the server)."""

    def __init__(
        self,
        pipelines: Pipeline[Any, Any] | Sequence[Pipeline[Any, Any]],
        *,
        max_waiting: int = 256,
        starvation_limit: float = 1.0,
        batch_slice: float | None = None,
    ) -> None:
        """``max_waiting``: requests that may wait for a slot, per pipeline; ``starvation_limit``,
        ``batch_slice``: see :class:`~omnirt.stages.scheduler.Scheduler`."""
        listed = list(pipelines) if isinstance(pipelines, Sequence) else [pipelines]
        self.scheduler = Scheduler(
            listed,
            max_waiting=max_waiting,
            starvation_limit=starvation_limit,
            batch_slice=batch_slice,
            on_step=self._count_step,
        )
        self.pipelines: dict[str, Pipeline[Any, Any]] = self.scheduler.pipelines
        self.stats = EngineStats(
            steps_by_kind=dict.fromkeys(self.pipelines, 0),
            step_seconds_by_kind=dict.fromkeys(self.pipelines, 0.0),
            step_buckets={kind: [0] * (len(STEP_BUCKETS) + 1) for kind in self.pipelines},
            model_calls={kind: p.calls for kind, p in self.pipelines.items()},
            prompt_tokens={
                kind: p.prompt_tokens for kind, p in self.pipelines.items() if hasattr(p, "prompt_tokens")
            },
        )
        self._cond = threading.Condition()  # guards the inbox, _preparing, _running
        self._stats_lock = threading.Lock()  # counters written from several threads
        self._inbox: collections.deque[tuple[str, Any]] = collections.deque()
        self._preparing: dict[str, Sink] = {}  # request id -> sink, while its prompt work runs
        self._sinks: dict[str, Sink] = {}  # engine thread: requests queued or admitted
        self._running = False
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        for pipeline in self.pipelines.values():
            if hasattr(pipeline, "wake"):  # work finished off this thread (encoding) wakes it
                pipeline.wake = self._wake  # type: ignore[attr-defined]

    @property
    def pipeline(self) -> Pipeline[Any, Any]:
        """The first pipeline."""
        return next(iter(self.pipelines.values()))

    @property
    def info(self) -> ModelInfo:
        return self.pipeline.info

    @property
    def infos(self) -> tuple[ModelInfo, ...]:
        return tuple(p.info for p in self.pipelines.values())

    @property
    def running(self) -> bool:
        return self._thread is not None

    # -- control, from any thread ------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._running = True
        self._thread = threading.Thread(target=self._run, name="omnirt-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stops the engine thread; every request in flight ends with a ``shutdown`` error."""
        with self._cond:
            self._running = False
            preparing = list(self._preparing.values())
            self._preparing.clear()
            pool, self._pool = self._pool, None
            self._cond.notify_all()
        for sink in preparing:
            self._end(sink, Finished("error", Usage(), "server shutting down", "shutdown"))
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        else:  # never started: what was submitted waits in the inbox
            self._shut_down()

    def submit(self, request: Request, sink: Sink) -> None:
        """Start a request; ``sink`` gets each of its outputs, the last one a ``Finished``."""
        rid = request.request_id
        self._count("requests_submitted")
        with self._cond:
            duplicate = rid in self._preparing
            if not duplicate:
                self._preparing[rid] = sink
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="omnirt-prepare")
                self._pool.submit(self._prepare, request, sink)
        if duplicate:
            message = f"request id {rid!r} is already in flight"
            self._end(sink, Finished("error", Usage(), message, "rejected"))

    def _wake(self) -> None:
        """Any thread: the engine thread re-reads what is due (a pipeline has new output ready)."""
        with self._cond:
            self._cond.notify_all()

    def check(self, request: Request) -> None:
        """Validates ``request`` as its pipeline's ``prepare`` does, without starting it; raises
        :class:`RequestRejected`. For work answered before it runs (video jobs): a rejection is
        then the caller's error, not a failed job. Any thread; runs the prepare work once more."""
        kind = self.scheduler.route(request)
        self.pipelines[kind].prepare(request)

    def cancel(self, request_id: str) -> None:
        with self._cond:
            sink = self._preparing.pop(request_id, None)
            if sink is None:  # queued or admitted: the engine thread drops it
                self._inbox.append(("cancel", request_id))
                self._cond.notify_all()
                return
        self._end(sink, Finished("cancelled", Usage()))

    def hold(self, request_id: str, held: bool) -> None:
        """Hold (or release) a request: it takes no steps while held (see ``Pipeline.hold``)."""
        with self._cond:
            self._inbox.append(("hold", (request_id, held)))
            self._cond.notify_all()

    # -- prompt threads ----------------------------------------------------------------------
    def _prepare(self, request: Request, sink: Sink) -> None:
        rid = request.request_id
        with self._cond:
            if self._preparing.get(rid) is not sink:
                return  # cancelled before its prompt work started
        try:
            kind = self.scheduler.route(request)
            prepared = self.pipelines[kind].prepare(request)
        except Exception as exc:
            if isinstance(exc, RequestRejected):
                finished = Finished("error", Usage(), str(exc), "rejected")
            else:  # a bug in prompt code must not take the engine down
                log.exception("prepare failed for %s", rid)
                finished = Finished("error", Usage(), f"internal error: {exc}", "internal")
            if self._claim(rid, sink):
                self._end(sink, finished)
            return
        with self._cond:
            if self._preparing.get(rid) is not sink:
                return  # cancelled (or the engine stopped) during its prompt work
            del self._preparing[rid]
            self._inbox.append(("add", (kind, request, prepared, sink)))
            self._cond.notify_all()

    def _claim(self, request_id: str, sink: Sink) -> bool:
        with self._cond:
            if self._preparing.get(request_id) is not sink:
                return False
            del self._preparing[request_id]
            return True

    # -- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        scheduler = self.scheduler
        while True:
            with self._cond:
                while self._running and not self._inbox:
                    due = scheduler.next_due()
                    if due is None:
                        self._cond.wait()
                        continue
                    delay = due - scheduler.clock()
                    if delay <= 0:
                        break
                    self._cond.wait(delay)
                if not self._running:
                    break
                inbox = list(self._inbox)
                self._inbox.clear()
            for kind, payload in inbox:
                if kind == "add":
                    self._enqueue(*payload)
                elif kind == "hold":
                    scheduler.hold(*payload)
                else:
                    self._cancel(payload)
            scheduler.tick(self._deliver)  # each step's outputs as it ends
            self.stats.active, self.stats.waiting = scheduler.counts()
        self._shut_down()

    def _enqueue(self, kind: str, request: Request, prepared: Any, sink: Sink) -> None:
        try:
            queued = self.scheduler.enqueue(kind, request, prepared)
        except RequestRejected as exc:  # its id is taken by a request in flight
            self._end(sink, Finished("error", Usage(), str(exc), "rejected"))
            return
        if queued:
            self._sinks[request.request_id] = sink
        else:
            self._end(sink, Finished("error", Usage(), f"the {kind} queue is full", "overloaded"))

    def _cancel(self, request_id: str) -> None:
        sink = self._sinks.pop(request_id, None)
        if sink is None:
            return
        usage = self.scheduler.cancel(request_id)
        self._end(sink, Finished("cancelled", usage or Usage()))

    def _deliver(self, request_id: str, output: Output) -> None:
        if isinstance(output, Finished):
            sink = self._sinks.pop(request_id, None)
            if sink is not None:
                self._end(sink, output)
            return
        sink = self._sinks.get(request_id)
        if sink is not None:
            sink(output)

    def _shut_down(self) -> None:
        with self._cond:
            inbox = list(self._inbox)
            self._inbox.clear()
        sinks = [payload[3] for kind, payload in inbox if kind == "add"]
        self.scheduler.remove_all()
        sinks += self._sinks.values()
        self._sinks.clear()
        for sink in sinks:
            self._end(sink, Finished("error", Usage(), "server shutting down", "shutdown"))
        self.stats.active = self.stats.waiting = 0

    # -- stats -------------------------------------------------------------------------------
    def _end(self, sink: Sink, finished: Finished) -> None:
        if finished.reason == "cancelled":
            self._count("requests_cancelled")
        elif finished.reason == "error":
            self._count("requests_failed")
        else:
            self._count("requests_finished")
        sink(finished)

    def _count(self, name: str) -> None:
        with self._stats_lock:
            setattr(self.stats, name, getattr(self.stats, name) + 1)

    def _count_step(self, kind: str, seconds: float) -> None:  # engine thread
        s = self.stats
        s.steps_by_kind[kind] += 1
        s.step_seconds_by_kind[kind] += seconds
        s.step_buckets[kind][bisect.bisect_left(STEP_BUCKETS, seconds)] += 1


class RequestStream:
    """The async side of one request: iterate for outputs; ``cancel()`` ends it at once."""

    def __init__(self, engine: Engine, request: Request) -> None:
        self._engine = engine
        self.request = request
        self.request_id = request.request_id
        self.usage = Usage()
        self._queue: asyncio.Queue[Output] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._done = False
        self._ended = False  # the engine's Finished has come (maybe not read yet)
        self._finished: Finished | None = None

    def _sink(self, output: Output) -> None:  # any thread
        self._loop.call_soon_threadsafe(self._deliver, output)

    def _deliver(self, output: Output) -> None:  # event loop
        if not self._done:
            self._ended = self._ended or isinstance(output, Finished)
            self._queue.put_nowait(output)

    @property
    def finished(self) -> Finished | None:
        return self._finished

    def cancel(self) -> None:
        """Stop the request. The stream's next item is its ``Finished('cancelled')``."""
        if self._done:
            return
        self._engine.cancel(self.request_id)
        self._close(Finished("cancelled", self.usage))

    def shut_down(self) -> bool:
        """End the request as :meth:`Engine.stop` does (its next item is a ``Finished`` error with
        code ``shutdown``), the engine left running: for a server that stops waiting for it. The
        engine drops it as it drops a cancelled one. A no-op (False) once the engine has ended it."""
        if self._done or self._ended:
            return False
        self._engine.cancel(self.request_id)
        self._close(Finished("error", self.usage, "server shutting down", "shutdown"))
        return True

    def hold(self, held: bool) -> None:
        """Hold the request (no more steps until released; for a client that is behind reading)."""
        if not self._done:
            self._engine.hold(self.request_id, held)

    def _close(self, finished: Finished) -> None:
        self._done = True
        self._finished = finished
        # Anything the engine thread delivered but nobody read yet is dropped.
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queue.put_nowait(finished)

    def _account(self, output: Output) -> None:
        u = self.usage
        if isinstance(output, Started):
            u.input_text_tokens = output.usage.input_text_tokens
            u.input_audio_tokens = output.usage.input_audio_tokens
            u.input_image_tokens = output.usage.input_image_tokens
        elif isinstance(output, TextDelta | ToolCall):
            u.output_text_tokens += output.tokens
        elif isinstance(output, AudioDelta):
            u.output_audio_tokens += output.frames

    def __aiter__(self) -> AsyncIterator[Output]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Output]:
        while True:
            output = await self._queue.get()
            if isinstance(output, Finished):
                if not self._done:
                    self._done = True
                    self._finished = output
                yield output
                return
            self._account(output)
            yield output


class LiveStream(RequestStream):
    """The async side of a live request: its outputs, and its input (``push``, ``end_input``)."""

    def __init__(self, engine: Engine, request: Request, live: LiveInput) -> None:
        super().__init__(engine, request)
        self.input = live

    def push(self, pcm: np.ndarray) -> None:
        """Feed mono float32 PCM at :data:`~omnirt.stages.types.SAMPLE_RATE` (any length). Raises
        :class:`~omnirt.stages.live.InputBackpressure` when the bound would be passed (nothing
        kept), ``ValueError`` for a bad array. After the request ended, input is dropped."""
        if self._done or self.input.ended:
            return
        self.input.push(pcm)

    def end_input(self) -> None:
        """No more input: the request ends once it has consumed what it holds."""
        self.input.end()


class EngineClient:
    """What sessions and HTTP handlers hold: submit requests, get async output streams."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        #: Every stream submitted and still referenced (what :meth:`shut_down` ends).
        self._streams: weakref.WeakSet[RequestStream] = weakref.WeakSet()

    @property
    def info(self) -> ModelInfo:
        """The first (speech) pipeline's model."""
        return self.engine.info

    @property
    def infos(self) -> tuple[ModelInfo, ...]:
        """Every pipeline's model, the first one first."""
        return self.engine.infos

    async def check(self, request: Request) -> None:
        """:meth:`Engine.check` on a worker thread: raises :class:`RequestRejected` for input the
        request's pipeline refuses."""
        await asyncio.to_thread(self.engine.check, request)

    def submit(self, request: Request) -> RequestStream:
        """Start a request; must be called from the event loop."""
        stream = RequestStream(self.engine, request)
        self._streams.add(stream)
        self.engine.submit(request, stream._sink)
        return stream

    def open(self, request: Request) -> LiveStream:
        """Start a live request (one with a :class:`~omnirt.stages.live.LiveInput` in its
        ``input``); feed it through the returned stream. Must be called from the event loop."""
        live = getattr(request, "input", None)
        if not isinstance(live, LiveInput):
            raise TypeError(f"{type(request).__name__} has no LiveInput in 'input': use submit()")
        live.on_data = self.engine._wake
        stream = LiveStream(self.engine, request, live)
        self._streams.add(stream)
        self.engine.submit(request, stream._sink)
        return stream

    def shut_down(self) -> int:
        """End every request still running with the ``shutdown`` error (:meth:`RequestStream.shut_down`),
        the engine left running: the server is stopping and waits for them no longer (HTTP clients
        then get their 503). Returns how many were ended. Must be called from the event loop."""
        return sum(stream.shut_down() for stream in list(self._streams))

    def serves(self, kind: str) -> bool:
        """Whether a pipeline of ``kind`` (``"duplex"``, ...) is loaded."""
        return kind in self.engine.pipelines
