"""Slot compaction: a conversation moved to another slot mid-stream goes on bitwise as if it had
stayed (the LM alone, then the whole pipeline), and the pipeline's batch drops to the bucket of
its busy count once sessions leave from the middle."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omnirt.stages.duplex.lm import DuplexLM, DuplexSampling
from omnirt.stages.duplex.loader import load_duplex_lm
from omnirt.stages.duplex.pipeline import DuplexPipeline

from .helpers import pipeline, request, speech
from .reference import K, save_reference
from .test_pipeline import _frames, _same

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


def _session_run(leave: bool) -> tuple[list, DuplexPipeline]:
    """20 sessions on the demo pipeline (20 slots); the last one (slot 19) talks for 14 frames.
    With ``leave``: sessions 0..9 are removed after 3 frames, 10..18 end their input after 6."""
    frames = 14
    p = pipeline(slots=SLOTS)
    reqs = [request(f"r{i}") for i in range(SLOTS)]
    for i, r in enumerate(reqs):
        p.add(r)
        short = leave and i < SLOTS - 1
        r.input.push(speech(6 if short and i >= 10 else frames, seed=20 + i))
        if short and i >= 10:
            r.input.end()
    assert p.slot_of("r19") == 19
    got = []
    for tick in range(frames + 1):
        if leave and tick == 3:
            for r in reqs[:10]:
                p.remove(r.request_id)
        got += p.step()
    return [o for rid, o in got if rid == "r19"], p


def test_the_last_session_goes_on_bitwise_after_nineteen_leave_from_the_middle():
    stayed, full = _session_run(leave=False)
    moved, p = _session_run(leave=True)
    assert any(np.abs(pcm).max() > 1000 for _, pcm, _ in _frames(moved))  # it talks: real audio
    assert _same(moved, stayed)
    assert p.slot_of("r19") == 0 and p.free_slots == SLOTS - 1
    # the whole state followed it: every Mimi stream row and the LM's per-slot rows
    unmoved_state = full.pool.model.state_buffers()
    for name, buffer in p.pool.model.state_buffers().items():
        assert torch.equal(buffer[0], unmoved_state[name][19]), name
    for name in ("position", "text_prev", "model_prev", "user_prev"):
        assert torch.equal(getattr(p.lm, name)[0], getattr(full.lm, name)[19]), name
    valid = 14  # frames so far (below the demo's window): the ring's valid columns
    assert torch.equal(p.lm.keys[0][0, :, :valid], full.lm.keys[0][19, :, :valid])
    # 10 removed at tick 3 (busy 10 in rows 20: the 20 bucket) -> the top four move down (rows
    # 16); the nine ending at tick 6 leave r19 (then in slot 0) alone.
    assert p.calls["move", 1] == 4
    assert p.calls["lm_rows", 20] == 3 and p.calls["lm_rows", 1] == 14 - 6
    assert full.calls["lm_rows", 20] == 14 and full.calls["move", 1] == 0
    # a newcomer takes the lowest free slot
    p.add(request("new"))
    assert p.slot_of("new") == 1


def test_pipeline_bad_moves_raise_and_change_nothing():
    p = pipeline(slots=SLOTS)
    for rid in ("a", "b"):
        p.add(request(rid))
        p.step()
    for rid, slot, match in (
        ("nobody", 5, "no duplex session"),
        ("a", 1, "in use"),
        ("a", 0, "in use"),
        ("a", SLOTS, "slot must be"),
        ("a", None, "slot must be"),
    ):
        with pytest.raises(ValueError, match=match):
            p.move(rid, slot)
    assert (p.slot_of("a"), p.slot_of("b"), p.free_slots, p.calls["move", 1]) == (0, 1, SLOTS - 2, 0)
    p.move("b", 7)  # a move the caller asks for
    assert p.slot_of("b") == 7 and p.lm._started[7] and not p.lm._started[1]
    p.remove("a")  # busy 1 in rows 8: the 16 bucket either way, nothing to compact on CPU
    assert p.slot_of("b") == 7
