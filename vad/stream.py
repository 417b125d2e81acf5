"""One session's audio on its way to the VAD: 24 kHz chunks in, per-window probabilities out.

The handle lives in the server; the resampling, window cutting and model state live in the VAD
process (:mod:`.process`). Results come back, in order, through ``on_result`` with each window's
index (window ``k`` covers ``[k * 32, (k + 1) * 32)`` ms of the stream's audio at 16 kHz), on the
event loop the stream was opened on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from omnirt.codecs.audio import SAMPLE_RATE

from .model import WINDOW_MS

if TYPE_CHECKING:
    from .worker import VadWorker

ResultCallback = Callable[[int, float], None]


class VadStream:
    def __init__(self, worker: VadWorker, sid: int, on_result: ResultCallback,
                 loop: asyncio.AbstractEventLoop) -> None:
        self._worker = worker
        self.sid = sid
        self.on_result = on_result
        #: Results are delivered on this loop.
        self.loop = loop
        self.samples_pushed = 0
        self.windows_decided = 0
        self.closed = False

    @property
    def backlog_ms(self) -> int:
        """Audio pushed but not yet decided (the VAD's lag behind the input). Up to one window
        (32 ms) plus the resampler's delay is always waiting for the samples that complete it."""
        return max(0, self.samples_pushed * 1000 // SAMPLE_RATE - self.windows_decided * WINDOW_MS)

    def push(self, pcm24k: np.ndarray, arrived: float | None = None) -> None:
        """Sends a chunk (float32, 24 kHz) to the VAD; ``arrived`` (``perf_counter``) is when it
        reached the session, for the latency statistics (default: now)."""
        if self.closed:
            return
        pcm = np.ascontiguousarray(pcm24k, dtype=np.float32)
        self.samples_pushed += len(pcm)
        self._worker.send_audio(self, pcm.tobytes(), time.perf_counter() if arrived is None else arrived)

    def resume_at(self) -> int:
        """After the VAD process was replaced: the index the stream goes on from, the first window
        after all the audio pushed so far (what the old process had not scored counts as decided,
        unscored), so that window indices keep matching the audio's time."""
        pushed_ms = self.samples_pushed * 1000 // SAMPLE_RATE
        self.windows_decided = -(-pushed_ms // WINDOW_MS)
        return self.windows_decided

    def deliver(self, index: int, prob: float) -> None:
        """On the event loop: one window's result, in order."""
        self.windows_decided = index + 1
        if not self.closed:
            self.on_result(index, prob)

    def close(self) -> None:
        """Stop the stream; ``on_result`` (which holds its owner) is dropped, so nothing of the
        owner stays reachable from the worker or in a reference cycle."""
        if not self.closed:
            self.closed = True
            self.on_result = _closed
            self._worker.close_stream(self)


def _closed(index: int, prob: float) -> None:
    """The result callback of a closed stream (results still in flight are dropped)."""
