"""One session's audio on its way to the VAD: 24 kHz in, 16 kHz windows of 512 (+64 context) out.

The producer side (the event loop) resamples each appended chunk and cuts windows; the VAD
worker thread scores them in order and keeps the model state, which only it touches. Results
come back to the loop through ``on_result`` with each window's index (window ``k`` covers
``[k * 32, (k + 1) * 32)`` ms of the stream's audio).
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from omnirt.codecs.audio import SAMPLE_RATE, StreamResampler

from .model import CONTEXT, STATE_SHAPE, VAD_RATE, WINDOW

if TYPE_CHECKING:
    from .worker import VadWorker

ResultCallback = Callable[[int, float], None]


@dataclass(frozen=True)
class Window:
    index: int
    #: [CONTEXT + WINDOW] float32 at 16 kHz.
    samples: np.ndarray
    #: ``time.perf_counter()`` when the chunk that completed this window arrived.
    arrived: float


class VadStream:
    def __init__(self, worker: VadWorker, on_result: ResultCallback) -> None:
        self._worker = worker
        self.on_result = on_result
        #: Results are posted to the loop the stream was opened on (None: called in the worker).
        try:
            self.loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = None
        self._resampler = StreamResampler(SAMPLE_RATE, VAD_RATE)
        self._pending = np.zeros(0, dtype=np.float32)
        self._context = np.zeros(CONTEXT, dtype=np.float32)
        self.queue: collections.deque[Window] = collections.deque()
        self.lock = threading.Lock()
        #: Model state; read and written by the worker thread only.
        self.state = np.zeros(STATE_SHAPE, dtype=np.float32)
        self.windows_pushed = 0
        self.windows_decided = 0
        self.closed = False

    @property
    def backlog_windows(self) -> int:
        """Windows cut but not yet decided (the VAD's lag behind the input)."""
        return self.windows_pushed - self.windows_decided

    def push(self, pcm24k: np.ndarray, arrived: float | None = None) -> int:
        """Resample a chunk (float32, 24 kHz) and queue the windows it completes; returns how many."""
        if self.closed:
            return 0
        arrived = time.perf_counter() if arrived is None else arrived
        x = self._resampler.process(pcm24k)
        if len(self._pending):
            x = np.concatenate([self._pending, x])
        count = len(x) // WINDOW
        if count == 0:
            self._pending = x
            return 0
        windows = []
        for i in range(count):
            new = x[i * WINDOW : (i + 1) * WINDOW]
            windows.append(Window(self.windows_pushed + i, np.concatenate([self._context, new]), arrived))
            self._context = new[-CONTEXT:]
        self._pending = x[count * WINDOW :].copy()
        self.windows_pushed += count
        with self.lock:
            self.queue.extend(windows)
        self._worker.notify(self)
        return count

    def deliver(self, index: int, prob: float) -> None:
        """On the event loop: one window's result, in order."""
        self.windows_decided = index + 1
        if not self.closed:
            self.on_result(index, prob)

    def close(self) -> None:
        self.closed = True
        with self.lock:
            self.queue.clear()
