"""The VAD worker: one thread scoring every session's pending windows with batched ONNX calls.

Sessions push windows from the event loop (:meth:`VadStream.push`); the worker wakes, waits
``gather_ms`` (2 ms) for more sessions' windows, takes the oldest pending window of
every stream that has one, runs them as one batch (a stream's windows depend on each other
through the model state, so one window per stream per call), and repeats until nothing is
pending. Results go back to each stream's event loop once per drain (at least every 5 ms), where
the session's endpointer runs; while the loop has not yet run a hand-back, later results join it
instead of waking the loop again. The model runs with one onnxruntime thread, so the worker
costs at most one core.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import logging
import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from .model import SileroModel, VadInitError
from .stream import ResultCallback, VadStream

log = logging.getLogger(__name__)

Result = tuple[VadStream, int, float, float]

#: While working off a long backlog, results go back to the loop at least this often.
POST_EVERY_S = 0.005


@dataclass
class VadStats:
    """Counters for ``/metrics`` and the benchmark (latencies are written on the event loop)."""

    windows: int = 0
    batches: int = 0
    busy_seconds: float = 0.0
    #: Seconds from the arrival of the chunk that completed a window to its endpointing decision.
    latencies: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=1_000_000))

    @property
    def mean_batch(self) -> float:
        return self.windows / self.batches if self.batches else 0.0

    def reset(self) -> None:
        self.windows = self.batches = 0
        self.busy_seconds = 0.0
        self.latencies.clear()


class VadWorker:
    """Owns the Silero model (loaded on first use) and the thread that runs it."""

    def __init__(
        self,
        model_path: str | os.PathLike[str] | None = None,
        *,
        max_batch: int = 256,
        gather_ms: float = 2.0,
    ) -> None:
        self.model_path = model_path
        self.max_batch = max_batch
        #: After waking, wait this long for other sessions' windows so they share the ONNX call
        #: (fewer, larger calls: less CPU per window, for at most this much added latency).
        self.gather_s = gather_ms / 1000
        self.stats = VadStats()
        self._model: SileroModel | None = None
        self._load_lock = threading.Lock()
        self._cond = threading.Condition()
        self._ready: dict[int, VadStream] = {}
        #: Results handed to a loop whose delivery has not run yet (guarded by ``_post_lock``).
        self._outbox: dict[asyncio.AbstractEventLoop, list[Result]] = {}
        self._post_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._running = False

    def load(self) -> SileroModel:
        """The model, loading it now if needed; raises :class:`VadInitError` (and retries next time)."""
        with self._load_lock:
            if self._model is None:
                self._model = SileroModel(self.model_path)
            return self._model

    def open_stream(self, on_result: ResultCallback) -> VadStream:
        """A new stream (fresh model state); raises :class:`VadInitError` when the model cannot load."""
        self.load()
        self._start()
        return VadStream(self, on_result)

    def notify(self, stream: VadStream) -> None:
        with self._cond:
            self._ready[id(stream)] = stream
            self._cond.notify()

    def _start(self) -> None:
        with self._cond:
            if self._thread is not None:
                return
            self._running = True
            self._thread = threading.Thread(target=self._run, name="omnirt-vad", daemon=True)
            self._thread.start()
        # A daemon thread inside onnxruntime at interpreter exit aborts the process.
        atexit.register(self.stop)

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._running = False
            self._cond.notify_all()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)

    # -- the worker thread -------------------------------------------------------------------
    def _run(self) -> None:
        assert self._model is not None
        while True:
            with self._cond:
                while self._running and not self._ready:
                    self._cond.wait()
                if not self._running:
                    return
            if self.gather_s:
                time.sleep(self.gather_s)
            with self._cond:
                streams = list(self._ready.values())
                self._ready.clear()
            # In a function of its own, so no stream stays referenced while the thread waits.
            self._drain(streams)
            del streams

    def _drain(self, streams: list[VadStream]) -> None:
        """Score until none of ``streams`` has a window pending: one window per stream per call.

        Results are handed back to the loops once the drain is done (a 100 ms chunk is three
        windows, so three calls: one wake-up of the loop instead of three), or every
        ``POST_EVERY_S`` while a long backlog is being worked off."""
        results: dict[asyncio.AbstractEventLoop | None, list[Result]] = {}
        posted = time.perf_counter()
        while streams:
            batch: list[tuple[VadStream, tuple[int, np.ndarray, float]]] = []
            for stream in streams:
                window = stream.next_window()
                if window is not None:
                    batch.append((stream, window))
            if not batch:
                break
            for start in range(0, len(batch), self.max_batch):
                self._score(batch[start : start + self.max_batch], results)
            streams = [s for s, _ in batch if s.queue]
            if time.perf_counter() - posted > POST_EVERY_S:
                self._post(results)
                results = {}
                posted = time.perf_counter()
        self._post(results)

    def _score(
        self,
        batch: list[tuple[VadStream, tuple[int, np.ndarray, float]]],
        results: dict[asyncio.AbstractEventLoop | None, list[Result]],
    ) -> None:
        assert self._model is not None
        t0 = time.perf_counter()
        windows = np.array([w[1] for _, w in batch], dtype=np.float32)
        # Each stream's state is a [2, 128] row of the last batch's states (see below).
        state = np.ascontiguousarray(np.array([s.state for s, _ in batch], dtype=np.float32).swapaxes(0, 1))
        try:
            probs, next_state = self._model.run(windows, state)
        except Exception:  # a model failure must not stop every session's VAD
            log.exception("VAD batch of %d failed; scoring it as silence", len(batch))
            probs, next_state = np.zeros(len(batch), np.float32), state
        probs = probs.tolist()
        states = next_state.swapaxes(0, 1).copy()  # [B, 2, 128]: one copy, not one per stream
        for i, (stream, (index, _, arrived)) in enumerate(batch):
            stream.state = states[i]
            items = results.get(stream.loop)
            if items is None:
                items = results[stream.loop] = []
            items.append((stream, index, probs[i], arrived))
        self.stats.windows += len(batch)
        self.stats.batches += 1
        self.stats.busy_seconds += time.perf_counter() - t0

    def _post(self, results: dict[asyncio.AbstractEventLoop | None, list[Result]]) -> None:
        for loop, items in results.items():
            if loop is None:
                self._deliver(items)
                continue
            with self._post_lock:
                waiting = self._outbox.get(loop)
                if waiting is not None:  # a delivery is scheduled and has not run: join it
                    waiting.extend(items)
                    continue
                self._outbox[loop] = items
            try:
                loop.call_soon_threadsafe(self._deliver_to, loop)
            except RuntimeError:  # that loop is closed: its sessions are gone
                with self._post_lock:
                    self._outbox.pop(loop, None)

    def _deliver_to(self, loop: asyncio.AbstractEventLoop) -> None:
        """On ``loop``: every result handed to it since its last delivery."""
        with self._post_lock:
            items = self._outbox.pop(loop, [])
        self._deliver(items)

    def _deliver(self, results: list[Result]) -> None:
        latencies = self.stats.latencies
        for stream, index, prob, arrived in results:
            try:
                stream.deliver(index, prob)
            except Exception:  # one session's failure must not lose the others' results
                log.exception("VAD result handler failed")
            latencies.append(time.perf_counter() - arrived)


__all__ = ["VadInitError", "VadStats", "VadWorker"]
