"""The Silero VAD v6 model, run with onnxruntime directly (no torch, nothing downloaded).

The ONNX file is the one the ``silero-vad`` wheel bundles. It is located with
``importlib.util.find_spec`` and never imported: importing ``silero_vad`` sets torch's thread
count to 1 for the whole process.

One call of the whole graph scores a batch of windows: ``input`` [B, 64 context + 512 new
samples] at 16 kHz, ``state`` [2, B, 128]; outputs the speech probability [B, 1] and the next
state.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

VAD_RATE = 16_000
#: New samples per window (32 ms at 16 kHz) and the context carried over from the last window.
WINDOW = 512
CONTEXT = 64
STATE_SHAPE = (2, 128)
WINDOW_MS = WINDOW * 1000 // VAD_RATE
BUNDLED_FILE = "silero_vad.onnx"


class VadInitError(RuntimeError):
    """The VAD model cannot be loaded (missing or broken file, no onnxruntime)."""


def bundled_model_path() -> Path:
    """``silero_vad/data/silero_vad.onnx`` from the installed wheel (not imported)."""
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or spec.origin is None:
        raise VadInitError("the silero-vad package is not installed (pip install silero-vad)")
    return Path(spec.origin).parent / "data" / BUNDLED_FILE


class SileroModel:
    """A loaded Silero ONNX model on one onnxruntime thread (more made tail latency worse).

    :meth:`run` scores one window per stream (a stream's consecutive windows take one call each:
    its state links them).
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        try:
            import onnxruntime as ort
        except ImportError as exc:  # pragma: no cover - onnxruntime is a dependency
            raise VadInitError(f"onnxruntime is not available: {exc}") from None
        self.path = Path(path) if path is not None else bundled_model_path()
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        try:
            self._session = ort.InferenceSession(str(self.path), options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own exception types
            raise VadInitError(f"cannot load the VAD model {self.path}: {exc}") from None
        names = {i.name for i in self._session.get_inputs()}
        if names != {"input", "state", "sr"}:
            raise VadInitError(f"{self.path} is not a Silero VAD model (inputs {sorted(names)})")
        self._sr = np.array(VAD_RATE, dtype=np.int64)
        # One call proves the file runs (a truncated or foreign graph fails here, not later).
        try:
            self.run(np.zeros((1, CONTEXT + WINDOW), np.float32), np.zeros((2, 1, 128), np.float32))
        except Exception as exc:
            raise VadInitError(f"the VAD model {self.path} does not run: {exc}") from None
        log.info("server VAD: Silero model %s loaded", self.path)

    def run(self, windows: np.ndarray, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Probabilities [B] and the next state [2, B, 128] for ``windows`` [B, 576]."""
        prob, next_state = self._session.run(None, {"input": windows, "state": state, "sr": self._sr})
        return prob[:, 0], next_state
