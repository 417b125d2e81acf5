"""Function calling and structured outputs through the speech pipeline and the engine, with the
demo's random weights: forced calls and JSON answers always parse and validate (checked with
``jsonschema``, independent of the library that constrains them), greedy and sampled, within
their token budget; ``none`` never opens a call; calls are never spoken; unconstrained rows are
untouched by constrained neighbours; bad schemas are refused with a clear message."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import jsonschema
import pytest
import torch
from omnirt.stages.engine import Engine, EngineClient
from omnirt.stages.pipeline import RequestRejected
from omnirt.stages.speech.loader import load_speech_pipeline
from omnirt.stages.speech.talker import TEXT_TOKEN
from omnirt.stages.types import (
    AudioDelta,
    ContextMessage,
    Finished,
    GenerationRequest,
    JsonSchemaFormat,
    NamedTool,
    Started,
    TextDelta,
    TextPart,
    ToolCall,
    ToolSpec,
)

from .conftest import TokenLog, drain, of, text_request

WEATHER = ToolSpec(
    "get_weather",
    "The weather in a city",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "unit", "days"],
        "additionalProperties": False,
    },
)
ADD = ToolSpec(
    "add",
    "Adds numbers",
    {
        "type": "object",
        "$defs": {"term": {"type": "number"}},
        "properties": {"terms": {"type": "array", "items": {"$ref": "#/$defs/term"}, "minItems": 2}},
        "required": ["terms"],
    },
)
ANSWER = {
    "type": "object",
    "properties": {
        "answer": {"type": "string"},
        "confidence": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "source": {"type": "object", "properties": {"url": {"type": "string"}}, "required": ["url"]},
    },
    "required": ["answer", "tags", "source"],
}
SAMPLING = [(0.0, None), (1.0, 1), (1.0, 2), (0.8, 3)]


@pytest.fixture(scope="module")
def pipe(demo_dir: Path):
    return load_speech_pipeline(demo_dir, max_slots=4, max_audio_frames=30)


def ask(rid: str, text: str = "what is the weather in Paris?", **kw) -> GenerationRequest:
    return GenerationRequest(rid, [ContextMessage("user", (TextPart(text),))], **kw)


def calls_of(outs) -> list[ToolCall]:
    return [o for o in outs if isinstance(o, ToolCall)]


def check_call(call: ToolCall, tools: list[ToolSpec]) -> None:
    spec = next(t for t in tools if t.name == call.name)
    jsonschema.validate(json.loads(call.arguments), spec.parameters)


# -- forced calls ----------------------------------------------------------------------------------


def test_a_named_function_is_called_with_valid_arguments_and_nothing_is_spoken(pipe) -> None:
    requests = [
        ask(f"r{i}", output_audio=True, max_output_tokens=160, tools=[WEATHER, ADD],
            tool_choice=NamedTool("get_weather"), temperature=temperature, seed=seed)
        for i, (temperature, seed) in enumerate(SAMPLING)
    ]
    for request in requests:
        pipe.add(request)
    outs = drain(pipe, max_steps=1000)
    for request in requests:
        mine = of(outs, request.request_id)
        assert isinstance(mine[0], Started) and isinstance(mine[-1], Finished)
        assert [type(o) for o in mine[1:-1]] == [ToolCall], mine  # no text, no audio
        (call,) = calls_of(mine)
        assert call.name == "get_weather"
        check_call(call, [WEATHER])
        done = mine[-1]
        assert done.reason == "stop" and done.usage.output_audio_tokens == 0
        assert call.tokens == done.usage.output_text_tokens <= request.max_output_tokens
    arguments = {c.arguments for r in requests for c in calls_of(of(outs, r.request_id))}
    assert len(arguments) > 1  # the draws differ; the grammar did not pick one answer


def test_required_calls_one_or_more_of_the_tools(pipe) -> None:
    requests = [
        ask(f"q{seed}", output_audio=False, max_output_tokens=220, tools=[WEATHER, ADD],
            tool_choice="required", temperature=1.0, seed=seed)
        for seed in range(4)
    ]
    for request in requests:
        pipe.add(request)
    outs = drain(pipe, max_steps=1000)
    names = set()
    for request in requests:
        mine = of(outs, request.request_id)
        calls = calls_of(mine)
        assert calls and len(calls) == len(mine) - 2, mine  # calls only, between Started and Finished
        for call in calls:
            check_call(call, [WEATHER, ADD])
            names.add(call.name)
        assert mine[-1].reason == "stop"
        assert sum(c.tokens for c in calls) <= mine[-1].usage.output_text_tokens <= 220
    assert names <= {"get_weather", "add"}


@pytest.mark.parametrize("slack", [0, 4, 30])
def test_a_reply_at_the_edge_of_its_budget_still_closes(pipe, slack: int) -> None:
    """The budget rule: with a budget just above the closing path the reply follows it."""
    probe = ask("p", output_audio=False, tools=[WEATHER], tool_choice=NamedTool("get_weather"))
    need = pipe.prepare(probe).constraint.need
    budget = need + 1 + slack
    request = dataclasses.replace(probe, request_id="e", max_output_tokens=budget, temperature=1.0, seed=7)
    pipe.add(request)
    mine = of(drain(pipe), "e")
    (call,) = calls_of(mine)
    check_call(call, [WEATHER])
    assert mine[-1].reason == "stop" and mine[-1].usage.output_text_tokens <= budget
    too_small = f"a token budget of {need} .* is too small .*: it needs at least {need + 1} tokens"
    with pytest.raises(RequestRejected, match=too_small):
        pipe.prepare(dataclasses.replace(probe, max_output_tokens=need))


def test_schemas_as_frameworks_write_them_are_accepted(pipe) -> None:
    """Generated schemas (titles, defaults, a nullable object, ``$schema``, ``$ref`` to ``$defs``)."""
    generated = ToolSpec("lookup", "", {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "LookupArgs",
        "type": ["object", "null"],
        "$defs": {"Units": {"title": "Units", "enum": ["metric", "imperial"], "type": "string"}},
        "properties": {
            "query": {"title": "Query", "type": "string", "description": "what to look up"},
            "units": {"$ref": "#/$defs/Units", "default": "metric"},
        },
        "required": ["query", "units"],
        "additionalProperties": False,
    })
    request = ask("l", output_audio=False, max_output_tokens=120, tools=[generated],
                  tool_choice=NamedTool("lookup"), temperature=1.0, seed=9)
    pipe.add(request)
    (call,) = calls_of(of(drain(pipe), "l"))
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, generated.parameters)
    assert arguments["units"] in ("metric", "imperial")


def test_forced_calls_are_capped_at_the_tool_call_budget(pipe) -> None:
    saved = pipe.constrainer.tool_call_budget
    pipe.constrainer.tool_call_budget = 90
    try:
        request = ask("c", output_audio=False, tools=[WEATHER], tool_choice="required", seed=4)
        assert pipe.prepare(request).max_tokens == 90
        pipe.add(request)
        mine = of(drain(pipe), "c")
    finally:
        pipe.constrainer.tool_call_budget = saved
    assert calls_of(mine) and mine[-1].usage.output_text_tokens <= 90 and mine[-1].reason == "stop"


# -- none, auto and the talker ---------------------------------------------------------------------


def test_tool_choice_none_never_opens_a_call(pipe) -> None:
    open_id = pipe.constrainer.tags.open_id
    log = TokenLog(pipe)
    for choice in ("auto", "none"):
        for seeds in (range(4), range(4, 8)):  # four slots
            for seed in seeds:
                pipe.add(ask(f"{choice}{seed}", output_audio=False, max_output_tokens=60, tools=[WEATHER],
                             tool_choice=choice, temperature=1.0, seed=seed))
            drain(pipe)
    assert any(open_id in log.tokens[f"auto{s}"] for s in range(8))  # random weights do open calls
    assert all(open_id not in log.tokens[f"none{s}"] for s in range(8))


def _shaped(pipe, request: GenerationRequest, lark: str):
    """``request`` prepared as usual, its reply shaped by ``lark`` (to drive the pipeline's
    handling of a reply that a random model would rarely write)."""
    prepared = pipe.prepare(request)
    return dataclasses.replace(prepared, constraint=pipe.constrainer.compile(lark, prepared.max_tokens))


def _call_rule(pipe, tool: ToolSpec) -> str:
    tags = pipe.constrainer.tags
    schema = {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
    }
    return f'call: <[{tags.open_id}]> "\\n" %json {json.dumps(schema)} "\\n" <[{tags.close_id}]>\n'


def test_text_before_a_call_is_spoken_and_the_call_is_not(pipe) -> None:
    request = ask("s", output_audio=True, max_output_tokens=150, tools=[WEATHER], temperature=0.9, seed=3)
    fed: list[int] = []
    step = pipe.talker.step

    def record(slots, text, batch):
        fed.extend(value for kind, value in text if kind == TEXT_TOKEN)
        return step(slots, text, batch)

    pipe.talker.step = record
    log = TokenLog(pipe)
    try:
        lark = "start: WORD call\nWORD: /[a-z]{6,10}/\n" + _call_rule(pipe, WEATHER)
        pipe.add(request, _shaped(pipe, request, lark))
        mine = of(drain(pipe), "s")
    finally:
        pipe.talker.step = step
    texts = [o for o in mine if isinstance(o, TextDelta)]
    word = "".join(o.text for o in texts)
    assert word.isalpha() and 6 <= len(word) <= 10
    (call,) = calls_of(mine)
    check_call(call, [WEATHER])
    assert mine.index(call) > max(mine.index(o) for o in texts)  # in reply order
    audio = [o for o in mine if isinstance(o, AudioDelta)]
    assert audio and audio[-1].text_chars == len(word)
    tokens = log.tokens["s"]
    spoken = tokens[: tokens.index(pipe.constrainer.tags.open_id)]
    assert pipe.tokenizer.decode(spoken) == word
    # The talker read the word (its first token at the prefill, the others in its steps), no call.
    assert fed == spoken[1:]
    assert mine[-1].usage.output_text_tokens == len(tokens) - 1  # all but the stop token


def test_a_reply_that_is_only_a_call_has_no_audio(pipe) -> None:
    request = ask("o", output_audio=True, max_output_tokens=150, tools=[WEATHER], temperature=0.0)
    pipe.add(request, _shaped(pipe, request, "start: call\n" + _call_rule(pipe, WEATHER)))
    mine = of(drain(pipe), "o")
    assert [type(o) for o in mine] == [Started, ToolCall, Finished]
    check_call(mine[1], [WEATHER])
    assert mine[-1].reason == "stop" and mine[-1].usage.output_audio_tokens == 0


# -- structured outputs ----------------------------------------------------------------------------


@pytest.mark.parametrize(("temperature", "seed"), SAMPLING[:3])
def test_response_format_gives_json_valid_against_the_schema(pipe, temperature: float, seed: int) -> None:
    request = ask("j", "describe Paris", output_audio=False, max_output_tokens=160,
                  response_format=JsonSchemaFormat(ANSWER), temperature=temperature, seed=seed)
    pipe.add(request)
    mine = of(drain(pipe), "j")
    assert not calls_of(mine) and mine[-1].reason == "stop"
    jsonschema.validate(json.loads("".join(o.text for o in mine if isinstance(o, TextDelta))), ANSWER)


def test_with_tools_and_auto_a_formatted_reply_is_json_or_calls(pipe) -> None:
    kinds = set()
    for seeds in (range(4), range(4, 8)):  # four slots
        requests = [
            ask(f"a{seed}", "describe Paris", output_audio=False, max_output_tokens=200, tools=[WEATHER],
                response_format=JsonSchemaFormat(ANSWER), temperature=1.0, seed=seed)
            for seed in seeds
        ]
        for request in requests:
            pipe.add(request)
        outs = drain(pipe, max_steps=1000)
        for request in requests:
            mine = of(outs, request.request_id)
            assert mine[-1].reason == "stop"
            calls, text = calls_of(mine), "".join(o.text for o in mine if isinstance(o, TextDelta))
            if calls:
                kinds.add("calls")
                assert not text.strip("\n")
                for call in calls:
                    check_call(call, [WEATHER])
            else:
                kinds.add("json")
                jsonschema.validate(json.loads(text), ANSWER)
    assert kinds == {"calls", "json"}  # the model chose, both ways


def test_unconstrained_rows_are_untouched_by_constrained_neighbours(pipe) -> None:
    def plain(rid: str) -> GenerationRequest:
        return text_request(rid, "tell me something", max_output_tokens=40, temperature=0.9, seed=11)

    log = TokenLog(pipe)
    pipe.add(plain("alone"))
    alone = of(drain(pipe), "alone")
    pipe.add(ask("n1", output_audio=False, max_output_tokens=100, tools=[WEATHER],
                 tool_choice=NamedTool("get_weather"), temperature=1.0, seed=1))
    pipe.add(plain("together"))
    pipe.add(ask("n2", output_audio=False, max_output_tokens=40, tools=[WEATHER], tool_choice="none", seed=2))
    pipe.add(ask("n3", output_audio=False, max_output_tokens=100, response_format=JsonSchemaFormat(ANSWER)))
    outs = drain(pipe)
    assert log.tokens["together"] == log.tokens["alone"]
    assert [o for o in of(outs, "together") if isinstance(o, TextDelta)] == [
        o for o in alone if isinstance(o, TextDelta)
    ]
    assert calls_of(of(outs, "n1"))  # the neighbours were constrained meanwhile


# -- rejections ------------------------------------------------------------------------------------


def _tool(parameters) -> ToolSpec:
    return ToolSpec("f", "", parameters)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"tools": [_tool({"type": "object", "properties": {"a": {"type": "strin"}}})],
          "tool_choice": "required"}, "schema of function 'f' cannot be used: .*Invalid type: strin"),
        ({"tools": [_tool({"properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}})],
          "tool_choice": NamedTool("f")}, "function 'f' cannot be used: .*look-around"),
        ({"tools": [_tool({"type": "string"})], "tool_choice": "required"}, "must describe an object"),
        ({"tools": [_tool({})], "tool_choice": NamedTool("g")}, "names the function 'g', which is not"),
        ({"tool_choice": "required"}, "'required' needs at least one tool"),
        ({"tools": [_tool({}), _tool({})]}, "'f' is declared twice"),
        ({"tools": [ToolSpec("", "", {})]}, "non-empty name"),
        ({"response_format": JsonSchemaFormat({"type": "object", "minProperties": "x"})},
         "response_format schema cannot be used"),
    ],
)
def test_bad_tools_and_schemas_are_rejected_clearly(pipe, kw, message: str) -> None:
    free = pipe.free_slots
    with pytest.raises(RequestRejected, match=message):
        pipe.add(ask("bad", output_audio=False, max_output_tokens=100, **kw))
    assert pipe.free_slots == free and not pipe.has_work()


# -- the engine ------------------------------------------------------------------------------------


def test_the_engine_serves_a_forced_call_and_refuses_a_bad_schema(demo_dir: Path) -> None:
    engine = Engine(load_speech_pipeline(demo_dir, max_slots=2, max_audio_frames=20))
    engine.start()

    async def main():
        client = EngineClient(engine)
        good = client.submit(ask("g", output_audio=True, max_output_tokens=160, tools=[WEATHER, ADD],
                                 tool_choice=NamedTool("add"), temperature=1.0, seed=5))
        bad_tool = _tool({"type": "object", "required": 3})
        bad = client.submit(ask("b", tools=[bad_tool], tool_choice="required"))
        return [o async for o in good], [o async for o in bad], good.usage

    try:
        good, bad, usage = asyncio.run(main())
    finally:
        engine.stop()
    (call,) = calls_of(good)
    assert call.name == "add"
    check_call(call, [ADD])
    assert not any(isinstance(o, AudioDelta | TextDelta) for o in good)
    assert good[-1].reason == "stop" and usage.output_text_tokens == good[-1].usage.output_text_tokens
    assert bad[-1].reason == "error" and bad[-1].code == "rejected" and "function 'f'" in bad[-1].error


# -- on CUDA ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_constrained_tokens_equal_with_graphs_on_and_off(demo_dir: Path) -> None:
    gpu = load_speech_pipeline(demo_dir, device="cuda", dtype=torch.float32, max_slots=4, max_audio_frames=20)
    log = TokenLog(gpu)

    def turns(tag: str):
        gpu.add(ask(f"{tag}call", output_audio=True, max_output_tokens=120, tools=[WEATHER, ADD],
                    tool_choice="required", temperature=1.0, seed=3))
        gpu.add(ask(f"{tag}json", output_audio=False, max_output_tokens=120,
                    response_format=JsonSchemaFormat(ANSWER), temperature=0.0))
        gpu.add(ask(f"{tag}none", output_audio=True, max_output_tokens=30, tools=[WEATHER],
                    tool_choice="none"))
        return drain(gpu, max_steps=1000)

    graphed = turns("g")
    gpu.use_graphs(False)
    eager = turns("e")
    for kind in ("call", "json", "none"):
        assert log.tokens[f"g{kind}"] == log.tokens[f"e{kind}"]
    for call in calls_of(of(graphed, "gcall")) + calls_of(of(eager, "ecall")):
        check_call(call, [WEATHER, ADD])
    assert calls_of(of(graphed, "gcall")) == calls_of(of(eager, "ecall"))
