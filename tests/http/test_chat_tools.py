"""Function calling and structured outputs on /v1/chat/completions, through the official openai SDK.

The EchoPipeline (tests/fakes.py) plays the model: a named ``tool_choice`` makes it call that
function, ``auto`` makes it say "Calling NAME." and call every tool the user text names, after a
``tool`` message it answers "The tool said: <output>.", and with a ``response_format`` it writes an
instance of the schema as JSON.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from omnirt.stages.types import JsonSchemaFormat, NamedTool, TextPart, ToolCallPart, ToolResultPart, ToolSpec
from pydantic import BaseModel

from tests.fakes import EchoPipeline

from .conftest import MODEL, Server, run, running, user


class RecordingPipeline(EchoPipeline):
    """Keeps the requests it was given, to check what reached the engine."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[Any] = []

    def add(self, request: Any, prepared: Any) -> None:
        self.requests.append(request)
        super().add(request, prepared)


@pytest.fixture(scope="module")
def server() -> Any:
    with running(RecordingPipeline()) as s:
        yield s


WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": WEATHER_PARAMS,
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_forced_call_returns_tool_calls_with_null_content(server: Server) -> None:
    async def go() -> Any:
        async with server.openai() as client:
            return await client.chat.completions.create(
                model=MODEL,
                messages=user("Lima"),
                tools=[WEATHER, TIME],
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
            )

    completion = run(go())
    request = server.pipeline.requests[-1]
    assert request.tools == [
        ToolSpec("get_weather", "The weather in a city.", WEATHER_PARAMS),
        ToolSpec("get_time", "", {"type": "object", "properties": {}}),
    ]
    assert request.tool_choice == NamedTool("get_weather") and request.response_format is None
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) == 29
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Lima", "days": 4}
    assert completion.usage.completion_tokens == 1


def test_text_and_two_calls_then_the_tool_results_continue(server: Server) -> None:
    """auto: text and two calls in one message; the assistant message with its tool_calls and the
    tool messages go back as ToolCallPart and ToolResultPart, and the model answers from them."""

    async def go() -> tuple[Any, Any]:
        async with server.openai() as client:
            messages: list[Any] = user("get_time and get_weather please")
            first = await client.chat.completions.create(
                model=MODEL, messages=messages, tools=[WEATHER, TIME]
            )
            message = first.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            for call, result in zip(message.tool_calls, ["noon", "rain"], strict=True):
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            second = await client.chat.completions.create(
                model=MODEL, messages=messages, tools=[WEATHER, TIME]
            )
            return first, second

    first, second = run(go())
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    assert message.content == "Calling get_weather. Calling get_time."
    assert [c.function.name for c in message.tool_calls] == ["get_weather", "get_time"]
    assert len({c.id for c in message.tool_calls}) == 2
    request = server.pipeline.requests[-1]
    assert request.tool_choice == "auto"
    calls = [ToolCallPart(c.id, c.function.name, c.function.arguments) for c in message.tool_calls]
    assert [(m.role, m.parts) for m in request.messages[1:]] == [
        ("assistant", (TextPart("Calling get_weather. Calling get_time."), *calls)),
        ("tool", (ToolResultPart(calls[0].call_id, "noon"),)),
        ("tool", (ToolResultPart(calls[1].call_id, "rain"),)),
    ]
    assert second.choices[0].message.content == "The tool said: rain."
    assert second.choices[0].finish_reason == "stop" and second.choices[0].message.tool_calls is None


def test_streamed_tool_calls_accumulate(server: Server) -> None:
    async def go() -> tuple[list[Any], Any]:
        async with server.openai() as client:
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=user("get_weather get_time"),
                tools=[WEATHER, TIME],
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [chunk async for chunk in stream]
            async with client.chat.completions.stream(
                model=MODEL, messages=user("Quito"), tools=[WEATHER], tool_choice="required"
            ) as helper:
                async for _ in helper:
                    pass
                final = await helper.get_final_completion()
            return chunks, final

    chunks, final = run(go())
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant" and deltas[0].content == ""
    calls: dict[int, dict[str, str]] = {}
    for delta in deltas:
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            if tc.id:
                assert not entry["id"], "the id comes once, on a call's first chunk"
                entry["id"], entry["name"] = tc.id, tc.function.name
                assert tc.type == "function"
            entry["arguments"] += tc.function.arguments or ""
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == {"city": "get_weather get_time", "days": 20}
    assert calls[1]["arguments"] == "{}"
    assert "".join(d.content or "" for d in deltas) == "Calling get_weather. Calling get_time."
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["tool_calls"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    # A stream that only calls opens with content null, as OpenAI's does; the SDK's helper agrees.
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls" and message.content is None
    assert message.tool_calls[0].function.name == "get_weather"
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Quito", "days": 5}


class Weather(BaseModel):
    city: str
    days: int


class Forecast(BaseModel):
    summary: str
    temperature: float
    rain: bool
    tags: list[str]


def test_parse_with_a_pydantic_response_format_and_tool(server: Server) -> None:
    async def go() -> tuple[Any, Any, Any]:
        async with server.openai() as client:
            structured = await client.chat.completions.parse(
                model=MODEL, messages=user("sunny"), response_format=Forecast
            )
            tool = await client.chat.completions.parse(
                model=MODEL,
                messages=user("Oslo"),
                tools=[openai.pydantic_function_tool(Weather)],
                tool_choice="required",
            )
            async with client.chat.completions.stream(
                model=MODEL, messages=user("fog"), response_format=Forecast
            ) as helper:
                streamed = await helper.get_final_completion()
            return structured, tool, streamed

    structured, tool, streamed = run(go())
    forecast = structured.choices[0].message.parsed
    assert forecast == Forecast(summary="sunny", temperature=0.5, rain=True, tags=["sunny"])
    request = server.pipeline.requests[-1]
    # the SDK's strict form of the model's schema, as sent
    assert request.response_format.name == "Forecast"
    assert request.response_format.schema["properties"].keys() == Forecast.model_fields.keys()
    assert request.response_format.schema["additionalProperties"] is False
    (call,) = tool.choices[0].message.tool_calls
    assert call.function.parsed_arguments == Weather(city="Oslo", days=4)
    assert streamed.choices[0].message.parsed == Forecast(
        summary="fog", temperature=0.5, rain=True, tags=["fog"]
    )


def test_json_schema_dict_and_json_object(server: Server) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}

    async def go() -> tuple[Any, Any]:
        async with server.openai() as client:
            by_dict = await client.chat.completions.create(
                model=MODEL,
                messages=user("yes"),
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "reply", "schema": schema, "strict": True},
                },
            )
            request = server.pipeline.requests[-1]
            json_object = await client.chat.completions.create(
                model=MODEL, messages=user("x"), response_format={"type": "json_object"}
            )
            return (by_dict, request), json_object

    (by_dict, request), json_object = run(go())
    assert request.response_format == JsonSchemaFormat(schema, "reply")
    assert json.loads(by_dict.choices[0].message.content) == {"answer": "yes"}
    assert server.pipeline.requests[-1].response_format == JsonSchemaFormat({"type": "object"}, "json_object")
    assert json.loads(json_object.choices[0].message.content) == {}


def test_sdk_sees_tool_errors_as_bad_requests_and_the_server_goes_on(server: Server) -> None:
    async def go() -> tuple[openai.BadRequestError, openai.BadRequestError, str]:
        async with server.openai() as client:
            with pytest.raises(openai.BadRequestError) as unknown:
                await client.chat.completions.create(
                    model=MODEL,
                    messages=user("x"),
                    tools=[WEATHER],
                    tool_choice={"type": "function", "function": {"name": "get_time"}},
                )
            with pytest.raises(openai.BadRequestError) as schema:
                await client.chat.completions.create(
                    model=MODEL,
                    messages=user("x"),
                    response_format={
                        "type": "json_schema",
                        "json_schema": {"name": "r", "schema": {"type": 3}},
                    },
                )
            ok = await client.chat.completions.create(model=MODEL, messages=user("fine"), tools=[WEATHER])
            return unknown.value, schema.value, ok.choices[0].message.content or ""

    unknown, schema, ok = run(go())
    assert unknown.status_code == 400 and unknown.body["param"] == "tool_choice"
    assert unknown.body["code"] == "invalid_value" and "'get_time'" in unknown.body["message"]
    assert schema.body["param"] == "response_format.json_schema.schema"
    assert ok == "You said: fine."


def _nested_arrays(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def test_a_schema_nested_past_the_meta_schema_checks_reach_is_a_400(server: Server) -> None:
    """A body the JSON parser takes (190 levels) whose schema is too deep for the meta-schema check
    (it recurses several frames per level): a 400 on the schema, not a RecursionError's 500."""
    deep = _nested_arrays(190)
    bodies = {
        "response_format.json_schema.schema": {
            "response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": deep}}
        },
        "tools[1].function.parameters": {
            "tools": [WEATHER, {"type": "function", "function": {"name": "deep", "parameters": deep}}]
        },
    }
    with server.http() as http:
        for param, extra in bodies.items():
            response = http.post(
                "/v1/chat/completions", json={"model": MODEL, "messages": user("x"), **extra}
            )
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert (error["param"], error["code"]) == (param, "invalid_value")
            assert "nested too deeply" in error["message"]
        ok = http.post("/v1/chat/completions", json={"model": MODEL, "messages": user("fine")})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "You said: fine."


def test_allowed_tools_narrow_what_the_model_sees(server: Server) -> None:
    async def go() -> Any:
        async with server.openai() as client:
            return await client.chat.completions.create(
                model=MODEL,
                messages=user("Rome"),
                tools=[WEATHER, TIME],
                tool_choice={
                    "type": "allowed_tools",
                    "allowed_tools": {
                        "mode": "required",
                        "tools": [{"type": "function", "function": {"name": "get_weather"}}],
                    },
                },
            )

    completion = run(go())
    request = server.pipeline.requests[-1]
    assert [t.name for t in request.tools] == ["get_weather"] and request.tool_choice == "required"
    assert completion.choices[0].message.tool_calls[0].function.name == "get_weather"
