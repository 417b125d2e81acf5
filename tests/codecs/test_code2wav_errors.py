"""Bad input to the streamer raises a clear ValueError and changes no stream."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from omnirt.codecs.code2wav import Code2WavStreamer
from omnirt.codecs.code2wav.random_init import randomize_, tiny_code2wav_config
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

SLOTS = 2


@pytest.fixture(scope="module")
def hf() -> Qwen3OmniMoeCode2Wav:
    return randomize_(Qwen3OmniMoeCode2Wav(tiny_code2wav_config()).eval(), 7)


def _frames(seed: int) -> torch.Tensor:
    return torch.randint(0, 16, (3, 4), generator=torch.Generator().manual_seed(seed))


def _snapshot(streamer: Code2WavStreamer) -> tuple[dict[str, torch.Tensor], dict[int, int], list[int]]:
    state = {k: v.clone() for k, v in streamer.pool.state.items()}
    return state, dict(streamer._frames), sorted(streamer._slots.free_slots())


def _unchanged(streamer: Code2WavStreamer, snapshot: tuple) -> bool:
    state, frames, free = snapshot
    return (all(torch.equal(v, state[k]) for k, v in streamer.pool.state.items())
            and streamer._frames == frames and sorted(streamer._slots.free_slots()) == free)


def _continue(streamer: Code2WavStreamer, slots: list[int]) -> dict[int, np.ndarray]:
    """Steps the given slots through the rest of their frames (seed = slot)."""
    out = {slot: [] for slot in slots}
    for f in range(1, 3):
        for slot, chunk in streamer.step({slot: _frames(slot)[f] for slot in slots}).items():
            out[slot].append(chunk)
    return {slot: np.concatenate(chunks) for slot, chunks in out.items()}


BAD_STEPS: dict[str, tuple[Callable[[int], dict], str]] = {
    "too few codebooks": (lambda s: {s: torch.zeros(3, dtype=torch.long)}, "expects 4 codebooks"),
    "too many codebooks": (lambda s: {s: torch.zeros(5, dtype=torch.long)}, "expects 4 codebooks"),
    "no frames": (lambda s: {s: torch.zeros(0, 4, dtype=torch.long)}, "expects 4 codebooks"),
    "frames of 3 codebooks": (lambda s: {s: torch.zeros(2, 3, dtype=torch.long)}, "expects 4 codebooks"),
    "a [1, 1, 4] tensor": (lambda s: {s: torch.zeros(1, 1, 4, dtype=torch.long)}, "expects 4 codebooks"),
    "a bad code in a later frame": (
        lambda s: {s: torch.tensor([[0, 1, 2, 3], [0, 1, 16, 3]])}, r"\[0, 16\), got values in \[0, 16\]"
    ),
    "code too large": (lambda s: {s: torch.tensor([0, 16, 1, 2])}, r"\[0, 16\), got values in \[0, 16\]"),
    "negative code": (lambda s: {s: torch.tensor([0, -1, 1, 2])}, r"\[0, 16\)"),
    "float codes": (lambda s: {s: torch.zeros(4)}, "must be integers"),
    "unknown slot": (lambda s: {SLOTS + 5: torch.zeros(4, dtype=torch.long)}, "unknown code2wav slot"),
    "free slot": (lambda s: {1 - s: torch.zeros(4, dtype=torch.long)}, "unknown code2wav slot"),
    "slot not an int": (lambda s: {"0": torch.zeros(4, dtype=torch.long)}, "unknown code2wav slot"),
}


@pytest.fixture(scope="module")
def clean_rest(hf: Qwen3OmniMoeCode2Wav) -> np.ndarray:
    """Frames 1.. of slot 0's stream, in a streamer that never saw bad input."""
    clean = Code2WavStreamer(hf, max_slots=SLOTS)
    slot = clean.acquire()
    clean.step({slot: _frames(slot)[0]})
    return _continue(clean, [slot])[slot]


@pytest.mark.parametrize("case", list(BAD_STEPS))
def test_bad_step_raises_and_leaves_every_stream_intact(hf: Qwen3OmniMoeCode2Wav, clean_rest: np.ndarray,
                                                        case: str) -> None:
    make, message = BAD_STEPS[case]
    streamer = Code2WavStreamer(hf, max_slots=SLOTS)
    slot = streamer.acquire()
    streamer.step({slot: _frames(slot)[0]})
    before = _snapshot(streamer)
    # The bad frame comes together with a good one for the same call: neither runs.
    bad = make(slot)
    frames = bad if slot in bad else {slot: _frames(slot)[1]} | bad
    with pytest.raises(ValueError, match=message):
        streamer.step(frames)
    assert _unchanged(streamer, before)
    assert np.array_equal(_continue(streamer, [slot])[slot], clean_rest)  # the stream goes on as if untouched


def test_no_free_slot(hf: Qwen3OmniMoeCode2Wav) -> None:
    streamer = Code2WavStreamer(hf, max_slots=SLOTS)
    slots = [streamer.acquire() for _ in range(SLOTS)]
    streamer.step({s: _frames(s)[0] for s in slots})
    before = _snapshot(streamer)
    with pytest.raises(ValueError, match="no free code2wav slot"):
        streamer.acquire()
    assert _unchanged(streamer, before)
    streamer.release(slots[0])
    assert streamer.acquire() == slots[0]


@pytest.mark.parametrize("method", ["release", "finish"])
def test_unknown_slot_on_release_and_finish(hf: Qwen3OmniMoeCode2Wav, method: str) -> None:
    streamer = Code2WavStreamer(hf, max_slots=SLOTS)
    slot = streamer.acquire()
    streamer.step({slot: _frames(slot)[0]})
    before = _snapshot(streamer)
    for bad in (1 - slot, SLOTS, -1, "0"):
        with pytest.raises(ValueError, match="unknown code2wav slot"):
            getattr(streamer, method)(bad)
        assert _unchanged(streamer, before)
    getattr(streamer, method)(slot)
    with pytest.raises(ValueError, match="unknown code2wav slot"):  # twice
        getattr(streamer, method)(slot)
