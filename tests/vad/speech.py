"""Real speech for VAD tests: espeak-ng renders a sentence, sox converts it to 24 kHz mono,
and we place it at a known offset inside silence with a little white noise.

The true speech boundaries are those of the placed signal: espeak's own leading and trailing
silence is trimmed by energy first. Tests call :func:`require_espeak` and are skipped (with the
reason) only when espeak-ng or sox is not installed; CI installs both (Debian ``espeak-ng``,
``sox``).
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import tempfile
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from omnirt.codecs.audio import SAMPLE_RATE as RATE
from omnirt.codecs.audio import float_to_pcm16, pcm16_to_float
from omnirt.vad.model import VAD_RATE, WINDOW

SENTENCES = (
    "Hello there, I would like to book a table for two people tonight, please.",
    "Could you tell me what the weather will be like tomorrow morning?",
)


def require_espeak() -> None:
    missing = [tool for tool in ("espeak-ng", "sox") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed (apt-get install -y espeak-ng sox)")


@functools.lru_cache(maxsize=8)
def spoken(text: str) -> np.ndarray:
    """``text`` as float32 24 kHz mono, trimmed to the speech (first/last sample above 3% of
    the peak)."""
    require_espeak()
    with tempfile.TemporaryDirectory() as tmp:
        raw, out = Path(tmp) / "raw.wav", Path(tmp) / "out.wav"
        subprocess.run(["espeak-ng", "-s", "160", "-w", str(raw), text], check=True, capture_output=True)
        subprocess.run(
            ["sox", str(raw), "-r", str(RATE), "-c", "1", "-b", "16", str(out)],
            check=True,
            capture_output=True,
        )
        with wave.open(str(out)) as w:
            x = pcm16_to_float(w.readframes(w.getnframes()))
    loud = np.flatnonzero(np.abs(x) > 0.03 * np.abs(x).max())
    return x[loud[0] : loud[-1] + 1].copy()


@dataclass(frozen=True)
class Placed:
    audio: np.ndarray
    #: True speech boundaries in the signal (ms from its first sample).
    start_ms: float
    end_ms: float

    def pcm16(self) -> bytes:
        return to_pcm16(self.audio)


def place(
    speech: np.ndarray, *, lead_ms: int, tail_ms: int, noise_db: float = -50.0, seed: int = 0
) -> Placed:
    """``speech`` after ``lead_ms`` of silence and before ``tail_ms``, white noise over it all."""
    lead, tail = RATE * lead_ms // 1000, RATE * tail_ms // 1000
    x = np.concatenate([np.zeros(lead, np.float32), 0.7 * speech, np.zeros(tail, np.float32)])
    x += np.random.default_rng(seed).normal(0, 10 ** (noise_db / 20), len(x)).astype(np.float32)
    return Placed(x, lead * 1000 / RATE, (lead + len(speech)) * 1000 / RATE)


def hum(ms: int, hz: float, level: float = 0.3) -> np.ndarray:
    t = np.arange(RATE * ms // 1000) / RATE
    # Mains hum with harmonics, as a ground loop makes it.
    return (level * (np.sin(2 * np.pi * hz * t) + 0.3 * np.sin(2 * np.pi * 3 * hz * t))).astype(np.float32)


def white_noise(ms: int, level: float = 0.1, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, level, RATE * ms // 1000).astype(np.float32)


to_pcm16 = float_to_pcm16


def non_speech(ms: int) -> list:
    """``pytest.param`` signals of ``ms`` each on which no VAD may find speech."""
    return [
        pytest.param(hum(ms, 50), id="hum 50 Hz"),
        pytest.param(hum(ms, 60), id="hum 60 Hz"),
        pytest.param(white_noise(ms, 0.1), id="white noise"),
        pytest.param(np.zeros(RATE * ms // 1000, np.float32), id="silence"),
    ]


def full_windows(samples: int) -> int:
    """Whole VAD windows in ``samples`` of 24 kHz audio (the resampler holds back up to two)."""
    return samples * VAD_RATE // RATE // WINDOW
