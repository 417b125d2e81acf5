"""The duplex LM against transformers' MoshiForConditionalGeneration on the same tiny weights,
and its slot semantics (batch invariance, seeds, window ring, bad input)."""

from __future__ import annotations

import math

import pytest
import torch
from omnirt.codecs.mimi import MimiSlotPool
from omnirt.stages.duplex.lm import DuplexLM, DuplexSampling
from omnirt.stages.duplex.loader import load_duplex_lm

from .reference import K, run_stream, save_reference, teacher_forced

GREEDY = DuplexSampling(text_temperature=0.0, audio_temperature=0.0, seed=0)
FRAMES = 20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("moshi")
    return save_reference(path), path


def _load(path, max_slots: int = 4, **kwargs) -> tuple[DuplexLM, object]:
    return load_duplex_lm(
        path, max_slots=max_slots, device="cpu", dtype=torch.float32, graphs=False, **kwargs
    )


def _user(seed: int, frames: int = FRAMES) -> torch.Tensor:
    return torch.randint(0, 64, (frames, K), generator=torch.Generator().manual_seed(seed))


class _LogitSpy:
    """Records the logits each sampler sees (the sampler still runs)."""

    def __init__(self, lm: DuplexLM) -> None:
        self.text: list[torch.Tensor] = []
        self.audio: list[torch.Tensor] = []
        for sampler, store in ((lm.text_sampling, self.text), (lm.audio_sampling, self.audio)):
            draw = sampler.draw_with

            def spy(logits, uniform, draw=draw, store=store):
                store.append(logits.detach().clone())
                return draw(logits, uniform)

            sampler.draw_with = spy


def _check_parity(model, lm: DuplexLM, user: torch.Tensor, slot: int = 1, window: int | None = None) -> None:
    spy = _LogitSpy(lm)
    lm.start(slot, GREEDY)
    steps = run_stream(lm, slot, user)
    text_logits, depth_logits = teacher_forced(model, user, steps, window)
    ours_text = torch.stack([s.text for s in steps])
    ours_codes = torch.stack([s.delayed for s in steps])
    assert torch.equal(text_logits.argmax(-1), ours_text)
    assert torch.equal(depth_logits.argmax(-1), ours_codes)
    got_text = torch.stack([t[slot] for t in spy.text])
    got_audio = torch.stack(
        [torch.stack([a[slot] for a in spy.audio[i * K : (i + 1) * K]]) for i in range(len(steps))]
    )
    torch.testing.assert_close(got_text, text_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_audio, depth_logits, atol=1e-4, rtol=1e-4)
    # The whole frame of step n: semantic from step n - 1, acoustic from step n.
    assert not bool(steps[0].audio_ready) and all(bool(s.audio_ready) for s in steps[1:])
    for n in range(1, len(steps)):
        assert torch.equal(steps[n].audio, torch.cat((steps[n - 1].delayed[:1], steps[n].delayed[1:])))
    assert ours_text.unique().numel() > 3 and ours_codes.unique().numel() > 10  # not a constant stream


def test_greedy_stream_equals_transformers_teacher_forced(checkpoint):
    model, path = checkpoint
    lm, _ = _load(path)
    _check_parity(model, lm, _user(1))


def test_greedy_stream_of_real_audio_codes_equals_transformers(checkpoint):
    model, path = checkpoint
    lm, mimi = _load(path)
    pool = MimiSlotPool(mimi, max_slots=1)
    t = torch.arange(FRAMES * 1920) / 24_000
    audio = 0.3 * torch.sin(2 * math.pi * 220 * t * (1 + t)) + 0.05 * torch.randn(
        t.shape, generator=torch.Generator().manual_seed(2)
    )
    codes = pool.encode(audio[None])[0].T  # [frames, K]
    assert codes.unique().numel() > 5
    _check_parity(model, lm, codes)


def test_a_slot_is_bitwise_the_same_alone_and_in_a_crowded_batch(checkpoint):
    _, path = checkpoint
    user = _user(3)
    lm, _ = _load(path, max_slots=40)
    lm.start(5, GREEDY)
    alone = run_stream(lm, 5, user, batch=6)

    lm, _ = _load(path, max_slots=40)
    rows = 40
    others = torch.randint(0, 64, (FRAMES, rows, K), generator=torch.Generator().manual_seed(4))
    for slot in range(rows):
        if slot != 5:
            lm.start(slot, DuplexSampling(text_temperature=0.0, audio_temperature=0.0, seed=slot))
    warm = torch.ones(rows, dtype=torch.bool)
    warm[5] = False
    for _ in range(3):  # the others are mid-conversation when slot 5 starts
        lm.step(others[0], warm)
    lm.start(5, GREEDY)
    crowded = []
    for n in range(FRAMES):
        codes = others[n].clone()
        codes[5] = user[n]
        active = torch.ones(rows, dtype=torch.bool)
        active[7] = False  # an idle row in the middle
        active[rows - 1] = n % 2 == 0  # one that skips frames
        step = lm.step(codes, active)
        crowded.append((step.text[5], step.audio[5], step.delayed[5]))
    for a, c in zip(alone, crowded, strict=True):
        assert torch.equal(a.text, c[0]) and torch.equal(a.audio, c[1]) and torch.equal(a.delayed, c[2])
    assert lm.frames(5) == FRAMES and lm.frames(7) == 3 and lm.frames(rows - 1) == 3 + FRAMES // 2


def test_inactive_rows_keep_their_state_untouched(checkpoint):
    _, path = checkpoint
    lm, _ = _load(path, max_slots=4)
    for slot in range(4):
        lm.start(slot, GREEDY)
    lm.step(_user(5, 4), torch.ones(4, dtype=torch.bool))
    before = [
        t.clone()
        for t in (
            *lm.keys,
            *lm.values,
            lm.position,
            lm.text_prev,
            lm.model_prev,
            lm.user_prev,
            lm.text_sampling.counter,
            lm.audio_sampling.counter,
        )
    ]
    lm.step(_user(6, 4), torch.tensor([True, False, True, False]))
    after = (
        *lm.keys,
        *lm.values,
        lm.position,
        lm.text_prev,
        lm.model_prev,
        lm.user_prev,
        lm.text_sampling.counter,
        lm.audio_sampling.counter,
    )
    window = lm.max_frames  # the KV column past the window is the idle rows' scratch
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        if i < 2 * len(lm.keys):
            b, a = b[:, :, :window], a[:, :, :window]
        assert torch.equal(b[1], a[1]) and torch.equal(b[3], a[3])
    assert not torch.equal(before[0][0], lm.keys[0][0])  # an active row did write
    assert [lm.frames(s) for s in range(4)] == [2, 1, 2, 1]


def test_same_seed_same_sampled_stream_whatever_the_batch_or_slot(checkpoint):
    _, path = checkpoint
    user = _user(7, 12)
    sampled = DuplexSampling(
        text_temperature=1.0, text_top_k=0, audio_temperature=1.0, audio_top_k=0, seed=42
    )
    lm, _ = _load(path, max_slots=40)
    lm.start(0, sampled)
    first = run_stream(lm, 0, user)
    for slot in range(1, 40):
        lm.start(slot, DuplexSampling(text_temperature=1.0, audio_temperature=1.0, seed=slot))
    lm.start(33, sampled)
    codes = torch.randint(0, 64, (40, K), generator=torch.Generator().manual_seed(8))
    again = []
    for frame in user:
        codes[33] = frame
        step = lm.step(codes, torch.ones(40, dtype=torch.bool))
        again.append((step.text[33], step.delayed[33]))
    assert all(
        torch.equal(a.text, b[0]) and torch.equal(a.delayed, b[1]) for a, b in zip(first, again, strict=True)
    )
    lm.start(
        2, DuplexSampling(text_temperature=1.0, text_top_k=0, audio_temperature=1.0, audio_top_k=0, seed=43)
    )
    other = run_stream(lm, 2, user, batch=40)
    assert [int(s.text) for s in other] != [int(s.text) for s in first]
    assert not all(torch.equal(a.delayed, b.delayed) for a, b in zip(first, other, strict=True))


def test_window_ring_keeps_going_and_equals_the_reference(tmp_path):
    window = 8
    model = save_reference(tmp_path, seed=1, sliding_window=window, max_position_embeddings=window)
    lm, _ = _load(tmp_path)
    assert lm.max_frames == window
    _check_parity(model, lm, _user(9, window))  # up to the window: the reference's plain causal attention
    # Past it the ring wraps 3 times: each position attends to its last `window` positions,
    # the reference given the same sliding-window mask.
    user = _user(10, 3 * window + 3)
    _check_parity(model, lm, user, slot=2, window=window)
    assert lm.frames(2) == len(user) and int(lm.position[2]) == len(user)


def test_loader_rejects_missing_and_extra_keys_and_other_models(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    _, path = checkpoint
    tensors = load_file(str(path / "model.safetensors"))
    config = (path / "config.json").read_text()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(config)
    cut = dict(tensors)
    del cut["decoder.model.layers.1.mlp.fc1.weight"]
    cut["decoder.model.layers.9.extra.weight"] = torch.zeros(1)
    save_file(cut, str(broken / "model.safetensors"))
    with pytest.raises(
        ValueError,
        match=r"missing keys \[decoder.model.layers.1.mlp.fc1.weight\].*"
        r"unexpected keys \[decoder.model.layers.9.extra.weight\]",
    ):
        _load(broken)
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(config.replace('"model_type": "moshi"', '"model_type": "mimi"'))
    with pytest.raises(ValueError, match="model_type 'moshi'"):
        _load(other)
    codec_cut = {k: v for k, v in tensors.items() if not k.startswith("audio_encoder.quantizer")}
    save_file(codec_cut, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="codebooks"):
        _load(broken)


def test_bad_arguments_raise_and_leave_state_intact(checkpoint):
    _, path = checkpoint
    lm, _ = _load(path, max_slots=4)
    lm.start(0, GREEDY)
    lm.step(_user(11, 1), torch.tensor([True]))
    snapshot = [t.clone() for t in (*lm.keys, lm.position, lm.text_prev, lm.model_prev, lm.user_prev)]
    bad_steps = [
        (torch.zeros(1, K - 1, dtype=torch.long), torch.tensor([True])),  # wrong K
        (torch.zeros(5, K, dtype=torch.long), torch.ones(5, dtype=torch.bool)),  # more rows than slots
        (torch.zeros(1, K), torch.tensor([True])),  # float codes
        (torch.zeros(1, K, dtype=torch.long), torch.tensor([1])),  # int mask
        (torch.zeros(2, K, dtype=torch.long), torch.tensor([True])),  # mask of another length
        (torch.full((1, K), 64), torch.tensor([True])),  # code out of range
        (torch.zeros(2, K, dtype=torch.long), torch.tensor([True, True])),  # slot 1 never started
    ]
    for codes, active in bad_steps:
        with pytest.raises(ValueError):
            lm.step(codes, active)
    for slot, sampling in (
        (4, GREEDY),
        (-1, GREEDY),
        (0, DuplexSampling(text_temperature=-1.0)),
        (0, DuplexSampling(audio_top_k=-2)),
        (0, DuplexSampling(seed=1.5)),
        (0, "greedy"),
    ):
        with pytest.raises(ValueError):
            lm.start(slot, sampling)
    after = (*lm.keys, lm.position, lm.text_prev, lm.model_prev, lm.user_prev)
    assert all(torch.equal(b, a) for b, a in zip(snapshot, after, strict=True))
    assert lm.frames(0) == 1
    lm.stop(0)
    with pytest.raises(ValueError, match="start"):
        lm.step(_user(12, 1), torch.tensor([True]))


def test_dummy_weights_are_seeded_and_keep_activations_finite():
    from omnirt.stages.duplex.loader import dummy_duplex_lm

    from .reference import tiny_config

    config = tiny_config(num_hidden_layers=6)

    def stream(seed: int) -> list[int]:
        lm = dummy_duplex_lm(config, max_slots=2, device="cpu", dtype=torch.float32, seed=seed, graphs=False)
        spy = _LogitSpy(lm)
        lm.start(0, GREEDY)
        steps = run_stream(lm, 0, _user(13, 6))
        assert all(bool(torch.isfinite(t).all()) for t in (*spy.text, *spy.audio))
        assert 0.1 < float(torch.stack(spy.text).std()) < 100
        return [int(s.text) for s in steps] + [int(c) for s in steps for c in s.delayed]

    assert stream(0) == stream(0)
    assert stream(0) != stream(1)
