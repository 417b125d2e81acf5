"""Building a duplex pipeline over the embedded demo LM (tiny Moshi, its Mimi and tokenizer)."""

from __future__ import annotations

import numpy as np
from omnirt.stages.duplex.demo import demo_duplex
from omnirt.stages.duplex.lm import DuplexSampling
from omnirt.stages.duplex.pipeline import DuplexPipeline
from omnirt.stages.duplex.types import DuplexRequest
from omnirt.stages.live import LiveInput
from omnirt.stages.types import ModelInfo

FRAME = 1920
INFO = ModelInfo("demo-moshi", "moshi", random_weights=True, source="embedded")
#: The demo's default sampling with a fixed seed: sampled (so the demo talks in stretches) and
#: deterministic (a session's stream depends on its input alone).
SEEDED = DuplexSampling(seed=7)


def pipeline(
    *, slots: int = 4, period: float = 0.08, sampling: DuplexSampling = SEEDED, device: str = "cpu"
) -> DuplexPipeline:
    lm, mimi, tokenizer = demo_duplex(slots, device, graphs=device != "cpu")
    return DuplexPipeline(
        lm, mimi, tokenizer, info=INFO, sampling=sampling, frame_seconds=period, cuda_graphs=device != "cpu"
    )


def speech(frames: int, seed: int) -> np.ndarray:
    """``frames`` frames of noisy float32 audio (a different stream per seed)."""
    rng = np.random.default_rng(seed)
    t = np.arange(frames * FRAME) / 24_000
    return (0.3 * np.sin(2 * np.pi * (200 + 40 * seed) * t) + 0.05 * rng.standard_normal(len(t))).astype(
        np.float32
    )


def request(
    rid: str, max_samples: int = 100 * FRAME, sampling: DuplexSampling | None = None
) -> DuplexRequest:
    return DuplexRequest(rid, LiveInput(max_samples), sampling)
