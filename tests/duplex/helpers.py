"""Building a duplex pipeline over the fake LM and a real tiny Mimi, and driving it by hand."""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
from omnirt.codecs.mimi import StreamingMimi, build_mimi
from omnirt.codecs.mimi.config import MimiCodecConfig
from omnirt.codecs.mimi.reference import TINY_MIMI, random_reference_model
from omnirt.stages.duplex.pipeline import DuplexPipeline
from omnirt.stages.duplex.types import DuplexRequest
from omnirt.stages.live import LiveInput
from omnirt.stages.types import ModelInfo

from tests.duplex.fake_lm import GREEDY, FakeDuplexLM, LetterTokenizer, always

FRAME = 1920
INFO = ModelInfo("fake-duplex", "moshi", random_weights=True, source="tests")


@functools.cache
def _mimi_weights():
    model = random_reference_model(seed=5, **TINY_MIMI)
    return MimiCodecConfig.from_dict(model.config.to_dict()), model.state_dict()


def tiny_mimi() -> StreamingMimi:
    """A fresh tiny Mimi (random weights, the real codec's frame geometry), 8 quantizers."""
    config, state = _mimi_weights()
    return build_mimi(config, state, num_quantizers=8)


def pipeline(
    make_mimi, *, slots: int = 4, talking: Callable[[int], bool] = always, period: float = 0.08, **kwargs
) -> DuplexPipeline:
    lm = FakeDuplexLM(max_slots=slots, talking=talking, **kwargs)
    return DuplexPipeline(
        lm, make_mimi(), LetterTokenizer(), info=INFO, sampling=GREEDY, frame_seconds=period
    )


def speech(frames: int, seed: int) -> np.ndarray:
    """``frames`` frames of noisy float32 audio (a different stream per seed)."""
    rng = np.random.default_rng(seed)
    t = np.arange(frames * FRAME) / 24_000
    return (0.3 * np.sin(2 * np.pi * (200 + 40 * seed) * t) + 0.05 * rng.standard_normal(len(t))).astype(
        np.float32
    )


def request(rid: str, max_samples: int = 100 * FRAME) -> DuplexRequest:
    return DuplexRequest(rid, LiveInput(max_samples))
