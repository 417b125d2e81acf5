"""Slot pool semantics: exec masks, sessions joining and leaving, bad input."""

from __future__ import annotations

import pytest
import torch
from omnirt.codecs.mimi import MimiSlotPool, build_mimi
from omnirt.codecs.mimi.config import MimiCodecConfig
from omnirt.codecs.mimi.reference import TINY_MIMI, random_reference_model

FRAME = 1920
SLOTS = 3
STEPS = 6


@pytest.fixture(scope="module")
def weights():
    model = random_reference_model(seed=2, **TINY_MIMI)
    return MimiCodecConfig.from_dict(model.config.to_dict()), model.state_dict()


def _pool(weights) -> MimiSlotPool:
    config, state = weights
    return MimiSlotPool(build_mimi(config, state), SLOTS)


def _snapshot(pool: MimiSlotPool) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in pool.model.state_buffers().items()}


def _same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _streams():
    generator = torch.Generator().manual_seed(3)
    audio = 0.1 * torch.randn(STEPS, SLOTS, FRAME, generator=generator)
    codes = torch.randint(0, TINY_MIMI["codebook_size"], (STEPS, SLOTS, 8, 1), generator=generator)
    return audio, codes


def _run(pool: MimiSlotPool, masks: list[list[bool]], resets: dict[int, list[int]]):
    audio, codes = _streams()
    enc, dec = [], []
    for step in range(STEPS):
        for slot in resets.get(step, []):
            pool.reset(slot)
        mask = torch.tensor(masks[step])
        enc.append(pool.encode(audio[step], mask))
        dec.append(pool.decode(codes[step], mask))
    return torch.stack(enc), torch.stack(dec)


def test_joining_and_leaving_changes_no_other_session_bitwise(weights):
    alone = [[True, False, True]] * STEPS
    busy = [
        [True, True, True],
        [True, True, True],
        [True, False, True],  # slot 1 leaves
        [True, True, True],  # a new session joins slot 1
        [True, True, True],
        [True, False, True],
    ]
    enc_a, dec_a = _run(_pool(weights), alone, {})
    enc_b, dec_b = _run(_pool(weights), busy, {3: [1]})
    for slot in (0, 2):
        assert torch.equal(enc_a[:, slot], enc_b[:, slot])
        assert torch.equal(dec_a[:, slot], dec_b[:, slot])
    # the session that joined at step 3 matches a fresh stream fed the same frames from step 3
    fresh = _pool(weights)
    audio, codes = _streams()
    for step in range(3, 5):
        mask = torch.tensor([False, True, False])
        assert torch.equal(fresh.encode(audio[step], mask)[1], enc_b[step, 1])
        assert torch.equal(fresh.decode(codes[step], mask)[1], dec_b[step, 1])


def test_idle_rows_keep_state_and_output_zeros(weights):
    pool = _pool(weights)
    audio, codes = _streams()
    pool.encode(audio[0])
    pool.decode(codes[0])
    before = _snapshot(pool)
    idle = torch.zeros(SLOTS, dtype=torch.bool)
    assert not pool.encode(audio[1], idle).any()
    assert not pool.decode(codes[1], idle).any()
    assert _same_state(before, _snapshot(pool))
    one = torch.tensor([False, True, False])
    pool.encode(audio[1], one)
    after = _snapshot(pool)
    changed = {name for name in before if not torch.equal(before[name][1], after[name][1])}
    assert changed  # the executed slot moved on...
    assert all(
        torch.equal(before[n][s], after[n][s]) for n in before for s in (0, 2)
    )  # ...the others did not


def test_smaller_batch_uses_lowest_slots(weights):
    pool, full = _pool(weights), _pool(weights)
    audio, _ = _streams()
    two = pool.encode(audio[0][:2])
    three = full.encode(audio[0])
    assert two.shape == (2, 8, 1)
    assert torch.equal(two, three[:2])


def test_a_moved_stream_goes_on_bitwise_as_unmoved(weights):
    # 16 rows: below about 12 rows MKL's GEMM moves a row's last bits with its row (the duplex
    # pipeline gives Mimi at least 16 rows on CPU for the same reason)
    config, state = weights
    rows, last = 16, 15
    generator = torch.Generator().manual_seed(4)
    audio = 0.1 * torch.randn(STEPS, rows, FRAME, generator=generator)
    codes = torch.randint(0, TINY_MIMI["codebook_size"], (STEPS, rows, 8, 1), generator=generator)
    pools = {name: MimiSlotPool(build_mimi(config, state), rows) for name in ("unmoved", "moved")}
    outputs = {}
    for name, pool in pools.items():
        here, enc, dec = last, [], []
        for step in range(STEPS):
            if name == "moved" and step == 3:  # slot 1 is free: the stream of slot 15 moves there
                pool.move(last, 1)
                here = 1
            mask = torch.zeros(rows, dtype=torch.bool)
            mask[[0, here]] = True
            batch_audio, batch_codes = audio[step].clone(), codes[step].clone()
            batch_audio[here], batch_codes[here] = audio[step, last], codes[step, last]
            enc.append(pool.encode(batch_audio, mask)[[0, here]])
            dec.append(pool.decode(batch_codes, mask)[[0, here]])
        outputs[name] = torch.stack(enc), torch.stack(dec)
    assert torch.equal(outputs["moved"][0], outputs["unmoved"][0])
    assert torch.equal(outputs["moved"][1], outputs["unmoved"][1])
    assert outputs["moved"][1][:, 1].abs().sum() > 0  # the stream did decode audio
    # the whole state of the stream lives in its new slot
    unmoved = pools["unmoved"].model.state_buffers()
    for name, buffer in pools["moved"].model.state_buffers().items():
        assert torch.equal(buffer[1], unmoved[name][last]), name


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda p: p.encode(torch.zeros(2, FRAME - 1)), "multiple of 1920"),
        (lambda p: p.encode(torch.zeros(2, 1, FRAME)), "shape"),
        (lambda p: p.encode(torch.zeros(SLOTS + 1, FRAME)), "max_slots"),
        (lambda p: p.encode(torch.zeros(2, FRAME, dtype=torch.int64)), "float"),
        (lambda p: p.encode(torch.zeros(2, FRAME), torch.ones(3, dtype=torch.bool)), "exec_mask"),
        (lambda p: p.encode(torch.zeros(2, FRAME), torch.ones(2)), "bool"),
        (lambda p: p.decode(torch.zeros(2, 7, 1, dtype=torch.int64)), "quantizers"),
        (lambda p: p.decode(torch.zeros(2, 8, 0, dtype=torch.int64)), "frame"),
        (lambda p: p.decode(torch.full((2, 8, 1), 64)), r"\[0, 64\)"),
        (lambda p: p.decode(torch.full((2, 8, 1), -1)), r"\[0, 64\)"),
        (lambda p: p.decode(torch.zeros(2, 8, 1)), "integer"),
        (lambda p: p.reset(SLOTS), "slot"),
        (lambda p: p.reset(-1), "slot"),
        (lambda p: p.move(0, SLOTS), "slot"),
        (lambda p: p.move(-1, 0), "slot"),
        (lambda p: p.move(True, 2), "slot"),
        (lambda p: p.move(1, 1), "onto itself"),
    ],
)
def test_bad_input_raises_without_changing_state(weights, call, message):
    pool = _pool(weights)
    audio, codes = _streams()
    pool.encode(audio[0])
    pool.decode(codes[0])
    before = _snapshot(pool)
    with pytest.raises(ValueError, match=message):
        call(pool)
    assert _same_state(before, _snapshot(pool))


@pytest.mark.parametrize(
    ("max_slots", "buckets", "expected"),
    [
        (100, None, [1, 2, 4, 8, 16, 32, 64, 100]),  # max_slots between two default buckets
        (64, None, [1, 2, 4, 8, 16, 32, 64]),
        (1, None, [1]),
        (8, [1, 8], [1, 8]),
        (5, [1, 8], [1, 5]),
        (3, [16], [3]),
    ],
)
def test_max_slots_is_always_a_graph_bucket(weights, max_slots, buckets, expected):
    config, state = weights
    pool = MimiSlotPool(build_mimi(config, state), max_slots, buckets=buckets)
    assert pool.buckets == expected


def test_dtype_follows_the_weights(weights):
    config, state = weights
    model = build_mimi(config, state, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    assert model.quantizer.codebooks.dtype == torch.float32  # the quantizer stays float32
    pool = MimiSlotPool(model, SLOTS)
    assert all(
        t.dtype == torch.bfloat16
        for name, t in pool.model.state_buffers().items()
        if not name.endswith(("position", "ring_positions", "started"))
    )
    assert build_mimi(config, state).dtype == torch.float32
