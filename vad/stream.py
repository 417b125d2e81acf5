"""One session's audio on its way to the VAD: 24 kHz in, 16 kHz windows of 512 (+64 context) out.

The producer side (the event loop) resamples each appended chunk and cuts its windows (all at
once, as rows of one strided view: no copy and no object per window); the VAD worker thread
scores them in order and keeps the model state, which only it touches. Results come back to the
loop through ``on_result`` with each window's index (window ``k`` covers ``[k * 32, (k + 1) * 32)``
ms of the stream's audio).

Resampling and cutting stay on the loop: soxr releases the GIL, and each re-acquisition in the
worker thread waits for the busy loop, up to the 5 ms switch interval (cutting in the worker made
it fall behind at 200 sessions).
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from omnirt.codecs.audio import SAMPLE_RATE, StreamResampler

from .model import CONTEXT, STATE_SHAPE, VAD_RATE, WINDOW

if TYPE_CHECKING:
    from .worker import VadWorker

ResultCallback = Callable[[int, float], None]


class VadStream:
    def __init__(self, worker: VadWorker, on_result: ResultCallback) -> None:
        self._worker = worker
        self.on_result = on_result
        #: Results are posted to the loop the stream was opened on (None: called in the worker).
        try:
            self.loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = None
        self.lock = threading.Lock()
        self._resampler = StreamResampler(SAMPLE_RATE, VAD_RATE)
        #: The last CONTEXT samples of the last window cut, then the samples not yet in a window.
        self._tail = np.zeros(CONTEXT, dtype=np.float32)
        #: Cut windows not yet scored: (index of the first, [n, CONTEXT + WINDOW] rows, arrival of
        #: the chunk that completed them); ``_row`` is the next row of the first block.
        self.queue: collections.deque[tuple[int, np.ndarray, float]] = collections.deque()
        self._row = 0
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
        """Resample a chunk (float32, 24 kHz) and queue the windows it completes; returns how many.

        All of the chunk's windows are cut at once, as rows of one strided view (no copies)."""
        if self.closed:
            return 0
        arrived = time.perf_counter() if arrived is None else arrived
        x = self._resampler.process(pcm24k)
        full = np.concatenate([self._tail, x]) if len(x) else self._tail  # float32, contiguous
        count = (len(full) - CONTEXT) // WINDOW
        if count <= 0:
            self._tail = full
            return 0
        # Row i is full[i * WINDOW : i * WINDOW + CONTEXT + WINDOW]: the context, then new samples.
        rows = np.ndarray((count, CONTEXT + WINDOW), np.float32, full, 0, (WINDOW * 4, 4))
        self._tail = full[count * WINDOW :].copy()
        with self.lock:
            self.queue.append((self.windows_pushed, rows, arrived))
        self.windows_pushed += count
        self._worker.notify(self)
        return count

    def next_window(self) -> tuple[int, np.ndarray, float] | None:
        """The oldest window not yet scored: (index, [CONTEXT + WINDOW] samples, arrival)."""
        with self.lock:
            if not self.queue:
                return None
            first, rows, arrived = self.queue[0]
            row = self._row
            if row + 1 < len(rows):
                self._row = row + 1
            else:
                self.queue.popleft()
                self._row = 0
        return first + row, rows[row], arrived

    # -- the event loop ----------------------------------------------------------------------
    def deliver(self, index: int, prob: float) -> None:
        """On the event loop: one window's result, in order."""
        self.windows_decided = index + 1
        if not self.closed:
            self.on_result(index, prob)

    def close(self) -> None:
        self.closed = True
        with self.lock:
            self.queue.clear()
            self._row = 0
