"""DuplexPipeline over the embedded demo LM (tiny Moshi, sampled with a fixed seed) and its Mimi:
the tick, exec masks, slots, hold, ends; a session's output is bitwise the same alone and in a batch."""

from __future__ import annotations

import numpy as np
import pytest
from omnirt.stages.duplex.lm import DuplexSampling
from omnirt.stages.pipeline import RequestRejected
from omnirt.stages.types import AudioDelta, Finished, Started, TextDelta

from tests.duplex.helpers import FRAME, pipeline, request, speech


def _by_request(outputs):
    grouped: dict[str, list] = {}
    for rid, output in outputs:
        grouped.setdefault(rid, []).append(output)
    return grouped


def _frames(outputs) -> list[tuple[str, np.ndarray, int]]:
    """Per stepped frame: (text of the frame, pcm, text_chars)."""
    out, text = [], ""
    for o in outputs:
        if isinstance(o, TextDelta):
            text += o.text
        elif isinstance(o, AudioDelta):
            out.append((text, o.pcm, o.text_chars))
            text = ""
    return out


def _alone(audio: np.ndarray, slots: int = 4) -> list:
    """What one session gets for ``audio`` alone in the pipeline, frame by frame."""
    p = pipeline(slots=slots)
    r = request("alone")
    p.add(r)
    r.input.push(audio)
    r.input.end()
    outputs = []
    while p.has_work():
        outputs += [o for _, o in p.step()]
    assert isinstance(outputs[-1], Finished)
    return outputs


def _same(a: list, b: list) -> bool:
    fa, fb = _frames(a), _frames(b)
    return len(fa) == len(fb) and all(
        ta == tb and ca == cb and np.array_equal(pa, pb)
        for (ta, pa, ca), (tb, pb, cb) in zip(fa, fb, strict=True)
    )


def test_one_frame_out_per_frame_in():
    frames = 40
    p = pipeline()
    r = request("a")
    p.add(r)
    r.input.push(speech(frames, seed=1))
    outputs = []
    for _ in range(frames):
        outputs += [o for _, o in p.step()]
    assert isinstance(outputs[0], Started)
    audio = [o for o in outputs if isinstance(o, AudioDelta)]
    assert [len(a.pcm) for a in audio] == [FRAME] * frames
    assert all(a.pcm.dtype == np.int16 for a in audio)
    assert not audio[0].pcm.any()  # the acoustic delay: the first frame is silence
    loud = [bool(np.abs(a.pcm).max() > 1000) for a in audio]
    assert any(loud) and not all(loud)  # the demo talks in stretches (loud) and is silent between
    text = "".join(o.text for o in outputs if isinstance(o, TextDelta))
    assert text and audio[-1].text_chars == len(text)
    chars = [a.text_chars for a in audio]
    assert chars == sorted(chars)
    assert p.calls["lm", 1] == frames and p.calls["mimi_encode", 1] == frames
    assert p.calls["mimi_decode", 1] == frames - 1
    assert not p.has_work()  # no input waiting: nothing to do until some comes
    r.input.end()
    assert p.has_work()
    ((rid, finished),) = p.step()
    assert rid == "a" and finished.reason == "stop" and finished.usage.input_audio_tokens == frames
    assert p.free_slots == 4


def test_late_input_is_masked_off():
    audio_a, audio_b = speech(3, seed=1), speech(3, seed=2)
    p = pipeline()
    a, b = request("a"), request("b")
    p.add(a)
    p.add(b)
    a.input.push(audio_a)
    b.input.push(audio_b[:FRAME])
    got = p.step() + p.step()  # b has no second frame yet: masked off
    assert sum(1 for rid, o in got if rid == "b" and isinstance(o, AudioDelta)) == 1
    assert sum(1 for rid, o in got if rid == "a" and isinstance(o, AudioDelta)) == 2
    assert p.calls["lm", 2] == 1 and p.calls["lm", 1] == 1
    assert p.lm.frames(p.slot_of("b")) == 1  # masked off: its state did not move
    b.input.push(audio_b[FRAME:])
    a.input.end()
    b.input.end()
    while p.has_work():
        got += p.step()
    grouped = _by_request(got)
    assert _same(grouped["a"], _alone(audio_a))
    assert _same(grouped["b"], _alone(audio_b))


def test_leaving_from_the_middle():
    audios = {rid: speech(4, seed=i) for i, rid in enumerate("abc")}
    p = pipeline()
    reqs = {rid: request(rid) for rid in "abc"}
    for rid in "abc":
        p.add(reqs[rid])
        reqs[rid].input.push(audios[rid])
    got = p.step() + p.step()
    assert p.slot_of("b") == 1
    usage = p.remove("b")
    assert usage is not None and usage.input_audio_tokens == 2
    got = [(rid, o) for rid, o in got if rid != "b"]
    for rid in "ac":
        reqs[rid].input.end()
    while p.has_work():
        got += p.step()
    grouped = _by_request(got)
    for rid in "ac":
        assert _same(grouped[rid], _alone(audios[rid]))
    d = request("d")
    p.add(d)
    assert p.slot_of("d") == 0  # lowest free first


def test_held_session_takes_no_steps():
    audio_a, audio_b = speech(4, seed=3), speech(4, seed=4)
    p = pipeline()
    a, b = request("a"), request("b")
    p.add(a)
    p.add(b)
    a.input.push(audio_a)
    b.input.push(audio_b)
    got = p.step()
    p.hold("b", True)
    got += p.step() + p.step()
    assert sum(1 for rid, o in got if rid == "b" and isinstance(o, AudioDelta)) == 1
    assert b.input.held == 3 * FRAME
    b.input.end()
    assert p.has_work()  # a still has a frame
    got += p.step()
    a.input.end()
    got += p.step()  # a ends; b is held: no end for it either
    assert not p.has_work()
    p.hold("b", False)
    while p.has_work():
        got += p.step()
    grouped = _by_request(got)
    assert _same(grouped["a"], _alone(audio_a))
    assert _same(grouped["b"], _alone(audio_b))


def test_end_of_input_pads_the_last_partial_frame():
    p = pipeline()
    r = request("a")
    p.add(r)
    r.input.push(speech(2, seed=1)[: FRAME + 100])
    got = p.step() + p.step()
    assert sum(isinstance(o, AudioDelta) for _, o in got) == 1  # 100 samples: not a frame yet
    r.input.end()
    got = p.step()
    assert sum(isinstance(o, AudioDelta) for _, o in got) == 1
    ((_, finished),) = p.step()
    assert finished.reason == "stop" and finished.usage.input_audio_tokens == 2


def test_a_session_is_bitwise_the_same_alone_and_among_twenty():
    """On CPU the LM and Mimi run at least 16 rows: 21 busy slots (LM bucket 24) give slot 0 the
    same bits as slot 0 alone (16 rows)."""
    frames = 30
    audio = speech(frames, seed=5)
    alone = _alone(audio, slots=32)
    assert any(np.abs(pcm).max() > 1000 for _, pcm, _ in _frames(alone))  # it talks: real audio to compare
    p = pipeline(slots=32)
    reqs = [request(f"r{i}") for i in range(21)]
    for i, r in enumerate(reqs):
        p.add(r)
        r.input.push(audio if i == 0 else speech(frames, seed=10 + i))
        r.input.end()
    got = []
    while p.has_work():
        got += p.step()
    assert p.calls["lm", 21] == frames
    assert _same(_by_request(got)["r0"], alone)


def test_rejections_leave_the_slots_as_they_were():
    p = pipeline(slots=1)
    with pytest.raises(RequestRejected, match="text_temperature"):
        p.add(request("bad", sampling=DuplexSampling(text_temperature=-1.0)))
    assert p.can_add() and p.free_slots == 1
    r = request("a")
    p.add(r)
    assert not p.can_add()
    with pytest.raises(RequestRejected, match="no free duplex slot"):
        p.add(request("b"))
    with pytest.raises(RequestRejected, match="already in flight"):
        p.add(request("a"))
    r.input.push(speech(2, seed=1))
    r.input.end()
    while p.has_work():
        p.step()
    assert p.can_add()


def test_clock_keeps_cadence_and_restarts_after_a_pause():
    p = pipeline()
    now = [100.0]
    p.clock = lambda: now[0]
    r = request("a")
    p.add(r)
    assert p.next_deadline() is None
    r.input.push(speech(3, seed=1))
    p.step()
    assert p.next_deadline() == pytest.approx(100.08)
    now[0] = 100.09  # 10 ms late: the cadence holds
    p.step()
    assert p.next_deadline() == pytest.approx(100.16)
    now[0] = 105.0  # a pause: the cadence restarts
    p.step()
    assert p.next_deadline() == pytest.approx(105.08)


def test_wrong_codebook_count_is_refused():
    from omnirt.codecs.mimi import build_mimi
    from omnirt.codecs.mimi.config import MimiCodecConfig
    from omnirt.codecs.mimi.reference import TINY_MIMI, random_reference_model
    from omnirt.stages.duplex.demo import demo_duplex
    from omnirt.stages.duplex.pipeline import DuplexPipeline

    from tests.duplex.helpers import INFO, SEEDED

    lm, _, tokenizer = demo_duplex(2, "cpu", graphs=False)
    model = random_reference_model(seed=5, **TINY_MIMI)
    mimi = build_mimi(MimiCodecConfig.from_dict(model.config.to_dict()), model.state_dict(), num_quantizers=4)
    with pytest.raises(ValueError, match="codebooks"):
        DuplexPipeline(lm, mimi, tokenizer, info=INFO, sampling=SEEDED)
