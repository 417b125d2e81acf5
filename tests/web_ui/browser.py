"""Debian's Chromium driven by Python playwright, with a fake microphone playing a WAV.

Nothing is downloaded: playwright runs ``/usr/bin/chromium`` (``apt-get install chromium``).
Tests skip, saying why, only when Chromium, playwright, espeak-ng or sox is missing.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
#: One sentence, then silence long enough for server VAD (500 ms) to end the turn and a short
#: reply to play before the file loops and the "user" speaks again.
SENTENCE = "Hello, can you hear me today?"
LEAD_SILENCE_S = 0.2
TAIL_SILENCE_S = 1.8


def missing() -> str | None:
    if not CHROMIUM.is_file():
        return f"Chromium is not installed at {CHROMIUM} (apt-get install chromium)"
    if importlib.util.find_spec("playwright") is None:
        return "Python playwright is not installed (pip install playwright)"
    for tool, package in (("espeak-ng", "espeak-ng"), ("sox", "sox")):
        if shutil.which(tool) is None:
            return f"{tool} is needed to make the test speech (apt-get install {package})"
    return None


MISSING = missing()
requires_browser = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


def make_speech_wav(folder: Path) -> Path:
    """espeak-ng speech as a 48 kHz 16-bit mono WAV with silence around it (what Chromium reads)."""
    raw = folder / "speech-raw.wav"
    out = folder / "speech.wav"
    subprocess.run(["espeak-ng", "-w", str(raw), SENTENCE], check=True, capture_output=True)
    subprocess.run(
        [
            "sox",
            str(raw),
            "-r",
            "48000",
            "-b",
            "16",
            "-c",
            "1",
            str(out),
            "pad",
            str(LEAD_SILENCE_S),
            str(TAIL_SILENCE_S),
        ],
        check=True,
        capture_output=True,
    )
    return out


def chromium_args(wav: Path) -> list[str]:
    return [
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--use-fake-ui-for-media-stream",
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={wav}",
        "--autoplay-policy=no-user-gesture-required",
    ]
