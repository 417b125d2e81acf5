"""The duplex pipeline on CUDA with the embedded demo LM (sampled, fixed seed) and its Mimi, all
three steps (Mimi encode, LM step, Mimi decode) replayed from captured CUDA graphs: a session's
output alone equals its output in a full batch at the same bucket, bitwise; a session moved to
another slot mid-stream (compaction) goes on bitwise as unmoved at the same bucket (bf16 and fp8 KV).

"Alone" is the session with 31 others admitted but silent (no input: masked off), so both
runs are at batch bucket 32. Run on the lent GPU: ``pytest -m gpu -s tests/gpu/test_duplex_pipeline_gpu.py``.
Skipped without CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omnirt.stages.duplex.demo import demo_duplex
from omnirt.stages.duplex.pipeline import DuplexPipeline
from omnirt.stages.graphs import CudaGraphRunner
from omnirt.stages.types import AudioDelta, TextDelta

from tests.duplex.helpers import INFO, SEEDED, pipeline, request, speech

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FRAMES = 40
SESSIONS = 4
#: Sessions of the alone-vs-batch test (the issue's batch of 32).
BATCH = 32


def _run(
    p: DuplexPipeline, fed: list[int], sessions: int = SESSIONS
) -> dict[str, list[tuple[str, np.ndarray]]]:
    """Admits ``sessions`` sessions (slots 0..sessions-1), gives the ones in ``fed`` ``FRAMES``
    frames of their own audio, steps until those are consumed; per session, each frame's (text, pcm)."""
    reqs = [request(f"s{i}", max_samples=(FRAMES + 1) * 1920) for i in range(sessions)]
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
    p = pipeline(slots=BATCH, device="cuda")
    assert p.lm.graphs > 0
    assert isinstance(p.pool.encode_runner, CudaGraphRunner) and isinstance(
        p.pool.decode_runner, CudaGraphRunner
    )
    alone = _run(p, fed=[0], sessions=BATCH)["s0"]
    assert p.lm.last_path == "graph"
    assert p.pool.encode_runner.last_path == "graph" and p.pool.decode_runner.last_path == "graph"
    assert p.calls["lm", 1] == FRAMES
    batch = _run(p, fed=list(range(BATCH)), sessions=BATCH)
    assert p.calls["lm", BATCH] == FRAMES and p.lm.last_path == "graph"
    assert len(alone) == len(batch["s0"]) == FRAMES
    assert any(np.abs(pcm).max() > 1000 for _, pcm in alone)  # it talked: real audio compared
    for (text_a, pcm_a), (text_b, pcm_b) in zip(alone, batch["s0"], strict=True):
        assert text_a == text_b and np.array_equal(pcm_a, pcm_b)
    assert any(not np.array_equal(a, b) for (_, a), (_, b) in zip(batch["s0"], batch["s1"], strict=True))


def _moved_run(kv_dtype: str, move: bool) -> tuple[list[tuple[str, np.ndarray]], DuplexPipeline]:
    """Sessions s0..s3 in slots 0..3 (graphs, 8 slots), s3 fed and s0 fed, s1/s2 silent. With
    ``move``: after frame 10 s1 leaves and s3 moves into its slot 1 (rows 4 -> 3: bucket 4 still)."""
    lm, mimi, tokenizer = demo_duplex(8, "cuda", graphs=True, kv_dtype=kv_dtype)
    p = DuplexPipeline(lm, mimi, tokenizer, info=INFO, sampling=SEEDED, frame_seconds=0.08)
    reqs = [request(f"s{i}", max_samples=(FRAMES + 1) * 1920) for i in range(SESSIONS)]
    for r in reqs:
        p.add(r)
    for i in (0, 3):
        reqs[i].input.push(speech(FRAMES, seed=i))
    frames, text = [], ""
    for n in range(FRAMES):
        if move and n == 10:
            p.remove("s1")
            assert p.slot_of("s3") == 3  # busy 3 in rows 4: the same bucket, nothing compacted
            p.move("s3", 1)
        for rid, o in p.step():
            if rid != "s3":
                continue
            if isinstance(o, TextDelta):
                text += o.text
            elif isinstance(o, AudioDelta):
                frames.append((text, o.pcm))
                text = ""
    return frames, p


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_a_moved_session_goes_on_bitwise_through_graphs_at_one_bucket(kv_dtype: str) -> None:
    stayed, _ = _moved_run(kv_dtype, move=False)
    moved, p = _moved_run(kv_dtype, move=True)
    assert p.slot_of("s3") == 1 and p.calls["move", 1] == 1
    assert p.lm.last_path == "graph" and p.pool.decode_runner.last_path == "graph"
    assert len(moved) == len(stayed) == FRAMES
    assert any(np.abs(pcm).max() > 1000 for _, pcm in moved[10:])  # it talked after the move
    for (text_a, pcm_a), (text_b, pcm_b) in zip(stayed, moved, strict=True):
        assert text_a == text_b and np.array_equal(pcm_a, pcm_b)
