"""Slot compaction: a conversation moved to another slot mid-stream goes on bitwise as if it had
stayed (the LM alone, then the whole pipeline), and the pipeline's batch drops to the bucket of
its busy count once sessions leave from the middle."""

from __future__ import annotations

import pytest
import torch
from omnirt.stages.duplex.lm import DuplexLM, DuplexSampling
from omnirt.stages.duplex.loader import load_duplex_lm

from .reference import K, save_reference

WINDOW = 8
SLOTS = 20
SAMPLED = DuplexSampling(text_temperature=1.0, text_top_k=0, audio_temperature=1.0, audio_top_k=0, seed=42)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("moshi")
    save_reference(path, seed=1, sliding_window=WINDOW, max_position_embeddings=WINDOW)
    return path


def _lm(path, kv_dtype: str) -> DuplexLM:
    dtype = torch.bfloat16 if kv_dtype == "fp8" else torch.float32
    lm, _ = load_duplex_lm(path, max_slots=SLOTS, device="cpu", dtype=dtype, graphs=False, kv_dtype=kv_dtype)
    return lm


def _run(lm: DuplexLM, moves: dict[int, tuple[int, int]], frames: int) -> list[tuple[torch.Tensor, ...]]:
    """A sampled conversation starting in slot 17 among busy neighbours (1..16, 18, 19; slot 0
    free), all stepped in 20 rows; ``moves`` {frame: (source, target)} before that frame's step
    (a neighbour in ``target`` leaves first).
    Returns the conversation's outputs per frame, wherever it lives."""
    generator = torch.Generator().manual_seed(3)
    user = torch.randint(0, 64, (frames, SLOTS, K), generator=generator)
    for slot in range(1, SLOTS):
        lm.start(slot, DuplexSampling(text_temperature=1.0, audio_temperature=1.0, seed=100 + slot))
    lm.start(17, SAMPLED)
    here, out = 17, []
    for n in range(frames):
        if n in moves:
            source, target = moves[n]
            if lm._started[target]:
                lm.stop(target)  # its neighbour there leaves first
            lm.move(source, target)
            here = target if source == here else here
        codes = user[n].clone()
        codes[here] = user[n, 17]  # the conversation's input follows it
        active = torch.tensor([lm._started[s] for s in range(SLOTS)])
        step = lm.step(codes, active)
        out.append(tuple(t[here].clone() for t in (step.text, step.audio, step.audio_ready, step.delayed)))
    return out


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_a_moved_conversation_goes_on_bitwise_as_unmoved(checkpoint, kv_dtype):
    frames = 3 * WINDOW
    unmoved = _run(_lm(checkpoint, kv_dtype), {}, frames)
    lm = _lm(checkpoint, kv_dtype)
    # frame 5: before the ring is full (5 valid columns), into the free slot 0; frame 13: the
    # ring has wrapped, the neighbour in slot 12 leaves and the conversation takes its slot
    moved = _run(lm, {5: (17, 0), 13: (0, 12)}, frames)
    assert all(
        all(torch.equal(a, b) for a, b in zip(x, y, strict=True)) for x, y in zip(unmoved, moved, strict=True)
    )
    assert lm.frames(12) == frames and int(lm.position[12]) == frames
    assert not lm._started[17] and not lm._started[0]
    assert len({int(t[0]) for t in moved}) > 3  # a sampled stream, not a constant one


def test_bad_moves_raise_and_change_nothing(checkpoint):
    lm = _lm(checkpoint, "auto")
    lm.start(1, SAMPLED)
    lm.start(2, SAMPLED)
    lm.step(torch.zeros((SLOTS, K), dtype=torch.long), torch.tensor([s in (1, 2) for s in range(SLOTS)]))
    before = [t.clone() for t in (lm.keys[0], lm.position, lm.text_prev, lm.text_sampling.seed)]
    for source, target, match in (
        (0, 3, "no conversation"),
        (1, 2, "has a conversation"),
        (1, 1, "has a conversation"),
        (1, SLOTS, "slot must be"),
        (True, 3, "slot must be"),
        (1, "3", "slot must be"),
    ):
        with pytest.raises(ValueError, match=match):
            lm.move(source, target)
    after = (lm.keys[0], lm.position, lm.text_prev, lm.text_sampling.seed)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert [lm.frames(s) for s in range(4)] == [0, 1, 1, 0] and lm._started[1] and not lm._started[3]
