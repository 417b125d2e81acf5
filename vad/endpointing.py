"""Endpointing: per-window speech probabilities to speech start / stop decisions.

A two-state machine with hysteresis, as Silero's own ``get_speech_timestamps``:

- silent -> speaking when a window scores ``>= threshold``; the onset is that window's start.
- speaking: a window below ``threshold - 0.15`` opens a silence run at its start, unless one is
  already open (later quiet windows never move it). A window ``>= threshold`` closes the run
  (speech resumed). Windows in between change nothing: they neither reset the run nor count
  as speech. When the open run has lasted ``silence_duration_ms`` the speech stops; its end is
  the run's start.

Times are stream milliseconds (window ``k`` spans ``[32k, 32k + 32)``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .model import WINDOW_MS

#: Speech ends below ``threshold - HYSTERESIS``.
HYSTERESIS = 0.15


@dataclass(frozen=True)
class SpeechStart:
    #: Start of the first speech window (without prefix padding).
    onset_ms: int


@dataclass(frozen=True)
class SpeechStop:
    #: Start of the silence run that ended the speech.
    end_ms: int
    #: When the decision was made (the end of the window that completed the run).
    decided_ms: int


class Endpointer:
    def __init__(self, threshold: float = 0.5, silence_duration_ms: int = 500) -> None:
        self.threshold = threshold
        self.neg_threshold = max(threshold - HYSTERESIS, 0.01)
        self.silence_duration_ms = silence_duration_ms
        self.speaking = False
        self._silence_start: int | None = None
        #: End of the last window seen (stream ms).
        self.position_ms = 0

    def step(self, index: int, prob: float) -> SpeechStart | SpeechStop | None:
        start = index * WINDOW_MS
        self.position_ms = start + WINDOW_MS
        if not self.speaking:
            if prob >= self.threshold:
                self.speaking = True
                self._silence_start = None
                return SpeechStart(start)
            return None
        if prob >= self.threshold:
            self._silence_start = None
        elif prob < self.neg_threshold and self._silence_start is None:
            self._silence_start = start
        end = self._silence_start
        if end is not None and self.position_ms - end >= self.silence_duration_ms:
            self.reset()
            return SpeechStop(end, self.position_ms)
        return None

    def reset(self) -> None:
        self.speaking = False
        self._silence_start = None
