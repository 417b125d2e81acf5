"""Input that keeps arriving while its request runs: a live audio stream (duplex sessions).

A live request carries a :class:`LiveInput` in its ``input`` attribute. The event loop pushes
PCM into it (:meth:`LiveInput.push`) and says when there is no more (:meth:`LiveInput.end`); the
engine thread takes it out a frame at a time (:meth:`LiveInput.take`) as the request's pipeline
steps. A lock guards the buffer, so the two threads never wait on each other for longer than a
copy. Every push, and the end of the input, calls ``on_data`` (the engine sets it to its
wake-up, so a pipeline whose work depends on input is stepped as soon as it has some).

The buffer is bounded (``max_samples``): a push that would pass the bound raises
:class:`InputBackpressure` and nothing of it is kept, so a client sending faster than real time
is told so instead of growing the server's memory.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np


class InputBackpressure(ValueError):
    """A push would hold more input than the stream's bound: nothing of it was kept."""


class LiveInput:
    """Mono float32 PCM arriving in pieces of any size, taken out in whole frames."""

    def __init__(self, max_samples: int) -> None:
        if max_samples <= 0:
            raise ValueError(f"max_samples must be positive, got {max_samples}")
        self.max_samples = max_samples
        #: Called (from the pushing thread) after each push and at the end of the input.
        self.on_data: Callable[[], None] | None = None
        self._lock = threading.Lock()
        self._chunks: list[np.ndarray] = []
        self._held = 0
        self._ended = False
        #: Samples taken out so far (the engine thread's position in the stream).
        self.consumed = 0
        #: Samples pushed so far.
        self.pushed = 0

    # -- the producer (event loop) ---------------------------------------------------------------
    def push(self, pcm: np.ndarray) -> None:
        """Append ``pcm`` (1-D float); :class:`InputBackpressure` when it does not fit, ``ValueError``
        for a bad array or after :meth:`end`. Either way nothing changes."""
        if not isinstance(pcm, np.ndarray) or pcm.ndim != 1 or not np.issubdtype(pcm.dtype, np.floating):
            raise ValueError("live input takes a 1-D float array of samples")
        with self._lock:
            if self._ended:
                raise ValueError("the input has ended: nothing more can be pushed")
            if self._held + len(pcm) > self.max_samples:
                raise InputBackpressure(
                    f"{self._held} samples are waiting to be read (bound {self.max_samples}): "
                    f"{len(pcm)} more do not fit"
                )
            if len(pcm):
                self._chunks.append(pcm.astype(np.float32, copy=True))
                self._held += len(pcm)
                self.pushed += len(pcm)
        self._notify()

    def end(self) -> None:
        """No more input (idempotent): what is held is still read, the tail padded to a frame."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
        self._notify()

    def room(self) -> int:
        """Samples a push may still add."""
        with self._lock:
            return self.max_samples - self._held

    def _notify(self) -> None:
        callback = self.on_data
        if callback is not None:
            callback()

    # -- the consumer (engine thread) ------------------------------------------------------------
    @property
    def held(self) -> int:
        with self._lock:
            return self._held

    @property
    def ended(self) -> bool:
        with self._lock:
            return self._ended

    def ready(self, frame: int) -> bool:
        """Whether :meth:`take` ``(frame)`` would return a frame."""
        with self._lock:
            return self._held >= frame or (self._ended and self._held > 0)

    def drained(self) -> bool:
        """The input has ended and everything of it has been taken."""
        with self._lock:
            return self._ended and self._held == 0

    def take(self, frame: int) -> np.ndarray | None:
        """The next ``frame`` samples (float32), or None when fewer are held. After :meth:`end`
        the last partial frame comes out padded with zeros."""
        with self._lock:
            if self._held < frame and not (self._ended and self._held > 0):
                return None
            out = np.zeros(frame, dtype=np.float32)
            filled = 0
            while filled < frame and self._chunks:
                chunk = self._chunks[0]
                n = min(frame - filled, len(chunk))
                out[filled : filled + n] = chunk[:n]
                filled += n
                if n == len(chunk):
                    self._chunks.pop(0)
                else:
                    self._chunks[0] = chunk[n:]
            self._held -= filled
            self.consumed += filled
            return out
