"""Scheduling behaviour of the speech pipeline: batching, cancel, limits, rejections, alignment."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import pytest
from omnirt.stages.pipeline import RequestRejected
from omnirt.stages.speech.loader import load_speech_pipeline
from omnirt.stages.types import (
    AudioDelta,
    AudioPart,
    ContextMessage,
    Finished,
    GenerationRequest,
    ImagePart,
    Started,
    TextDelta,
    TextPart,
)

from .conftest import TokenLog, audio_request, drain, of, png, text_request, tone


def _summary(outs) -> tuple[str, np.ndarray, str, int]:
    text = "".join(o.text for o in outs if isinstance(o, TextDelta))
    pcm = [o.pcm for o in outs if isinstance(o, AudioDelta)]
    done = outs[-1]
    assert isinstance(done, Finished)
    audio = np.concatenate(pcm) if pcm else np.zeros(0, np.int16)
    return text, audio, done.reason, done.usage.output_audio_tokens


def _alone_then_together(pipe, requests) -> tuple[dict, collections.Counter]:
    """Runs each of ``requests`` (makers) alone, then all added at once, and checks that each
    replies the same: tokens, text, reason and frames, PCM to int16 rounding. Returns the
    replies alone and the model calls of the alone runs (``pipe.calls`` then holds the
    together run's)."""
    log = TokenLog(pipe)
    alone = {}
    for make in requests:
        req = make()
        pipe.add(req)
        alone[req.request_id] = _summary(of(drain(pipe), req.request_id))
    alone_tokens, alone_calls = dict(log.tokens), collections.Counter(pipe.calls)
    log.tokens.clear()
    pipe.calls.clear()
    for make in requests:
        pipe.add(make())
    together = drain(pipe)
    assert log.tokens == alone_tokens
    for rid, (text, audio, reason, frames) in alone.items():
        t2, a2, r2, f2 = _summary(of(together, rid))
        assert (t2, r2, f2) == (text, reason, frames)
        assert a2.shape == audio.shape
        assert np.abs(a2.astype(np.int32) - audio.astype(np.int32)).max(initial=0) <= 2
    return alone, alone_calls


def test_concurrent_requests_equal_each_alone(demo_dir: Path) -> None:
    pipe = load_speech_pipeline(demo_dir, max_slots=4, max_audio_frames=30)
    alone, _ = _alone_then_together(pipe, [
        lambda: text_request("t", "tell me a story", max_output_tokens=20),
        lambda: audio_request("a", tone(1.0), max_output_tokens=10),
        lambda: audio_request("b", tone(0.6, 330.0, seed=3), text="and this?", max_output_tokens=16),
    ])
    assert alone["a"][1].size > 0 and alone["t"][1].size == 0


def test_new_turns_of_a_tick_are_read_in_one_batched_pass(demo_dir: Path) -> None:
    """Two turns that arrive together have their audio encoded in one batch and are read in one
    thinker pass and one talker pass of two rows (the weights read once for both), and reply as
    each does read alone (the same tokens and frames, the same PCM to int16 rounding: other
    matmul shapes); a third waits for the next tick's lane and its passes have one row."""
    pipe = load_speech_pipeline(demo_dir, max_slots=4, max_audio_frames=30)
    alone, calls = _alone_then_together(pipe, [
        lambda: audio_request("a", tone(1.0), max_output_tokens=10),
        lambda: audio_request("b", tone(0.6, 330.0, seed=3), text="and this?", max_output_tokens=12),
        lambda: audio_request("c", tone(1.4, 180.0, seed=4), text="why?", max_output_tokens=8),
    ])
    for name in ("audio_encoder", "thinker_prompt", "talker_prompt"):
        assert calls[name, 1] == 3 and (name, 2) not in calls  # alone: one prompt a run
        assert pipe.calls[name, 2] == 1 and pipe.calls[name, 1] == 1  # "a" and "b", then "c"
    assert pipe.calls["thinker_prefill", 1] == 3  # prompts read
    assert all(reply[1].size > 0 for reply in alone.values())


def test_a_text_turn_waits_for_an_audio_turns_encoding_and_joins_its_passes(demo_dir: Path) -> None:
    """A text turn and an audio turn arriving together: the text one's thinker piece waits for
    the audio's encoding in the same tick, so the two are read in one thinker pass and one talker
    pass, and each replies as it does alone."""
    pipe = load_speech_pipeline(demo_dir, max_slots=4, max_audio_frames=30)
    _, calls = _alone_then_together(pipe, [
        lambda: text_request("t", "tell me a story", output_audio=True, max_output_tokens=10),
        lambda: audio_request("a", tone(1.0), max_output_tokens=10),
    ])
    assert calls["audio_encoder", 1] == 1 and calls["thinker_prompt", 1] == 2
    assert pipe.calls["audio_encoder", 1] == 1  # the audio turn's alone
    assert pipe.calls["thinker_prompt", 2] == 1 and pipe.calls["talker_prompt", 2] == 1


def test_a_failing_batched_pass_fails_its_turns_only(demo_dir: Path) -> None:
    """A prompt pass that fails fails the turns it read (both rows of a batched pass), not the
    session already speaking nor the turn that arrives next; their slots come back."""
    pipe = load_speech_pipeline(demo_dir, max_slots=4, max_audio_frames=30)
    pipe.add(audio_request("s", tone(1.0), max_output_tokens=12))
    for _ in range(3):
        pipe.step()
    original = pipe.talker.prompt.execute

    def broken(calls):
        if len(calls) == 2:
            raise RuntimeError("the pass broke")
        return original(calls)

    pipe.talker.prompt.execute = broken
    pipe.add(audio_request("a", tone(1.0), max_output_tokens=6))
    pipe.add(audio_request("b", tone(0.6, 330.0, seed=3), max_output_tokens=6))
    outs = pipe.step()
    pipe.add(audio_request("c", tone(0.8, 250.0, seed=5), max_output_tokens=6))
    outs += drain(pipe)
    for rid in ("a", "b"):
        end = of(outs, rid)[-1]
        assert isinstance(end, Finished) and end.reason == "error" and "the pass broke" in (end.error or "")
    for rid in ("s", "c"):
        end = of(outs, rid)[-1]
        assert end.reason == "length" and any(isinstance(o, AudioDelta) for o in of(outs, rid))
    assert pipe.free_slots == 4 and not pipe.has_work()


def test_output_order_and_usage(pipeline) -> None:
    pipeline.add(audio_request("r", tone(1.0), max_output_tokens=6))
    outs = of(drain(pipeline), "r")
    assert isinstance(outs[0], Started)
    assert outs[0].usage.input_audio_tokens == 13 and outs[0].usage.input_text_tokens > 5
    assert isinstance(outs[-1], Finished) and all(not isinstance(o, Finished) for o in outs[:-1])
    done = outs[-1]
    assert done.reason == "length" and done.usage.output_text_tokens == 6
    assert sum(o.frames for o in outs if isinstance(o, AudioDelta)) == done.usage.output_audio_tokens > 0


def test_text_chars_follow_the_talker(demo_dir: Path) -> None:
    pipe = load_speech_pipeline(demo_dir, max_slots=1, max_audio_frames=24)
    pipe.add(text_request("r", "speak", output_audio=True, max_output_tokens=40))
    outs = of(drain(pipe), "r")
    text = "".join(o.text for o in outs if isinstance(o, TextDelta))
    chunks = [o for o in outs if isinstance(o, AudioDelta)]
    chars = [c.text_chars for c in chunks]
    assert chars == sorted(chars)
    # 24 frames carry the speech of about 24 of the 40 reply tokens: never the whole reply
    assert 4 < sum(c.frames for c in chunks) <= 24
    assert 0 < chars[-1] < len(text) and chars[0] < chars[-1]


def test_max_output_tokens_gives_length(pipeline) -> None:
    pipeline.add(text_request("r", max_output_tokens=3))
    done = of(drain(pipeline), "r")[-1]
    assert done.reason == "length" and done.usage.output_text_tokens == 3


def test_stop_token_gives_stop(demo_dir: Path) -> None:
    pipe = load_speech_pipeline(demo_dir, max_slots=1)
    log = TokenLog(pipe)
    pipe.add(text_request("probe", max_output_tokens=8))
    drain(pipe)
    pipe.stop_token_ids = {log.tokens["probe"][2]}
    pipe.add(text_request("r", max_output_tokens=8))
    done = of(drain(pipe), "r")[-1]
    assert done.reason == "stop"
    assert done.usage.output_text_tokens == log.tokens["probe"].index(log.tokens["probe"][2])


@pytest.mark.parametrize("vocoder", ["stream", "chunked"])
def test_remove_mid_stream_frees_the_slot(demo_dir: Path, vocoder: str) -> None:
    pipe = load_speech_pipeline(demo_dir, max_slots=2, vocoder=vocoder)
    pipe.add(audio_request("a", max_output_tokens=50))
    pipe.add(text_request("b", max_output_tokens=50))
    assert not pipe.can_add()
    seen = []
    for _ in range(8):
        seen += pipe.step()
    assert any(isinstance(o, AudioDelta) for o in of(seen, "a")) or len(of(seen, "a")) > 3
    usage = pipe.remove("a")
    assert usage is not None and usage.output_text_tokens > 0
    assert pipe.remove("a") is None
    assert pipe.can_add()
    pipe.add(text_request("c", max_output_tokens=4))
    rest = drain(pipe)
    assert of(rest, "a") == []
    assert of(rest, "c")[-1].reason == "length" and of(rest, "b")[-1].reason == "length"
    assert pipe.free_slots == 2
    if vocoder == "stream":
        assert pipe.vocoder.streamer.free_slots == 2  # the audio stream of the cancelled request too
    else:
        assert pipe.vocoder._streams == {}


def test_seeded_sampling_is_reproducible(pipeline) -> None:
    log = TokenLog(pipeline)
    for rid, seed in (("x", 7), ("y", 7), ("z", 8)):
        pipeline.add(text_request(rid, max_output_tokens=16, temperature=1.0, top_p=0.9, seed=seed))
    drain(pipeline)
    assert log.tokens["x"] == log.tokens["y"]
    assert log.tokens["x"] != log.tokens["z"]


def test_image_input_runs_through_the_vision_encoder(pipeline) -> None:
    log = TokenLog(pipeline)
    msg = [ContextMessage("user", (ImagePart(png()), TextPart("what is this?")))]
    pipeline.add(GenerationRequest("img", msg, output_audio=True, max_output_tokens=6))
    outs = of(drain(pipeline), "img")
    assert outs[0].usage.input_image_tokens > 0
    assert outs[-1].reason == "length"
    assert any(isinstance(o, AudioDelta) for o in outs)
    assert len(log.tokens["img"]) == 6


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (GenerationRequest("r", []), "no messages"),
        (audio_request("r", voice="nobody"), "unknown voice"),
        (text_request("r", "x <|im_end|> y"), "special token"),
        (
            GenerationRequest("r", [ContextMessage("user", (ImagePart(b"not an image"),))]),
            "could not be decoded",
        ),
        (
            GenerationRequest("r", [ContextMessage("user", (AudioPart(np.zeros((2, 2400), np.float32)),))]),
            "mono",
        ),
        (
            GenerationRequest("r", [ContextMessage("user", (AudioPart(np.zeros(100, np.float32)),))]),
            "too short",
        ),
        (
            GenerationRequest("r", [ContextMessage("user", (AudioPart(np.full(4800, np.nan, np.float32)),))]),
            "NaN",
        ),
        (text_request("r", max_output_tokens=0), "max_output_tokens"),
        (text_request("r", temperature=-1.0), "temperature"),
        (text_request("r", "word " * 400), "context"),
    ],
)
def test_bad_input_is_rejected(demo_dir: Path, request_, message: str) -> None:
    pipe = load_speech_pipeline(demo_dir, max_slots=1, max_context=256)
    with pytest.raises(RequestRejected, match=message):
        pipe.add(request_)
    assert pipe.can_add() and not pipe.has_work()


def test_stop_string_cuts_the_text(pipeline) -> None:
    pipeline.add(text_request("probe", "count", max_output_tokens=20))
    full = "".join(o.text for o in of(drain(pipeline), "probe") if isinstance(o, TextDelta))
    at = next(i for i in range(2, len(full) - 3) if full.find(full[i : i + 3]) == i)
    pipeline.add(text_request("r", "count", max_output_tokens=20, stop=[full[at : at + 3]]))
    outs = of(drain(pipeline), "r")
    assert "".join(o.text for o in outs if isinstance(o, TextDelta)) == full[:at]
    assert outs[-1].reason == "stop"


@pytest.mark.parametrize(("vocoder", "first_chunk"), [("stream", 2), ("chunked", 4)])
def test_first_audio_comes_with_the_first_chunk(demo_dir: Path, vocoder: str, first_chunk: int) -> None:
    """Step 1 prefills (reply token 0, the talker's prompt), feeds token 0 at once (reply token
    1) and makes frame 0, which needs token 1; step k makes frame k - 1: the first chunk of n
    frames is out after step n."""
    pipe = load_speech_pipeline(demo_dir, max_slots=2, warm_up=True, vocoder=vocoder)
    assert pipe.can_add() and not pipe.has_work()
    pipe.add(audio_request("r", tone(1.0), max_output_tokens=20))
    steps = [pipe.step() for _ in range(first_chunk)]
    assert isinstance(steps[0][0][1], Started) and any(isinstance(o, TextDelta) for _, o in steps[0])
    assert not any(isinstance(o, AudioDelta) for step in steps[:-1] for _, o in step)
    first = [o for _, o in steps[-1] if isinstance(o, AudioDelta)]
    assert len(first) == 1 and first[0].frames == first_chunk
    assert first[0].pcm.size == first_chunk * 1920 - 555  # the causal decoder holds back 555 samples
    pipe.remove("r")


@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_cuda_graphs_option_is_ignored_on_cpu(demo_dir: Path, cuda_graphs: bool) -> None:
    """``cuda_graphs`` reaches the streaming vocoder; on CPU it captures nothing and steps eagerly."""
    pipe = load_speech_pipeline(demo_dir, max_slots=1, vocoder="stream", cuda_graphs=cuda_graphs)
    streamer = pipe.vocoder.streamer
    assert streamer.runners == {} and streamer.gather  # every step: pool.step_io, gathered rows
    pipe.add(audio_request("r", max_output_tokens=3))
    outs = of(drain(pipe), "r")
    assert outs[-1].reason == "length" and any(isinstance(o, AudioDelta) for o in outs)


def test_a_seed_draws_the_same_tokens_at_batch_1_and_batch_32(demo_dir: Path) -> None:
    """Counter-based sampling: a request's draws depend on its seed and its own count of draws,
    not on the batch it shares or the slot it gets."""
    pipe = load_speech_pipeline(demo_dir, max_slots=32, max_audio_frames=8)
    log = TokenLog(pipe)
    target = dict(max_output_tokens=12, temperature=1.0, top_p=0.95, seed=1234, output_audio=False)
    pipe.add(text_request("alone", "tell me a story", **target))
    drain(pipe)
    for i in range(31):
        pipe.add(text_request(f"other{i}", f"question {i}", max_output_tokens=14, temperature=0.8, seed=i,
                              output_audio=False))
        if i == 20:
            pipe.add(text_request("crowded", "tell me a story", **target))
    drain(pipe)
    assert pipe._active == {} and pipe.free_slots == 32
    assert len(log.tokens["alone"]) >= 6
    assert log.tokens["crowded"] == log.tokens["alone"]
    assert log.tokens["other3"] != log.tokens["alone"]


def test_prefill_worker_reads_prompts_beside_the_decode_steps(demo_dir: Path) -> None:
    """With the prefill worker, a new prompt is read on its own thread: the
    speaking session's ticks go on while it is blocked, and the turns equal inline prefill's."""
    import threading

    inline = load_speech_pipeline(demo_dir, max_slots=2, max_audio_frames=40)
    worker = load_speech_pipeline(demo_dir, max_slots=2, max_audio_frames=40, prefill_worker=True)
    assert worker.reader.prefiller.worker is not None
    threads: set[str] = set()
    release = threading.Event()
    forward = worker.thinker.forward_prompt

    def slow_forward(slot, prompt, **kw):
        threads.add(threading.current_thread().name)
        if prompt.length > 40:  # the second, longer prompt: held until the test lets it go
            assert release.wait(10)
        return forward(slot, prompt, **kw)

    worker.thinker.forward_prompt = slow_forward
    logs = {id(p): TokenLog(p) for p in (inline, worker)}
    first = audio_request("a", tone(0.5), max_output_tokens=30)
    second = audio_request("b", tone(3.0, 330.0), max_output_tokens=6)
    worker.add(first)
    outs = []
    while not any(isinstance(o, AudioDelta) for _, o in outs):
        outs += worker.step()
    worker.add(second)
    ticks_while_blocked = []
    talker = worker._active["a"].talker
    frames = talker.step
    for _ in range(5):  # "b" is blocked in its prefill; "a" keeps speaking, a frame a tick
        ticks_while_blocked.append(worker.step())
    assert talker.step == frames + 5
    assert not any(rid == "b" for tick in ticks_while_blocked for rid, _ in tick)
    release.set()
    outs += [o for tick in ticks_while_blocked for o in tick] + drain(worker)
    assert threads == {t for t in threads if t.startswith("omnirt-prefill")} and threads
    for req in (first, second):
        inline.add(req)
        drain(inline)
    assert logs[id(worker)].tokens == logs[id(inline)].tokens
    assert of(outs, "b")[-1].reason == "length"


def test_a_long_prompt_is_read_a_piece_per_tick_beside_a_speaking_session(demo_dir: Path) -> None:
    """With ``prefill_chunk`` 64, a 300-token prompt takes several ticks (one piece of each pass
    per tick, its last thinker piece and first talker piece together), a speaking session makes
    a frame in every one of them, and the long turn's reply equals the one read whole. (Prompts
    in the frame ticks, ``prompt_ticks`` off: tests/speech/test_prompt_ticks.py has the other.)"""
    chunked = load_speech_pipeline(demo_dir, max_slots=2, max_audio_frames=40, prefill_chunk=64)
    chunked.prompt_ticks = False
    whole = load_speech_pipeline(demo_dir, max_slots=2, max_audio_frames=40)
    words = " ".join(f"word{i}" for i in range(60))
    long = GenerationRequest("b", [ContextMessage("user", (TextPart(words),))], max_output_tokens=6)
    n = chunked.prompts.build(long.messages).length
    assert n > 4 * 64, n
    logs = {id(p): TokenLog(p) for p in (chunked, whole)}
    first = audio_request("a", tone(0.5), max_output_tokens=40)
    chunked.add(first)
    outs = []
    while not any(isinstance(o, AudioDelta) for _, o in outs):
        outs += chunked.step()
    chunked.add(long)
    talker = chunked._active["a"].talker
    frames = talker.step
    ticks = 0
    while not chunked._active["b"].prefilled:
        outs += chunked.step()
        ticks += 1
        assert talker.step == frames + ticks  # "a" speaks on, a frame a tick
    pieces = -(-n // 64)
    talker_pieces = -(-(chunked._active["b"].talker.prompt.user_embeds.shape[0] + 9) // 64)
    assert ticks == pieces + talker_pieces - 1
    outs += drain(chunked)
    assert of(outs, "b")[-1].reason == "length"
    whole.add(first)
    drain(whole)
    whole.add(long)
    drain(whole)
    assert logs[id(chunked)].tokens == logs[id(whole)].tokens


def test_a_short_turn_is_read_before_long_prompts_queued_ahead_of_it(demo_dir: Path) -> None:
    """Prompts with the fewest pieces left go first: three long prompts admitted before a short
    turn (with one prefill a tick) do not hold it up; the long ones are read after it."""
    pipe = load_speech_pipeline(demo_dir, max_slots=4, max_audio_frames=40, prefill_chunk=64)
    pipe.reader.prefills_per_step = 1
    words = " ".join(f"word{i}" for i in range(60))
    for i in range(3):
        pipe.add(text_request(f"long{i}", words, max_output_tokens=2))
    pipe.step()  # long0 reads its first piece
    pipe.add(text_request("short", "hi", max_output_tokens=2))
    outs = pipe.step()
    assert [type(o) for o in of(outs, "short")][:1] == [Started]  # read at once
    assert not any(pipe._active[f"long{i}"].prefilled for i in range(3))
    outs = drain(pipe)
    assert all(of(outs, f"long{i}")[-1].reason == "length" for i in range(3))


@pytest.mark.parametrize("wait", [100, 2])
def test_a_long_prompt_waits_while_a_reply_awaits_its_first_audio(demo_dir: Path, wait: int) -> None:
    """A long prompt reads no piece while a turn read beside it awaits its first audio (the
    ticks that make its latency), at most ``long_prefill_wait`` ticks in a row; then (or once
    the audio is out) it reads a piece every tick."""
    pipe = load_speech_pipeline(demo_dir, max_slots=2, max_audio_frames=40, prefill_chunk=64)
    pipe.reader.long_prefill_wait = wait
    pipe.vocoder.first_chunk = 6  # the first audio a few ticks after the prompt
    words = " ".join(f"word{i}" for i in range(60))
    pipe.add(audio_request("a", tone(0.5), max_output_tokens=20))
    pipe.add(GenerationRequest("b", [ContextMessage("user", (TextPart(words),))], max_output_tokens=4))
    outs = pipe.step()
    job = pipe._active["b"].job
    assert job is not None and pipe._active["a"].prefilled
    read = [job.ticks_left]
    while not any(isinstance(o, AudioDelta) for o in of(outs, "a")):
        outs = pipe.step()
        read.append(job.ticks_left)
    waiting = len(read)
    assert waiting > 3, read  # "a" took a few ticks to its first audio
    if wait == 100:
        assert len(set(read)) == 1  # nothing read meanwhile
    else:
        # one piece after each wait of ``wait`` ticks, the first tick (which read "a") one of them
        assert read[0] - read[-1] == waiting // (wait + 1)
    before = job.ticks_left
    for _ in range(3):
        pipe.step()
    assert job.ticks_left == before - 3
    assert of(drain(pipe), "b")[-1].reason == "length"


def _deadline_of_playing(pipe, active) -> float:
    return active.audio_started + active.audio_seconds - pipe.step_timer.seconds - pipe.playback_margin


def _deadline_of_first_audio(pipe, active, expected: float) -> float:
    left = max(1.0, expected - active.ticks) + 1
    return active.request.asked_at + pipe.first_audio_target - left * pipe.step_timer.seconds


def test_the_next_deadline_keeps_every_reply_ahead_of_its_playback(demo_dir: Path) -> None:
    """A spoken reply is due at once until its first tick (its prompt is read), then so that its
    first audio comes ``first_audio_target`` after its request (the ticks it still needs by the
    moving average of ticks to first audio, at the measured step cost); playing, the tick is due
    one step and the margin before its audio runs out, also while another reply awaits its first
    audio; a text-only request beside them asks for at once."""
    import time

    from omnirt.stages.speech.pipeline import FIRST_AUDIO_TARGET, FIRST_AUDIO_TICKS

    pipeline = load_speech_pipeline(demo_dir, max_slots=4, max_audio_frames=30)
    pipeline.prompt_ticks = False  # b's prompt read in the tick of a's frame (test_prompt_ticks.py: apart)
    assert pipeline.first_audio_target == FIRST_AUDIO_TARGET
    pipeline.add(audio_request("a", tone(1.0), max_output_tokens=12))
    active = pipeline._active["a"]
    assert pipeline.next_deadline() == active.admitted <= time.monotonic()
    first_audio = None
    for _ in range(64):
        before = time.monotonic()
        outs = of(pipeline.step(), "a")
        if any(isinstance(o, AudioDelta) for o in outs):
            first_audio = before
            break
        deadline = pipeline.next_deadline()  # nothing measured yet: FIRST_AUDIO_TICKS
        assert deadline == pytest.approx(_deadline_of_first_audio(pipeline, active, FIRST_AUDIO_TICKS))
        assert deadline < active.request.asked_at + pipeline.first_audio_target
    assert first_audio is not None and pipeline.has_work()
    assert pipeline.first_audio_ticks.seconds == active.ticks > 1
    heard = active.audio_seconds
    assert heard > 0
    assert pipeline.next_deadline() == pytest.approx(_deadline_of_playing(pipeline, active))
    assert first_audio <= active.audio_started <= time.monotonic()

    pipeline.add(audio_request("b", tone(1.0, seed=1), max_output_tokens=12))
    other = pipeline._active["b"]
    # its prompt, at once (unless the first reply's few frames of audio run out sooner)
    assert pipeline.next_deadline() == min(other.admitted, _deadline_of_playing(pipeline, active))
    pipeline.step()
    assert other.audio_started is None and not active.talker.done
    expected = pipeline.first_audio_ticks.seconds
    assert pipeline.next_deadline() == pytest.approx(
        min(_deadline_of_playing(pipeline, active), _deadline_of_first_audio(pipeline, other, expected))
    )
    pipeline.add(text_request("t", "hello", max_output_tokens=2))
    assert pipeline.next_deadline() is None
    drain(pipeline)
    assert pipeline.next_deadline() is None and not pipeline.has_work()


def test_the_first_audio_target_counts_from_the_request_not_its_admission(demo_dir: Path) -> None:
    """A reply that waited before the pipeline took it (for a slot, or behind a batch step) is due
    that much sooner: its first-audio deadline counts from ``request.asked_at``."""
    from omnirt.stages.speech.pipeline import FIRST_AUDIO_TICKS

    pipeline = load_speech_pipeline(demo_dir, max_slots=4, max_audio_frames=30)
    waited = audio_request("waited", tone(1.0), max_output_tokens=12)
    waited.asked_at -= 2.0  # asked for two seconds before it was admitted
    pipeline.add(waited)
    pipeline.add(audio_request("fresh", tone(1.0, seed=1), max_output_tokens=12))
    pipeline.step()  # both prompts read: neither is due "at once" any more
    first, second = pipeline._active["waited"], pipeline._active["fresh"]
    assert first.audio_started is None and second.audio_started is None and first.ticks == second.ticks
    late = _deadline_of_first_audio(pipeline, first, FIRST_AUDIO_TICKS)
    fresh = _deadline_of_first_audio(pipeline, second, FIRST_AUDIO_TICKS)
    assert late == pytest.approx(fresh - 2.0, abs=0.05)
    assert pipeline.next_deadline() == pytest.approx(late)
    assert late < first.admitted  # overdue: due now
    pipeline.remove("waited")
    assert pipeline.next_deadline() == pytest.approx(fresh)
    drain(pipeline)


def test_without_a_first_audio_target_a_reply_is_due_at_once_until_its_audio_plays(demo_dir: Path) -> None:
    pipeline = load_speech_pipeline(demo_dir, max_slots=4, max_audio_frames=30)
    pipeline.first_audio_target = None
    pipeline.add(audio_request("a", tone(1.0), max_output_tokens=12))
    while pipeline._active["a"].audio_started is None:
        assert pipeline.next_deadline() is None
        pipeline.step()
    assert pipeline.next_deadline() == pytest.approx(_deadline_of_playing(pipeline, pipeline._active["a"]))
    drain(pipeline)


def test_a_held_request_takes_no_steps_and_then_goes_on_unchanged(demo_dir: Path) -> None:
    """``hold`` (its client is behind reading): the request makes nothing while held, counts as
    no work and no deadline, while another request keeps stepping; released, it finishes with the
    same reply (tokens, text, audio frames) it makes without the hold. Held, it moves out of the
    low slots (so the other steps at batch 1, not at the bucket covering the held slot), and
    back down once released: its state moves whole (the same reply)."""
    pipe = load_speech_pipeline(demo_dir, max_slots=4, max_audio_frames=30)
    make = lambda: audio_request("a", tone(1.0), max_output_tokens=10, temperature=1.0, seed=7)  # noqa: E731
    log = TokenLog(pipe)
    pipe.add(make())
    text, audio, reason, frames = _summary(of(drain(pipe), "a"))
    unheld_tokens = log.tokens.pop("a")

    pipe.add(make())
    outs = []
    while not any(isinstance(o, AudioDelta) for o in of(outs, "a")):  # speaking
        outs += pipe.step()
    assert pipe._active["a"].slot == 0
    pipe.hold("a", True)
    assert not pipe.has_work() and pipe.next_deadline() is None
    assert pipe._active["a"].slot > 0  # parked above
    pipe.add(text_request("other", "meanwhile", max_output_tokens=6))
    assert pipe._active["other"].slot == 0 and pipe._bucket(1) == 1
    tokens_before = len(log.tokens["a"])
    calls_before = collections.Counter(pipe.calls)
    while_held = drain(pipe)
    stepped = collections.Counter(pipe.calls) - calls_before
    assert {b for (name, b) in stepped if name in ("thinker_rows", "talker_rows")} == {1}  # bucket 1
    assert of(while_held, "other")[-1].reason in ("stop", "length")
    assert not [o for o in of(while_held, "a") if isinstance(o, TextDelta | Finished)]
    assert len(log.tokens["a"]) == tokens_before
    pipe.hold("a", False)
    assert pipe.has_work()
    assert pipe._active["a"].slot == 0  # back down: "other" is done
    assert pipe.calls["move", 1] == 2
    outs += while_held + drain(pipe)
    t2, a2, r2, f2 = _summary(of(outs, "a"))
    assert log.tokens["a"] == unheld_tokens
    assert (t2, r2, f2) == (text, reason, frames)
    assert a2.shape == audio.shape
