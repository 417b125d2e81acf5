"""The engine thread and its asyncio client.

The engine owns the models (through a :class:`~omnirt.stages.pipeline.Pipeline`) and runs the
scheduler loop in a thread of its own; the asyncio loop only does I/O. Requests from every
session and HTTP handler go through one :class:`EngineClient`; their outputs come back into
per-request queues with ``loop.call_soon_threadsafe``.

Cancellation is immediate on the client side: once :meth:`RequestStream.cancel` is called the
stream yields its :class:`Finished` (``cancelled``) and nothing after it, whatever the engine
thread still had in flight. The engine drops the request at its next step boundary.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from .pipeline import Pipeline, RequestRejected
from .types import (
    AudioDelta,
    ErrorCode,
    Finished,
    GenerationRequest,
    ModelInfo,
    Output,
    Started,
    TextDelta,
    Usage,
)

log = logging.getLogger(__name__)

Sink = Callable[[Output], None]


@dataclass
class EngineStats:
    """Counters read by ``/metrics`` and the benchmarks (written by the engine thread only)."""

    steps: int = 0
    step_seconds: float = 0.0
    requests_submitted: int = 0
    requests_finished: int = 0
    requests_cancelled: int = 0
    requests_failed: int = 0
    active: int = 0
    waiting: int = 0
    batch_sizes: collections.Counter[int] = field(default_factory=collections.Counter)


class Engine:
    """Runs ``pipeline.step()`` in a dedicated thread while any request is active."""

    def __init__(self, pipeline: Pipeline, *, max_waiting: int = 256) -> None:
        self.pipeline = pipeline
        self.max_waiting = max_waiting
        self.stats = EngineStats()
        self._cond = threading.Condition()
        self._inbox: collections.deque[tuple[str, object]] = collections.deque()
        self._waiting: collections.deque[tuple[GenerationRequest, Sink]] = collections.deque()
        self._sinks: dict[str, Sink] = {}
        self._running = False
        self._thread: threading.Thread | None = None

    @property
    def info(self) -> ModelInfo:
        return self.pipeline.info

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
        with self._cond:
            self._running = False
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def submit(self, request: GenerationRequest, sink: Sink) -> None:
        """Queue a request; ``sink`` is called from the engine thread with each output."""
        with self._cond:
            self._inbox.append(("add", (request, sink)))
            self._cond.notify_all()

    def cancel(self, request_id: str) -> None:
        with self._cond:
            self._inbox.append(("cancel", request_id))
            self._cond.notify_all()

    # -- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while self._running and not self._inbox and not self._has_work():
                    self._cond.wait()
                if not self._running:
                    break
                inbox = list(self._inbox)
                self._inbox.clear()
            for kind, payload in inbox:
                if kind == "add":
                    request, sink = payload  # type: ignore[misc]
                    self._enqueue(request, sink)
                else:
                    self._cancel(payload)  # type: ignore[arg-type]
            self._admit()
            if self.pipeline.has_work():
                self._step()
        self._fail_all("server shutting down", "shutdown")

    def _has_work(self) -> bool:
        return self.pipeline.has_work() or (bool(self._waiting) and self.pipeline.can_add())

    def _enqueue(self, request: GenerationRequest, sink: Sink) -> None:
        self.stats.requests_submitted += 1
        if len(self._waiting) >= self.max_waiting:
            sink(Finished("error", Usage(), "engine queue is full", "overloaded"))
            self.stats.requests_failed += 1
            return
        self._waiting.append((request, sink))
        self.stats.waiting = len(self._waiting)

    def _admit(self) -> None:
        while self._waiting and self.pipeline.can_add():
            request, sink = self._waiting.popleft()
            try:
                self.pipeline.add(request)
            except RequestRejected as exc:
                sink(Finished("error", Usage(), str(exc), "rejected"))
                self.stats.requests_failed += 1
                continue
            except Exception as exc:  # a model bug must not take the engine down
                log.exception("pipeline.add failed for %s", request.request_id)
                sink(Finished("error", Usage(), f"internal error: {exc}", "internal"))
                self.stats.requests_failed += 1
                continue
            self._sinks[request.request_id] = sink
        self.stats.waiting = len(self._waiting)
        self.stats.active = len(self._sinks)

    def _cancel(self, request_id: str) -> None:
        for i, (request, sink) in enumerate(self._waiting):
            if request.request_id == request_id:
                del self._waiting[i]
                sink(Finished("cancelled", Usage()))
                self.stats.requests_cancelled += 1
                return
        sink = self._sinks.pop(request_id, None)
        if sink is None:
            return
        usage = self.pipeline.remove(request_id)
        sink(Finished("cancelled", usage or Usage()))
        self.stats.requests_cancelled += 1
        self.stats.active = len(self._sinks)

    def _step(self) -> None:
        t0 = time.perf_counter()
        self.stats.batch_sizes[len(self._sinks)] += 1
        try:
            outputs = self.pipeline.step()
        except Exception as exc:
            log.exception("pipeline step failed; failing its active requests")
            for request_id in list(self._sinks):
                self.pipeline.remove(request_id)
            self._fail_all(f"internal error: {exc}", "internal")
            return
        finally:
            self.stats.steps += 1
            self.stats.step_seconds += time.perf_counter() - t0
        for request_id, output in outputs:
            sink = self._sinks.get(request_id)
            if sink is None:
                continue
            if isinstance(output, Finished):
                del self._sinks[request_id]
                if output.reason == "error":
                    self.stats.requests_failed += 1
                else:
                    self.stats.requests_finished += 1
            sink(output)
        self.stats.active = len(self._sinks)

    def _fail_all(self, message: str, code: ErrorCode) -> None:
        for sink in self._sinks.values():
            sink(Finished("error", Usage(), message, code))
        self.stats.requests_failed += len(self._sinks)
        self._sinks.clear()
        while self._waiting:
            _, sink = self._waiting.popleft()
            sink(Finished("error", Usage(), message, code))
        self.stats.active = self.stats.waiting = 0


class RequestStream:
    """The async side of one request: iterate for outputs; ``cancel()`` ends it at once."""

    def __init__(self, engine: Engine, request: GenerationRequest) -> None:
        self._engine = engine
        self.request = request
        self.request_id = request.request_id
        self.usage = Usage()
        self._queue: asyncio.Queue[Output] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._done = False
        self._finished: Finished | None = None

    def _sink(self, output: Output) -> None:  # engine thread
        self._loop.call_soon_threadsafe(self._deliver, output)

    def _deliver(self, output: Output) -> None:  # event loop
        if not self._done:
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
        elif isinstance(output, TextDelta):
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


class EngineClient:
    """What sessions and HTTP handlers hold: submit requests, get async output streams."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @property
    def info(self) -> ModelInfo:
        return self.engine.info

    def submit(self, request: GenerationRequest) -> RequestStream:
        """Start a request; must be called from the event loop."""
        stream = RequestStream(self.engine, request)
        self.engine.submit(request, stream._sink)
        return stream
