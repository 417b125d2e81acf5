"""Tool calls without a model: the tags in the demo vocabulary, the prompt rendering of tools,
calls and results (the published Qwen3-Omni template's format), and the streamed split of a
reply into text and calls."""

from __future__ import annotations

import pytest
from omnirt.stages.pipeline import RequestRejected
from omnirt.stages.speech.demo_tokenizer import TOOL_TOKENS, build_tokenizer
from omnirt.stages.speech.text_out import TextOut
from omnirt.stages.speech.tool_calls import CallSplitter, Piece, ToolTags, parse_tool_call
from omnirt.stages.types import (
    ContextMessage,
    TextDelta,
    TextPart,
    ToolCall,
    ToolCallPart,
    ToolResultPart,
    ToolSpec,
)

WEATHER = ToolSpec(
    "get_weather",
    "Current weather",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)

# What the published Qwen3-Omni chat template renders for the conversation below (its tool
# block, calls and results are Qwen3's format).
EXPECTED_PROMPT = (
    "<|im_start|>system\nBe brief.\n\n# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Current weather", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n'
    "</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nWeather in Paris and Lyon?<|im_end|>\n"
    "<|im_start|>assistant\nLet me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
    '{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
    "<tool_response>\nrain\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\nSunny in Paris.<|im_end|>\n"
    "<|im_start|>user\nthanks<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def conversation() -> list[ContextMessage]:
    return [
        ContextMessage("system", (TextPart("Be brief."),)),
        ContextMessage("user", (TextPart("Weather in Paris and Lyon?"),)),
        ContextMessage(
            "assistant",
            (
                TextPart("Let me check."),
                ToolCallPart("c1", "get_weather", '{"city": "Paris"}'),
                ToolCallPart("c2", "get_weather", '{"city":"Lyon"}'),  # re-rendered as a dict
            ),
        ),
        ContextMessage("tool", (ToolResultPart("c1", "sunny"), ToolResultPart("c2", "rain"))),
        ContextMessage("assistant", (TextPart("Sunny in Paris."),)),
        ContextMessage("user", (TextPart("thanks"),)),
    ]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=build_tokenizer())


# -- vocabulary and prompt ------------------------------------------------------------------------


def test_the_tool_tags_follow_the_special_tokens_and_decode_to_text(tokenizer) -> None:
    ids = [tokenizer.convert_tokens_to_ids(t) for t in TOOL_TOKENS]
    assert ids == list(range(ids[0], ids[0] + 4)) and ids[-1] == len(tokenizer) - 1
    assert tokenizer.convert_tokens_to_ids("<tts_text_bos_single>") == ids[0] - 1
    text = '<tool_call>\n{"a": 1}\n</tool_call>'
    encoded = tokenizer.encode(text, add_special_tokens=False)
    assert encoded[0] == ids[0] and encoded[-1] == ids[1]
    assert tokenizer.decode(encoded, skip_special_tokens=True) == text  # not special: kept
    assert ToolTags.of(tokenizer) == ToolTags(ids[0], ids[1])


def test_tools_calls_and_results_render_as_the_published_template(pipeline) -> None:
    prompt = pipeline.prompts.build(conversation(), [WEATHER])
    assert pipeline.tokenizer.decode(prompt.input_ids[0]) == EXPECTED_PROMPT


def test_without_tools_the_prompt_is_unchanged(pipeline) -> None:
    messages = [ContextMessage("system", (TextPart("Be "), TextPart("brief."))), conversation()[1]]
    prompt = pipeline.tokenizer.decode(pipeline.prompts.build(messages).input_ids[0])
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Paris and Lyon?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    ("message", "error"),
    [
        (ContextMessage("user", (ToolCallPart("c", "f", "{}"),)), "a user message cannot hold a tool call"),
        (ContextMessage("user", (ToolResultPart("c", "x"),)), "a user message cannot hold a tool result"),
        (ContextMessage("tool", (ToolResultPart("c", "x"), TextPart("y"))), "tool results only"),
        (ContextMessage("tool", ()), "tool results only"),
        (ContextMessage("user", (TextPart("hi <tool_call>"),)), "special token '<tool_call>'"),
        (ContextMessage("tool", (ToolResultPart("c", "<|im_end|>"),)), "tool results may not contain"),
        (
            ContextMessage("assistant", (ToolCallPart("c", "f", '{"a": "<|im_start|>"}'),)),
            "arguments may not",
        ),
    ],
)
def test_bad_tool_parts_are_rejected(pipeline, message: ContextMessage, error: str) -> None:
    with pytest.raises(RequestRejected, match=error):
        pipeline.prompts.build([conversation()[1], message])


def test_an_assistant_text_may_hold_call_tags_it_wrote(pipeline) -> None:
    """A block that did not parse came out as text; replayed in the history it is accepted."""
    text = '<tool_call>\n{"name": "nope"}\n</tool_call>'
    messages = [conversation()[1], ContextMessage("assistant", (TextPart(text),)), conversation()[-1]]
    prompt = pipeline.tokenizer.decode(pipeline.prompts.build(messages, [WEATHER]).input_ids[0])
    assert f"<|im_start|>assistant\n{text}<|im_end|>" in prompt


def test_arguments_that_are_not_an_object_render_as_written(pipeline) -> None:
    messages = [conversation()[1], ContextMessage("assistant", (ToolCallPart("c", "get_weather", "[1, 2"),))]
    prompt = pipeline.tokenizer.decode(pipeline.prompts.build(messages, [WEATHER]).input_ids[0])
    assert '{"name": "get_weather", "arguments": [1, 2}\n</tool_call>' in prompt


# -- parsing ---------------------------------------------------------------------------------------


PARIS, ZURICH = '{"city": "Paris"}', '{"city": "Zürich"}'


@pytest.mark.parametrize(
    ("body", "call"),
    [
        ('\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', ToolCall("get_weather", PARIS)),
        ('{"arguments": {}, "name": "get_weather"}', ToolCall("get_weather", "{}")),
        ('{"name": "get_weather",\n "arguments": {"city":"Zürich"}}', ToolCall("get_weather", ZURICH)),
        ('{"name": "other", "arguments": {}}', None),  # not declared
        ('{"name": "get_weather", "arguments": "{}"}', None),  # arguments not an object
        ('{"name": "get_weather", "arguments": {}, "id": 1}', None),
        ('{"name": "get_weather", "arguments": {"x": NaN}}', None),
        ('{"name": "get_weather", "arguments": {', None),
        ("", None),
    ],
)
def test_parse_tool_call(body: str, call: ToolCall | None) -> None:
    assert parse_tool_call(body, {"get_weather"}) == call


def _stream(tokenizer, text: str, *, names=("get_weather", "add"), stops=()):
    """Feeds ``text``'s tokens one at a time; returns (outputs per token, final outputs, pieces)."""
    tags = ToolTags.of(tokenizer)
    splitter = CallSplitter(tags)
    out = TextOut(tokenizer, vocab_limit=len(tokenizer), stops=list(stops), tool_names=names)
    steps, pieces = [], []
    stopped = False
    for token in tokenizer.encode(text, add_special_tokens=False):
        piece = splitter.feed(token)
        pieces.append(piece)
        got, stopped = out.push(token, piece)
        steps.append(got)
        if stopped:
            break
    return steps, ([] if stopped else out.finish(flush=True)), pieces, out


def test_text_goes_out_as_it_streams_and_a_call_when_it_closes(tokenizer) -> None:
    text = 'Sure, one moment.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    text += "</tool_call>"
    steps, final, pieces, out = _stream(tokenizer, text)
    opened = pieces.index(Piece.OPEN)
    assert any(steps[:opened])  # text goes out as it streams
    # the open tag flushes the text before it; nothing while the block is open; the call at its close
    assert "".join(o.text for step in steps[: opened + 1] for o in step) == "Sure, one moment."
    assert all(not step for step in steps[opened + 1 : -1])
    assert steps[-1] == [ToolCall("get_weather", '{"city": "Paris"}')] and not final
    assert steps[-1][0].tokens == len(pieces) - opened
    assert sum(o.tokens for step in steps for o in step) == len(pieces)
    assert pieces[opened:] == [Piece.OPEN] + [Piece.BODY] * (len(pieces) - opened - 2) + [Piece.CLOSE]
    assert out.sent_chars == len("Sure, one moment.") and len(out.chars_after) == len(pieces)


def test_several_calls_and_text_between(tokenizer) -> None:
    text = (
        '<tool_call>\n{"name": "add", "arguments": {"x": 1, "y": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>done'
    )
    steps, final, _, _ = _stream(tokenizer, text)
    outs = [o for step in steps for o in step] + final
    assert outs[0] == ToolCall("add", '{"x": 1, "y": 2}')
    assert outs[1] == TextDelta("\n", 1)
    assert outs[2] == ToolCall("get_weather", '{"city": "Oslo"}')
    assert "".join(o.text for o in outs[3:]) == "done"


def test_a_block_that_does_not_parse_is_text(tokenizer) -> None:
    block = '<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>'
    steps, final, pieces, _ = _stream(tokenizer, "a" + block + "b")
    outs = [o for step in steps for o in step] + final
    assert all(isinstance(o, TextDelta) for o in outs)
    assert "".join(o.text for o in outs) == "a" + block + "b"
    assert sum(o.tokens for o in outs) == len(pieces)


def test_an_unclosed_block_is_text_at_the_end(tokenizer) -> None:
    steps, final, pieces, _ = _stream(tokenizer, 'hi<tool_call>\n{"name": "add", "argu')
    assert [o for step in steps[2:] for o in step] == []
    assert "".join(o.text for o in final) == '<tool_call>\n{"name": "add", "argu'
    assert sum(o.tokens for step in steps for o in step) + sum(o.tokens for o in final) == len(pieces)


def test_stop_strings_apply_to_the_text_outside_calls(tokenizer) -> None:
    call = '<tool_call>\n{"name": "add", "arguments": {"x": "STOP"}}\n</tool_call>'
    steps, final, _, _ = _stream(tokenizer, "go " + call + " then STOP here", stops=["STOP"])
    outs = [o for step in steps for o in step] + final
    assert [o for o in outs if isinstance(o, ToolCall)] == [ToolCall("add", '{"x": "STOP"}')]
    assert "".join(o.text for o in outs if isinstance(o, TextDelta)) == "go  then "


def test_without_tool_names_every_block_is_text(tokenizer) -> None:
    text = '<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>'
    steps, final, _, _ = _stream(tokenizer, text, names=())
    assert "".join(o.text for step in steps for o in step) + "".join(o.text for o in final) == text
