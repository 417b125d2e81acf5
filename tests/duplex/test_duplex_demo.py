"""The embedded default's tiny duplex model: deterministic, decodable, with on/off speech."""

from __future__ import annotations

import torch
from omnirt.codecs.mimi import MimiSlotPool
from omnirt.stages.duplex.demo import demo_duplex
from omnirt.stages.duplex.lm import DuplexSampling

STEPS = 200


def _stream(lm, seed: int) -> tuple[list[int], list[torch.Tensor]]:
    lm.start(0, DuplexSampling(seed=seed))
    generator = torch.Generator().manual_seed(0)
    text, frames = [], []
    for _ in range(STEPS):
        step = lm.step(torch.randint(0, 64, (1, 8), generator=generator), torch.tensor([True]))
        text.append(int(step.text[0]))
        if bool(step.audio_ready[0]):
            frames.append(step.audio[0])
    return text, frames


def _runs(flags: list[bool]) -> list[tuple[bool, int]]:
    runs: list[tuple[bool, int]] = []
    for flag in flags:
        if runs and runs[-1][0] == flag:
            runs[-1] = (flag, runs[-1][1] + 1)
        else:
            runs.append((flag, 1))
    return runs


def test_demo_is_deterministic_and_speaks_in_stretches():
    lm, mimi, tokenizer = demo_duplex(2, "cpu", graphs=False)
    text, frames = _stream(lm, seed=1)
    again, _ = _stream(demo_duplex(2, "cpu", graphs=False)[0], seed=1)
    assert text == again
    pads = [t in lm.text_pad_ids for t in text]
    assert 0.3 < sum(pads) / len(pads) < 0.95
    runs = _runs(pads)
    speech = [n for is_pad, n in runs if not is_pad]
    assert len(speech) >= 3 and max(speech) >= 3  # stretches that start and end
    words = tokenizer.decode([t for t in text if t not in lm.text_pad_ids])
    letters = sum(c in "abcdefghijklmnopqrstuvwxyz " for c in words)
    assert len(words) >= 10 and letters >= 0.8 * len(words)  # mostly babbled lowercase words
    # Its codes decode through its 80 ms Mimi.
    assert mimi.frame_size == 1920 and len(frames) == STEPS - 1
    pool = MimiSlotPool(mimi, max_slots=1)
    audio = pool.decode(torch.stack(frames[:5]).T[None])
    assert audio.shape == (1, 5 * 1920) and bool(torch.isfinite(audio).all()) and float(audio.abs().max()) > 0


def test_demo_audio_is_silent_when_its_text_is():
    """Silence codes after padding text, decoded to exact zeros: the audio level agrees with the
    text on where the demo talks (see demo.py)."""
    lm, mimi, _ = demo_duplex(1, "cpu", graphs=False)
    text, frames = _stream(lm, seed=1)
    pool = MimiSlotPool(mimi, max_slots=1)
    audio = [pool.decode(f[None, :, None])[0] for f in frames]  # frame n + 1 follows text[n]
    pads = [t in lm.text_pad_ids for t in text]
    silent = [n for n in range(8, len(audio)) if all(pads[n - 8 : n + 2])]
    talking = [n for n in range(1, len(audio)) if not any(pads[n - 1 : n + 2])]
    assert len(silent) > 20 and len(talking) > 10
    assert all(not audio[n].any() for n in silent)  # exact silence
    assert all(float(audio[n].pow(2).mean().sqrt()) > 0.05 for n in talking)  # loud (above -26 dBFS)
