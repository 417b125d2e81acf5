"""Function calling and structured outputs end to end on the embedded default: the real server on
loopback, the real Qwen3-Omni pipeline with random weights in the real engine, the official SDK.

Random weights never choose to call a tool, so these tests force the call (a named ``tool_choice``
or ``required``): constrained decoding must then make arguments that parse and validate against
the tool's schema, and the conversation must go on after the tool's output. Every realtime frame
is validated strictly with the SDK's models (``tests/realtime/conftest.py``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from tests.realtime.conftest import connect, text_item

from .test_demo_server import MODEL, DemoServer, running_demo

WEATHER_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": WEATHER_PARAMS,
}
TIME_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 16}},
    "required": ["zone"],
}
TIME = {
    "type": "function",
    "name": "get_time",
    "description": "The time in a zone.",
    "parameters": TIME_PARAMS,
}


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoServer]:
    with running_demo(tmp_path_factory, max_output_tokens=256) as server:
        yield server


def test_realtime_forced_call_validates_and_the_reply_continues_after_its_output(demo: DemoServer) -> None:
    """A named ``tool_choice`` on an audio session: one ``function_call`` item whose arguments
    validate, no audio for it; the tool's output then continues the conversation with speech."""

    async def main() -> tuple[list[dict], list[dict]]:
        async with connect(demo, manual=True) as c:  # type: ignore[arg-type]
            await c.send(
                {
                    "type": "session.update",
                    "session": {
                        "type": "realtime",
                        "tools": [WEATHER, TIME],
                        "tool_choice": {"type": "function", "name": "get_weather"},
                    },
                }
            )
            await c.until("session.updated")
            await c.send({"type": "conversation.item.create", "item": text_item("Weather in Paris?")})
            await c.until("conversation.item.done")
            await c.send({"type": "response.create"})
            first = await c.until("response.done", timeout=120)
            call = first[-1]["response"]["output"][0]
            await c.send(
                {
                    "type": "conversation.item.create",
                    "item": {
                        "type": "function_call_output",
                        "call_id": call["call_id"],
                        "output": '{"sky": "clear"}',
                    },
                }
            )
            await c.until("conversation.item.done")
            await c.send(
                {"type": "response.create", "response": {"tool_choice": "none", "max_output_tokens": 6}}
            )
            second = await c.until("response.done", timeout=120)
            return first, second

    first, second = asyncio.run(main())
    done = first[-1]["response"]
    assert done["status"] == "completed", done
    [call] = done["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER_PARAMS)
    args_done = [e for e in first if e["type"] == "response.function_call_arguments.done"]
    assert [e["arguments"] for e in args_done] == [call["arguments"]]
    assert not [e for e in first if e["type"] == "response.output_audio.delta"], "a call is never spoken"

    reply = second[-1]["response"]
    assert reply["status"] in ("completed", "incomplete"), reply
    assert [o["type"] for o in reply["output"]] == ["message"]
    assert [e for e in second if e["type"] == "response.output_audio.delta"], (
        "the reply after the tool speaks"
    )


def test_realtime_required_picks_one_of_the_tools_with_valid_arguments(demo: DemoServer) -> None:
    async def main() -> list[dict]:
        async with connect(demo, manual=True) as c:  # type: ignore[arg-type]
            await c.send(
                {
                    "type": "session.update",
                    "session": {
                        "type": "realtime",
                        "output_modalities": ["text"],
                        "tools": [WEATHER, TIME],
                        "tool_choice": "required",
                    },
                }
            )
            await c.until("session.updated")
            await c.send({"type": "conversation.item.create", "item": text_item("What time is it in Oslo?")})
            await c.until("conversation.item.done")
            await c.send({"type": "response.create"})
            return await c.until("response.done", timeout=120)

    events = asyncio.run(main())
    calls = [o for o in events[-1]["response"]["output"] if o["type"] == "function_call"]
    assert calls, events[-1]["response"]
    schemas = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])


def test_chat_tool_call_then_tool_result_then_structured_output(demo: DemoServer) -> None:
    tools = [
        {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in (WEATHER, TIME)
    ]
    answer_schema = {
        "type": "object",
        "properties": {"summary": {"type": "string", "maxLength": 40}, "warm": {"type": "boolean"}},
        "required": ["summary", "warm"],
        "additionalProperties": False,
    }

    async def main() -> tuple[Any, Any, Any]:
        sdk = demo.sdk()
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
        forced = await sdk.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=tools,  # type: ignore[arg-type]
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=200,
        )
        message = forced.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        messages += [
            {"role": "tool", "tool_call_id": tc.id, "content": '{"sky": "clear"}'}
            for tc in message.tool_calls or []
        ]
        after = await sdk.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=tools,
            tool_choice="none",
            max_tokens=6,  # type: ignore[arg-type]
        )
        structured = await sdk.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Summarise."}],
            max_tokens=120,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": answer_schema, "strict": True},
            },
        )
        return forced, after, structured

    forced, after, structured = asyncio.run(main())
    choice = forced.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [tc] = choice.message.tool_calls or []
    assert tc.function.name == "get_weather" and tc.id.startswith("call_")
    jsonschema.validate(json.loads(tc.function.arguments), WEATHER_PARAMS)
    assert after.choices[0].finish_reason in ("stop", "length") and not after.choices[0].message.tool_calls
    assert after.usage is not None and after.usage.prompt_tokens > forced.usage.prompt_tokens  # type: ignore[union-attr]
    text = structured.choices[0].message.content
    assert structured.choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text or ""), answer_schema)


def test_a_schema_ref_to_nowhere_is_a_400_that_names_the_pointer(demo: DemoServer) -> None:
    """The structured-output compiler's message names the JSON pointer as the schema writes it
    (``#/definitions/...``), which the redaction of filesystem paths from client messages leaves
    alone."""
    schema = {"type": "object", "properties": {"a": {"$ref": "#/definitions/nowhere"}}}

    async def main() -> str:
        with pytest.raises(openai.BadRequestError) as info:
            await demo.sdk().chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "x"}],
                max_tokens=20,
                response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
            )
        return info.value.message

    message = asyncio.run(main())
    assert "Pointer '#/definitions/nowhere' does not exist" in message, message
