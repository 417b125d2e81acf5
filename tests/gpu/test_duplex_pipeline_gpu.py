"""The duplex pipeline on CUDA with the embedded demo LM (sampled, fixed seed) and its Mimi, all
three steps (Mimi encode, LM step, Mimi decode) replayed from captured CUDA graphs: a session's
output alone equals its output in a full batch at the same bucket, bitwise.

"Alone" is the session with three others admitted but silent (no input: masked off), so both
runs are at batch bucket 4. Run on the lent GPU: ``pytest -m gpu -s tests/gpu/test_duplex_pipeline_gpu.py``.
Skipped without CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omnirt.stages.duplex.pipeline import DuplexPipeline
from omnirt.stages.graphs import CudaGraphRunner
from omnirt.stages.types import AudioDelta, TextDelta

from tests.duplex.helpers import pipeline, request, speech

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FRAMES = 40
SESSIONS = 4


def _run(p: DuplexPipeline, fed: list[int]) -> dict[str, list[tuple[str, np.ndarray]]]:
    """Admits ``SESSIONS`` sessions (slots 0..3), gives the ones in ``fed`` ``FRAMES`` frames of
    their own audio, steps until those are consumed; per session, each frame's (text, pcm)."""
    reqs = [request(f"s{i}", max_samples=(FRAMES + 1) * 1920) for i in range(SESSIONS)]
    for r in reqs:
        p.add(r)
    for i in fed:
        reqs[i].input.push(speech(FRAMES, seed=i))
    frames: dict[str, list[tuple[str, np.ndarray]]] = {r.request_id: [] for r in reqs}
    text = {r.request_id: "" for r in reqs}
    for _ in range(FRAMES):
        for rid, o in p.step():
            if isinstance(o, TextDelta):
                text[rid] += o.text
            elif isinstance(o, AudioDelta):
                frames[rid].append((text[rid], o.pcm))
                text[rid] = ""
    for r in reqs:
        p.remove(r.request_id)
    return frames


def test_a_session_alone_equals_it_in_a_batch_through_graphs_at_one_bucket() -> None:
    p = pipeline(slots=8, device="cuda")
    assert p.lm.graphs > 0
    assert isinstance(p.pool.encode_runner, CudaGraphRunner) and isinstance(
        p.pool.decode_runner, CudaGraphRunner
    )
    alone = _run(p, fed=[0])["s0"]
    assert p.lm.last_path == "graph"
    assert p.pool.encode_runner.last_path == "graph" and p.pool.decode_runner.last_path == "graph"
    assert p.calls["lm", 1] == FRAMES
    batch = _run(p, fed=list(range(SESSIONS)))
    assert p.calls["lm", SESSIONS] == FRAMES and p.lm.last_path == "graph"
    assert len(alone) == len(batch["s0"]) == FRAMES
    assert any(np.abs(pcm).max() > 1000 for _, pcm in alone)  # it talked: real audio compared
    for (text_a, pcm_a), (text_b, pcm_b) in zip(alone, batch["s0"], strict=True):
        assert text_a == text_b and np.array_equal(pcm_a, pcm_b)
    assert any(not np.array_equal(a, b) for (_, a), (_, b) in zip(batch["s0"], batch["s1"], strict=True))
