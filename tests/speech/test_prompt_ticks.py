"""Prompt passes in ticks of their own (``SpeechPipeline.prompt_ticks``): while other replies
make frames, a new turn's inline prompt pass never lengthens their frame step. A tick reads the
prompts only when the playing replies' audio lasts past it; otherwise their frames come first and
the prompt is read at once after them, at most ``MAX_PROMPT_DEFERRALS`` ticks later."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from omnirt.stages.speech.loader import load_speech_pipeline
from omnirt.stages.speech.pipeline import MAX_PROMPT_DEFERRALS, SpeechPipeline
from omnirt.stages.types import AudioDelta, Finished, Started, TextDelta

from .conftest import TokenLog, audio_request, drain, of, tone


def _prompt_passes(pipeline: SpeechPipeline) -> int:
    return sum(n for (name, _), n in pipeline.calls.items() if name.endswith("_prompt"))


def _playing(demo_dir: Path) -> tuple[SpeechPipeline, TokenLog]:
    """A pipeline reading prompts in ticks of their own, with reply ``a`` playing."""
    pipeline = load_speech_pipeline(demo_dir, max_slots=4, max_audio_frames=80)
    pipeline.prompt_ticks = True
    log = TokenLog(pipeline)
    pipeline.add(audio_request("a", tone(1.0), max_output_tokens=16))
    for _ in range(64):
        if any(isinstance(o, AudioDelta) for o in of(pipeline.step(), "a")):
            break
    assert pipeline._active["a"].audio_started is not None
    return pipeline, log


def _audio_left(pipeline: SpeechPipeline, rid: str, seconds: float) -> None:
    """Makes reply ``rid``'s audio run out ``seconds`` from now (its playback started earlier or
    later), as a listener's clock would have it."""
    active = pipeline._active[rid]
    active.audio_started = time.monotonic() + seconds - active.audio_seconds


def _frames(pipeline: SpeechPipeline, rid: str) -> int:
    return pipeline._active[rid].usage.output_audio_tokens


def test_a_prompt_is_read_in_a_tick_of_its_own_while_a_reply_plays_with_spare_audio(demo_dir: Path) -> None:
    pipeline, log = _playing(demo_dir)
    _audio_left(pipeline, "a", 60.0)
    pipeline.add(audio_request("b", tone(1.0, seed=1), max_output_tokens=8))
    frames, passes = _frames(pipeline, "a"), _prompt_passes(pipeline)
    outs = pipeline.step()
    assert any(isinstance(o, Started) for o in of(outs, "b"))  # b's prompt read and loaded
    assert _prompt_passes(pipeline) > passes
    assert _frames(pipeline, "a") == frames and not of(outs, "a")  # no frame step for a
    assert pipeline.prompt_timer.seconds > 0
    ticks_cost = pipeline.step_timer.seconds
    outs = pipeline.step()  # the frames: a's next one, b's first thinker and talker steps
    assert _frames(pipeline, "a") == frames + 1
    assert pipeline._active["b"].usage.output_text_tokens >= 2
    assert pipeline.step_timer.seconds != ticks_cost  # a frame tick, timed as one
    rest = drain(pipeline)
    assert [o.reason for o in of(rest, "b") if isinstance(o, Finished)] == ["length"]

    # b's reply is the one it gets alone
    alone = load_speech_pipeline(demo_dir, max_slots=4, max_audio_frames=80)
    solo = TokenLog(alone)
    alone.add(audio_request("b", tone(1.0, seed=1), max_output_tokens=8))
    drain(alone)
    assert log.tokens["b"] == solo.tokens["b"]


def test_frames_that_are_due_come_first_and_the_prompt_at_once_after_them(demo_dir: Path) -> None:
    pipeline, _ = _playing(demo_dir)
    _audio_left(pipeline, "a", 0.0)  # a's next frame step is overdue
    pipeline.add(audio_request("b", tone(1.0, seed=1), max_output_tokens=8))
    frames, passes = _frames(pipeline, "a"), _prompt_passes(pipeline)
    outs = pipeline.step()
    assert _frames(pipeline, "a") == frames + 1  # a's frame
    assert _prompt_passes(pipeline) == passes and not of(outs, "b")  # b waits
    due = pipeline.next_deadline()
    assert due < time.monotonic()  # ... and is read at once
    _audio_left(pipeline, "a", -5.0)  # an earlier deadline than the prompt's stays the earliest
    assert pipeline.next_deadline() < due - 4
    _audio_left(pipeline, "a", 60.0)  # the frames made room
    outs = pipeline.step()
    assert any(isinstance(o, Started) for o in of(outs, "b")) and _prompt_passes(pipeline) > passes
    assert _frames(pipeline, "a") == frames + 1
    assert pipeline.next_deadline() is not None
    drain(pipeline)


def test_a_prompt_waits_for_due_frames_a_bounded_number_of_ticks(demo_dir: Path) -> None:
    pipeline, _ = _playing(demo_dir)
    pipeline.add(audio_request("b", tone(1.0, seed=1), max_output_tokens=8))
    passes = _prompt_passes(pipeline)
    for _ in range(MAX_PROMPT_DEFERRALS):
        _audio_left(pipeline, "a", 0.0)
        frames = _frames(pipeline, "a")
        assert not of(pipeline.step(), "b")
        assert _frames(pipeline, "a") == frames + 1 and _prompt_passes(pipeline) == passes
    _audio_left(pipeline, "a", 0.0)  # still due, but the prompt has waited long enough
    frames = _frames(pipeline, "a")
    outs = pipeline.step()
    assert any(isinstance(o, Started) for o in of(outs, "b")) and _frames(pipeline, "a") == frames
    drain(pipeline)


def test_with_nothing_else_under_way_the_prompt_and_the_first_steps_share_a_tick(demo_dir: Path) -> None:
    pipeline = load_speech_pipeline(demo_dir, max_slots=4, max_audio_frames=40)
    pipeline.prompt_ticks = True
    pipeline.add(audio_request("a", tone(1.0), max_output_tokens=4))
    outs = of(pipeline.step(), "a")
    assert any(isinstance(o, Started) for o in outs)
    assert any(isinstance(o, TextDelta) for o in outs) or pipeline._active["a"].usage.output_text_tokens == 2
    assert pipeline.prompt_timer.seconds == 0  # not a prompt-only tick
    drain(pipeline)


def test_prompt_ticks_are_on_by_default_and_leave_the_prefill_worker_alone(demo_dir: Path) -> None:
    assert load_speech_pipeline(demo_dir, max_slots=2).prompt_ticks is True
    worker = load_speech_pipeline(demo_dir, max_slots=2, prefill_worker=True)
    worker.prompt_ticks = True
    worker.add(audio_request("a", tone(1.0), max_output_tokens=4))
    assert worker._tick_kind() == "both"  # prompts beside the steps already
    drain(worker)
    assert np.isfinite(worker.step_timer.seconds)


def _ends_at_once(pipeline: SpeechPipeline) -> None:
    """The talker's every draw is the end of speech (its prompt pass's first code included)."""
    pipeline.talker.suppress[:] = True
    pipeline.talker.suppress[pipeline.talker.eos] = False


def test_a_talker_whose_first_code_ends_speech_makes_no_frame(demo_dir: Path) -> None:
    """The prompt pass may draw the end of speech as its first code: the reply then has no
    audio, and no frame with that code reaches the vocoder (it used to, in the tick of the
    prompt, and the vocoder's range check failed the request)."""
    for prompt_ticks in (False, True):
        pipeline = load_speech_pipeline(demo_dir, max_slots=4, max_audio_frames=40)
        pipeline.prompt_ticks = prompt_ticks
        _ends_at_once(pipeline)
        pipeline.add(audio_request("a", tone(1.0), max_output_tokens=4))
        outs = drain(pipeline)
        done = [o for o in of(outs, "a") if isinstance(o, Finished)]
        assert [d.reason for d in done] == ["length"], done
        assert not any(isinstance(o, AudioDelta) for o in of(outs, "a"))
        assert done[0].usage.output_audio_tokens == 0
