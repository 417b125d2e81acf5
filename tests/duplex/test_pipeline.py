"""DuplexPipeline over the fake LM and a real tiny Mimi: the tick, exec masks, slots, hold, ends."""

from __future__ import annotations

import numpy as np
import pytest
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


def _alone(make_mimi, audio: np.ndarray) -> list:
    """What one session gets for ``audio`` alone in the pipeline, frame by frame."""
    p = pipeline(make_mimi)
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


def test_one_frame_out_per_frame_in(make_mimi):
    p = pipeline(make_mimi)
    r = request("a")
    p.add(r)
    r.input.push(speech(5, seed=1))
    outputs = []
    for _ in range(5):
        outputs += [o for _, o in p.step()]
    assert isinstance(outputs[0], Started)
    audio = [o for o in outputs if isinstance(o, AudioDelta)]
    assert [len(a.pcm) for a in audio] == [FRAME] * 5
    assert all(a.pcm.dtype == np.int16 for a in audio)
    assert not audio[0].pcm.any()  # the acoustic delay: the first frame is silence
    assert all(a.pcm.any() for a in audio[1:])  # decoded Mimi audio
    text = "".join(o.text for o in outputs if isinstance(o, TextDelta))
    assert len(text) == 5 and audio[-1].text_chars == 5
    assert [a.text_chars for a in audio] == [1, 2, 3, 4, 5]
    assert p.calls["lm", 1] == 5 and p.calls["mimi_encode", 1] == 5 and p.calls["mimi_decode", 1] == 4
    assert not p.has_work()  # no input waiting: nothing to do until some comes
    r.input.end()
    assert p.has_work()
    ((rid, finished),) = p.step()
    assert rid == "a" and finished.reason == "stop" and finished.usage.input_audio_tokens == 5
    assert p.free_slots == 4


def test_late_input_is_masked_off(make_mimi):
    audio_a, audio_b = speech(3, seed=1), speech(3, seed=2)
    p = pipeline(make_mimi)
    a, b = request("a"), request("b")
    p.add(a)
    p.add(b)
    a.input.push(audio_a)
    b.input.push(audio_b[:FRAME])
    got = p.step() + p.step()  # b has no second frame yet: masked off
    assert sum(1 for rid, o in got if rid == "b" and isinstance(o, AudioDelta)) == 1
    assert sum(1 for rid, o in got if rid == "a" and isinstance(o, AudioDelta)) == 2
    assert p.calls["lm", 2] == 1 and p.calls["lm", 1] == 1
    assert p.lm.steps == [4, 4]  # rows are all slots on CPU, whoever is masked
    b.input.push(audio_b[FRAME:])
    a.input.end()
    b.input.end()
    while p.has_work():
        got += p.step()
    grouped = _by_request(got)
    assert _same(grouped["a"], _alone(make_mimi, audio_a))
    assert _same(grouped["b"], _alone(make_mimi, audio_b))


def test_leaving_from_the_middle(make_mimi):
    audios = {rid: speech(4, seed=i) for i, rid in enumerate("abc")}
    p = pipeline(make_mimi)
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
        assert _same(grouped[rid], _alone(make_mimi, audios[rid]))
    d = request("d")
    p.add(d)
    assert p.slot_of("d") == 0  # lowest free first


def test_held_session_takes_no_steps(make_mimi):
    audio_a, audio_b = speech(4, seed=3), speech(4, seed=4)
    p = pipeline(make_mimi)
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
    assert _same(grouped["a"], _alone(make_mimi, audio_a))
    assert _same(grouped["b"], _alone(make_mimi, audio_b))


def test_end_of_input_pads_the_last_partial_frame(make_mimi):
    p = pipeline(make_mimi)
    r = request("a")
    p.add(r)
    r.input.push(speech(2, seed=1)[: FRAME + 100])
    got = p.step() + p.step()
    assert sum(isinstance(o, AudioDelta) for _, o in got) == 1  # 100 samples: not a frame yet
    r.input.end()
    got = p.step()
    assert [type(o) for _, o in got] == [TextDelta, AudioDelta]
    ((_, finished),) = p.step()
    assert finished.reason == "stop" and finished.usage.input_audio_tokens == 2


def test_length_limit_and_rejections(make_mimi):
    p = pipeline(make_mimi, slots=1, max_frames=2)
    r = request("a")
    p.add(r)
    assert not p.can_add()
    with pytest.raises(RequestRejected):
        p.add(request("b"))
    r.input.push(speech(4, seed=1))
    p.step()
    p.step()
    ((_, finished),) = p.step()
    assert finished.reason == "length"
    assert p.can_add()


def test_clock_keeps_cadence_and_restarts_after_a_pause(make_mimi):
    p = pipeline(make_mimi)
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


def test_wrong_codebook_count_is_refused(make_mimi):
    from omnirt.stages.duplex.pipeline import DuplexPipeline

    from tests.duplex.fake_lm import GREEDY, FakeDuplexLM, LetterTokenizer
    from tests.duplex.helpers import INFO

    with pytest.raises(ValueError, match="codebooks"):
        DuplexPipeline(
            FakeDuplexLM(num_codebooks=4), make_mimi(), LetterTokenizer(), info=INFO, sampling=GREEDY
        )
