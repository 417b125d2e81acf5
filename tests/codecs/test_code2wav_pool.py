"""Batching across sessions: exec masks, sessions joining and leaving, slot reset (CPU fp32, bitwise)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omnirt.codecs.code2wav import Code2WavModel, Code2WavPool, Code2WavStreamer
from omnirt.codecs.code2wav.random_init import randomize_, tiny_code2wav_config
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

SLOTS = 3
STEPS = 8


@pytest.fixture(scope="module")
def hf() -> Qwen3OmniMoeCode2Wav:
    return randomize_(Qwen3OmniMoeCode2Wav(tiny_code2wav_config()).eval(), 4)


def _session_codes(seed: int, frames: int = STEPS) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 16, (frames, 4), generator=generator)


def _alone(hf: Qwen3OmniMoeCode2Wav, codes: torch.Tensor, slot: int) -> np.ndarray:
    """One session in the same slot of a pool of the same size, every other slot idle.
    (Bitwise equality holds per row position: CPU kernels may round a row differently at
    another index of the batch, whatever the other rows hold.)"""
    streamer = Code2WavStreamer(hf, max_slots=SLOTS)
    taken = [streamer.acquire() for _ in range(slot + 1)]
    for other in taken[:-1]:
        streamer.release(other)
    assert taken[-1] == slot
    return np.concatenate([streamer.step({slot: frame})[slot] for frame in codes])


def test_joining_and_leaving_change_no_other_session(hf: Qwen3OmniMoeCode2Wav) -> None:
    a, b, c = _session_codes(1), _session_codes(2, 3), _session_codes(3, 4)
    streamer = Code2WavStreamer(hf, max_slots=SLOTS)
    out: dict[str, list[np.ndarray]] = {"a": [], "b": [], "c": []}
    slot_a = streamer.acquire()
    slot_b = slot_c = -1
    for step in range(STEPS):
        if step == 2:
            slot_b = streamer.acquire()  # b joins mid-stream
        if step == 4:
            slot_c = streamer.acquire()  # c joins while b is active
        if step == 5:
            streamer.release(slot_b)  # b leaves (cancelled) before c and a end
        frames = {slot_a: a[step]}
        if 2 <= step < 5:
            frames[slot_b] = b[step - 2]
        if step >= 4:
            frames[slot_c] = c[step - 4]
        result = streamer.step(frames)
        for name, slot in (("a", slot_a), ("b", slot_b), ("c", slot_c)):
            if slot in result:
                out[name].append(result[slot])

    assert (slot_a, slot_b, slot_c) == (0, 1, 2)
    for name, codes, slot in (("a", a, slot_a), ("b", b, slot_b), ("c", c, slot_c)):
        together = np.concatenate(out[name])
        assert np.array_equal(together, _alone(hf, codes, slot)), name


def test_rows_without_a_frame_keep_their_state_bitwise(hf: Qwen3OmniMoeCode2Wav) -> None:
    pool = Code2WavPool(Code2WavModel.from_hf(hf), SLOTS)
    codes = _session_codes(5, 3)
    pool.step(torch.stack([codes[:1]] * SLOTS), torch.tensor([1, 1, 1]))
    before = {k: v.clone() for k, v in pool.state.items()}
    pool.step(torch.stack([codes[1:]] * SLOTS), torch.tensor([2, 0, 1]))
    idle_changed = {k for k, v in pool.state.items() if not torch.equal(v[1], before[k][1])}
    assert idle_changed == set()
    busy_changed = {k for k, v in pool.state.items() if not torch.equal(v[[0, 2]], before[k][[0, 2]])}
    assert busy_changed == set(pool.state)  # every state tensor advances on executing rows
    assert pool.state["frame"].tolist() == [3, 1, 2]


def test_reset_slot_equals_fresh_pool(hf: Qwen3OmniMoeCode2Wav) -> None:
    first, second = _session_codes(6, 5), _session_codes(7, 5)
    streamer = Code2WavStreamer(hf, max_slots=SLOTS)
    slots = [streamer.acquire() for _ in range(SLOTS)]
    for frame in first:  # every slot gets state
        streamer.step(dict.fromkeys(slots, frame))
    streamer.release(slots[1])
    streamer.release(slots[2])
    reused = streamer.acquire()  # the lowest free slot
    assert reused == slots[1]
    after_reset = np.concatenate([streamer.step({reused: f, slots[0]: f})[reused] for f in second])

    fresh = Code2WavStreamer(hf, max_slots=SLOTS)
    fresh_slots = [fresh.acquire() for _ in range(2)]
    assert fresh_slots[1] == reused
    in_fresh = np.concatenate([fresh.step({fresh_slots[1]: f, fresh_slots[0]: f})[fresh_slots[1]]
                               for f in second])
    assert np.array_equal(after_reset, in_fresh)


def test_step_io_on_the_first_slots_leaves_the_rest_alone(hf: Qwen3OmniMoeCode2Wav) -> None:
    """``step_io`` (the form a graph runner captures) on ``b`` rows steps slots ``0..b-1``
    like the whole-pool step does, and touches no state row from ``b`` on."""
    model = Code2WavModel.from_hf(hf)
    prefix, whole = Code2WavPool(model, SLOTS), Code2WavPool(model, SLOTS)
    idle = prefix.make_inputs(2, steps=2)
    assert idle["codes"].shape == (2, 2, 4) and not idle["counts"].any()
    codes = _session_codes(8, 6)
    for pair in codes.view(3, 2, 4):
        before = {k: v[2:].clone() for k, v in prefix.state.items()}
        out = prefix.step_io({"codes": torch.stack([pair, pair]), "counts": torch.tensor([2, 0])})
        expected = whole.step(torch.stack([pair] * SLOTS), torch.tensor([2, 0, 0]))
        assert out["wav"].shape == (2, 2 * 1920)
        torch.testing.assert_close(out["wav"][0], expected[0], rtol=1e-6, atol=1e-6)
        assert all(torch.equal(v[2:], before[k]) for k, v in prefix.state.items())
    assert prefix.state["frame"].tolist() == whole.state["frame"].tolist() == [6, 0, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_precomputed_buffers_follow_the_weights(hf: Qwen3OmniMoeCode2Wav, dtype: torch.dtype) -> None:
    """The SnakeBeta factors and constant index tensors are rebuilt by the pool after its cast,
    from the cast weights, and are not part of the state dict (its keys stay transformers')."""
    pool = Code2WavPool(Code2WavModel.from_hf(hf), SLOTS, dtype=dtype)
    model = pool.model
    assert model.state_dict().keys() == hf.state_dict().keys()
    snakes = [m for m in model.modules() if type(m).__name__ == "SnakeBeta"]
    assert len(snakes) == 1 + 4 * (1 + 3 * 2)  # the last activation, and 1 + 3 * 2 per decoder block
    for snake in snakes:
        assert snake.exp_alpha.dtype == snake.inv_beta.dtype == dtype
        assert torch.equal(snake.exp_alpha, torch.exp(snake.alpha)[:, None])
        assert torch.equal(snake.inv_beta, 1.0 / (torch.exp(snake.beta)[:, None] + 0.000000001))
    assert torch.equal(model.pre_transformer.ring_index, torch.arange(hf.config.sliding_window))
