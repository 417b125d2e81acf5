"""Where the model's speech starts and stops in a full-duplex stream (one decision per frame).

A duplex model makes one frame of audio (and maybe a text token) every 80 ms whether it talks or
not. A *stretch* of speech starts at the first frame with text (a text token that is not
padding) or audio louder than ``quiet_dbfs``; it ends after ``quiet_frames`` frames in a row
that are quiet (below ``quiet_dbfs``) and carry padding only; those quiet frames belong to the
stretch (its tail), the frames after it to none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

Decision = Literal["start", "continue", "end", "idle"]


@dataclass(frozen=True)
class StretchRule:
    #: Audio at or below this level (dB relative to full scale, RMS over the frame) is quiet.
    quiet_dbfs: float = -40.0
    #: Quiet frames with padding text that end a stretch (6 frames: 480 ms).
    quiet_frames: int = 6

    def __post_init__(self) -> None:
        if self.quiet_frames < 1:
            raise ValueError(f"quiet_frames must be at least 1, got {self.quiet_frames}")


def level_dbfs(pcm: np.ndarray) -> float:
    """RMS level of int16 PCM in dBFS (``-inf`` for silence)."""
    if len(pcm) == 0:
        return -math.inf
    rms = float(np.sqrt(np.mean(np.square(pcm.astype(np.float64)))))
    return 20 * math.log10(rms / 32768) if rms > 0 else -math.inf


class Stretches:
    """Feed each frame (its text and audio); says whether it starts, continues or ends a stretch
    (an ending frame is the stretch's last) or lies outside any (``idle``)."""

    def __init__(self, rule: StretchRule) -> None:
        self.rule = rule
        self.speaking = False
        self._quiet = 0

    def frame(self, text: str, pcm: np.ndarray) -> Decision:
        sound = bool(text) or level_dbfs(pcm) > self.rule.quiet_dbfs
        if not self.speaking:
            if not sound:
                return "idle"
            self.speaking, self._quiet = True, 0
            return "start"
        self._quiet = 0 if sound else self._quiet + 1
        if self._quiet >= self.rule.quiet_frames:
            self.speaking = False
            return "end"
        return "continue"
