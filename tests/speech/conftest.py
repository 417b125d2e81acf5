"""Shared fixtures: one demo checkpoint per test session (built in a temp cache), helpers to run."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import io  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from omnirt.stages.speech.demo import ensure_demo_checkpoint  # noqa: E402
from omnirt.stages.speech.loader import load_speech_pipeline  # noqa: E402
from omnirt.stages.speech.pipeline import SpeechPipeline  # noqa: E402
from omnirt.stages.types import (  # noqa: E402
    SAMPLE_RATE,
    AudioPart,
    ContextMessage,
    GenerationRequest,
    Output,
    TextPart,
)

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_demo_checkpoint(tmp_path_factory.mktemp("omnirt-cache"))


@pytest.fixture(scope="module")
def pipeline(demo_dir: Path) -> SpeechPipeline:
    return load_speech_pipeline(demo_dir, max_slots=4, max_audio_frames=30)


@pytest.fixture(scope="module")
def hf_model(demo_dir: Path):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(demo_dir)).eval()


def tone(seconds: float = 1.0, freq: float = 220.0, seed: int = 0) -> np.ndarray:
    n = int(SAMPLE_RATE * seconds)
    rng = np.random.default_rng(seed)
    t = np.arange(n) / SAMPLE_RATE
    return (0.3 * np.sin(2 * np.pi * freq * t) + 0.05 * rng.standard_normal(n)).astype(np.float32)


def png(size: tuple[int, int] = (64, 48)) -> bytes:
    """A seeded random RGB image, PNG-encoded."""
    from PIL import Image

    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def text_request(rid: str, text: str = "hello there", **kw) -> GenerationRequest:
    kw.setdefault("output_audio", False)
    return GenerationRequest(rid, [ContextMessage("user", (TextPart(text),))], **kw)


def audio_request(rid: str, pcm: np.ndarray | None = None, text: str = "hi", **kw) -> GenerationRequest:
    pcm = tone() if pcm is None else pcm
    return GenerationRequest(rid, [ContextMessage("user", (AudioPart(pcm), TextPart(text)))], **kw)


def drain(pipeline: SpeechPipeline, max_steps: int = 500) -> list[tuple[str, Output]]:
    outs: list[tuple[str, Output]] = []
    for _ in range(max_steps):
        if not pipeline.has_work():
            return outs
        outs.extend(pipeline.step())
    raise AssertionError("pipeline did not finish")


def run_pieces(pieces):
    """Runs a prompt pass's pieces (a generator, as ``Thinker.forward_prompt``) to the end,
    running each piece it asks for alone (``prefill.advance`` batches them across prompts)."""
    answer = None
    with torch.no_grad():
        while True:
            try:
                call = pieces.send(answer)
            except StopIteration as stop:
                return stop.value
            answer = call.owner.execute([call])[0] if call is not None else None


def of(outs: list[tuple[str, Output]], rid: str) -> list[Output]:
    return [o for r, o in outs if r == rid]


class TokenLog:
    """Records the thinker tokens the pipeline draws, per request."""

    def __init__(self, pipeline: SpeechPipeline) -> None:
        self.tokens: dict[str, list[int]] = {}
        pipeline.token_observer = lambda rid, tok: self.tokens.setdefault(rid, []).append(tok)
