"""Truncation in the speech pipeline (the demo Qwen3-Omni on CPU): ``PromptBuilder.length`` counts
what ``build`` makes without the audio and image features, and a request with a
:class:`~omnirt.stages.types.Truncation` whose prompt does not fit leaves its oldest messages out
(and says how many in ``Started``), where one without is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from omnirt.stages.pipeline import RequestRejected
from omnirt.stages.speech.loader import load_speech_pipeline
from omnirt.stages.speech.pipeline import SpeechPipeline
from omnirt.stages.truncation import reply_room
from omnirt.stages.types import (
    AudioPart,
    ContextMessage,
    Finished,
    GenerationRequest,
    ImagePart,
    Started,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    ToolSpec,
    Truncation,
)

from .conftest import drain, of, png, tone

CONTEXT = 256


@pytest.fixture(scope="module")
def small(demo_dir: Path) -> SpeechPipeline:
    return load_speech_pipeline(demo_dir, max_slots=2, max_audio_frames=8, max_context=CONTEXT)


def user(text: str) -> ContextMessage:
    return ContextMessage("user", (TextPart(text),))


def assistant(text: str) -> ContextMessage:
    return ContextMessage("assistant", (TextPart(text),))


SYSTEM = ContextMessage("system", (TextPart("You are brief."),))


def conversation(turns: int) -> list[ContextMessage]:
    out = [SYSTEM]
    for i in range(turns):
        out += [
            user(f"question {i}: tell me about the number {i} in a few words"),
            assistant(f"{i} is a number."),
        ]
    out.append(user("and the last one?"))
    return out


@pytest.mark.parametrize(
    "messages",
    [
        [user("hello")],
        [SYSTEM, user("hello"), assistant("hi!"), user("again")],
        [user("listen"), ContextMessage("user", (AudioPart(tone(0.37)), TextPart("what is it?")))],
        [ContextMessage("user", (AudioPart(tone(1.0)), AudioPart(tone(2.05, 330.0))))],
        [ContextMessage("user", (ImagePart(png((64, 48))), TextPart("what is it?")))],
        [
            user("weather?"),
            ContextMessage("assistant", (ToolCallPart("c1", "get_weather", '{"city": "Paris"}'),)),
            ContextMessage("tool", (ToolResultPart("c1", "sunny"),)),
            ContextMessage("tool", (ToolResultPart("c2", "warm"),)),
        ],
    ],
    ids=["text", "system", "audio", "two audios", "image", "tools"],
)
def test_length_counts_what_build_makes(pipeline: SpeechPipeline, messages: list[ContextMessage]) -> None:
    tools = [ToolSpec("get_weather", "The weather.", {"type": "object"})]
    for with_tools in ([], tools):
        assert (
            pipeline.prompts.length(messages, with_tools)
            == pipeline.prompts.build(messages, with_tools).length
        )


def test_no_messages_are_refused(pipeline: SpeechPipeline) -> None:
    with pytest.raises(RequestRejected, match="no messages"):
        pipeline.prompts.build([])


def test_a_prompt_over_the_context_is_refused_without_truncation(small: SpeechPipeline) -> None:
    request = GenerationRequest("r", conversation(12), output_audio=False, max_output_tokens=8)
    with pytest.raises(RequestRejected, match="context"):
        small.prepare(request)


def test_truncation_leaves_the_oldest_out_and_says_how_many(small: SpeechPipeline) -> None:
    messages = conversation(12)
    request = GenerationRequest(
        "t", messages, output_audio=False, max_output_tokens=8, truncation=Truncation()
    )
    prepared = small.prepare(request)
    dropped = prepared.prompt.dropped
    assert dropped > 0 and dropped % 2 == 0  # whole turns: a user question and its answer
    kept = [messages[0], *messages[1 + dropped :]]
    assert prepared.prompt.length == small.prompts.build(kept).length
    room = reply_room(CONTEXT, 8)
    assert prepared.prompt.length <= CONTEXT - room
    # just enough: one more turn would not fit
    one_more = [messages[0], *messages[dropped - 1 :]]  # (dropped - 1: the turn before's question)
    assert small.prompts.build(one_more).length > CONTEXT - room
    small.add(request, prepared)
    outs = of(drain(small), "t")
    assert isinstance(outs[0], Started) and outs[0].dropped == dropped
    assert isinstance(outs[-1], Finished) and outs[-1].reason in ("stop", "length")


def test_a_retention_ratio_keeps_less_and_post_instructions_bounds_the_conversation(
    small: SpeechPipeline,
) -> None:
    messages = conversation(12)
    head = small.prompts.length([messages[0]])

    def kept_tokens(truncation: Truncation) -> tuple[int, int]:
        request = GenerationRequest(
            "r", messages, output_audio=False, max_output_tokens=8, truncation=truncation
        )
        prompt = small.prepare(request).prompt
        return prompt.dropped, prompt.length - head

    auto_dropped, auto_tokens = kept_tokens(Truncation())
    half_dropped, half_tokens = kept_tokens(Truncation(retention_ratio=0.5))
    budget = CONTEXT - reply_room(CONTEXT, 8) - head
    assert half_dropped > auto_dropped and half_tokens <= budget // 2 < auto_tokens
    limited_dropped, limited_tokens = kept_tokens(Truncation(post_instructions=60))
    assert limited_tokens <= 60 and limited_dropped > auto_dropped
    # a conversation under the limits is left whole
    short = GenerationRequest(
        "s", conversation(1), output_audio=False, max_output_tokens=8, truncation=Truncation()
    )
    assert small.prepare(short).prompt.dropped == 0


def test_a_tool_result_is_not_kept_without_its_call(small: SpeechPipeline) -> None:
    words = " ".join(f"w{i}" for i in range(60))
    call = ContextMessage("assistant", (ToolCallPart("c1", "lookup", '{"q": "' + words + '"}'),))
    result = ContextMessage("tool", (ToolResultPart("c1", "found " + words),))
    messages = [SYSTEM, user("look it up"), call, result, user("thanks, and now?")]
    request = GenerationRequest(
        "r", messages, output_audio=False, max_output_tokens=8, truncation=Truncation()
    )
    prepared = small.prepare(request)
    assert prepared.prompt.dropped == 3  # the question, the call and its result: not the result alone
    assert prepared.prompt.length == small.prompts.build([SYSTEM, messages[-1]]).length


def test_a_last_message_over_the_context_is_still_refused(small: SpeechPipeline) -> None:
    messages = [SYSTEM, user("hi"), user("word " * 400)]
    request = GenerationRequest(
        "r", messages, output_audio=False, max_output_tokens=8, truncation=Truncation()
    )
    with pytest.raises(RequestRejected, match="context"):
        small.prepare(request)


def test_megabytes_of_old_text_are_dropped_by_characters_before_tokenising(small: SpeechPipeline) -> None:
    huge = user("y" * 5_000_000)  # far over the characters bound: never tokenised
    messages = [SYSTEM, huge, assistant("ok"), user("and now?")]
    request = GenerationRequest(
        "r", messages, output_audio=False, max_output_tokens=8, truncation=Truncation()
    )
    prepared = small.prepare(request)
    assert prepared.prompt.dropped == 2  # the text and the answer to it: kept starts with a question
