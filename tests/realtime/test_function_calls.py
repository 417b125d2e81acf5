"""Function calling over /v1/realtime: session and per-response tools, the function_call item and its
events, the tool output that continues the conversation, and the errors that leave state alone.

The EchoPipeline (tests/fakes.py) plays the model: a named ``tool_choice`` makes it call that
function, ``auto`` makes it say "Calling NAME." and call every tool the user text names, and after a
``tool`` message it answers "The tool said: <output>.".
"""

from __future__ import annotations

import json
from typing import Any

from omnirt.stages.types import NamedTool, TextPart, ToolCallPart, ToolResultPart, ToolSpec

from .conftest import Client, Server, connect, run, sdk_connect, text_item

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather at a place.",
    "parameters": {
        "type": "object",
        "properties": {"location": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["location"],
    },
}
TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}

#: The events of one function call, in order.
CALL_EVENTS = [
    "response.output_item.added",
    "conversation.item.added",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.output_item.done",
    "conversation.item.done",
]


async def update(c: Client, session: dict[str, Any]) -> dict[str, Any]:
    await c.send({"type": "session.update", "session": {"type": "realtime", **session}})
    event = await c.recv()
    assert event["type"] == "session.updated", event
    return event["session"]


async def ask(c: Client, text: str, response: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    await c.send({"type": "conversation.item.create", "item": text_item(text)})
    await c.until("conversation.item.done")
    await c.send({"type": "response.create", **({"response": response} if response else {})})
    return await c.until("response.done")


def test_forced_call_is_a_function_call_item_with_its_events_in_order(server: Server) -> None:
    async def main() -> tuple[dict, list[dict]]:
        async with sdk_connect(server) as c:
            await c.conn.session.update(
                session={
                    "type": "realtime",
                    "tools": [WEATHER, TIME],
                    "tool_choice": {"type": "function", "name": "get_weather"},
                }
            )
            session = (await c.until("session.updated"))[-1]["session"]
            await c.conn.conversation.item.create(item=text_item("Paris"))
            await c.until("conversation.item.done")
            await c.conn.response.create()
            return session, await c.until("response.done")

    session, events = run(main())
    assert session["tools"] == [WEATHER, TIME]
    assert session["tool_choice"] == {"type": "function", "name": "get_weather"}
    request = server.pipeline.requests[-1]
    assert request.tools == [
        ToolSpec("get_weather", "The weather at a place.", WEATHER["parameters"]),
        ToolSpec("get_time", "", TIME["parameters"]),
    ]
    assert request.tool_choice == NamedTool("get_weather")

    assert [e["type"] for e in events] == ["response.created", *CALL_EVENTS, "response.done"]
    added, conv_added, delta, done, item_done, conv_done, response_done = events[1:]
    response_id = events[0]["response"]["id"]
    item = added["item"]
    assert item["type"] == "function_call" and item["id"].startswith("item_")
    assert item["call_id"].startswith("call_") and item["name"] == "get_weather"
    assert (item["status"], item["arguments"]) == ("in_progress", "")
    assert added["output_index"] == 0 and added["response_id"] == response_id
    assert conv_added["item"] == item and conv_added["previous_item_id"] is not None
    ids = {"response_id": response_id, "item_id": item["id"], "output_index": 0, "call_id": item["call_id"]}
    arguments = json.dumps({"location": "Paris", "days": 5})
    assert delta == {"type": delta["type"], "event_id": delta["event_id"], **ids, "delta": arguments}
    assert done == {
        "type": done["type"],
        "event_id": done["event_id"],
        **ids,
        "name": "get_weather",
        "arguments": arguments,
    }
    final = {**item, "status": "completed", "arguments": arguments}
    assert item_done["item"] == final and conv_done["item"] == final
    response = response_done["response"]
    assert response["status"] == "completed" and response["status_details"] == {"type": "completed"}
    assert response["output"] == [final]
    assert response["usage"]["output_tokens"] == 1


def test_text_before_a_call_closes_its_message_first(server: Server) -> None:
    """tool_choice auto, the model says something and calls: the message item (audio and
    transcript) is index 0 and closes before the function_call item (index 1) opens."""

    async def main() -> list[dict]:
        async with connect(server) as c:
            await update(c, {"tools": [WEATHER, TIME]})
            return await ask(c, "what is get_time")

    events = run(main())
    kinds = [e["type"] for e in events]
    message_done = kinds.index("response.output_item.done")
    assert kinds[message_done - 3 : message_done + 2] == [
        "response.output_audio.done",
        "response.output_audio_transcript.done",
        "response.content_part.done",
        "response.output_item.done",
        "conversation.item.done",
    ]
    assert kinds[message_done + 2 :] == [*CALL_EVENTS, "response.done"]
    assert events[message_done]["item"]["content"][0]["transcript"] == "Calling get_time."
    assert events[message_done]["output_index"] == 0
    call = events[message_done + 2]
    assert call["output_index"] == 1 and call["item"]["name"] == "get_time"
    output = events[-1]["response"]["output"]
    assert [(o["type"], o["status"]) for o in output] == [
        ("message", "completed"),
        ("function_call", "completed"),
    ]
    assert output[1]["arguments"] == "{}"


def test_function_call_output_then_response_create_continues(server: Server) -> None:
    """The client runs the tool, adds a function_call_output and asks for a response: the model
    gets the call as an assistant ToolCallPart and the output as a tool message."""

    async def main() -> tuple[list[dict], list[dict]]:
        async with connect(server) as c:
            await update(c, {"tools": [WEATHER], "tool_choice": "required"})
            first = await ask(c, "Oslo")
            call = first[-1]["response"]["output"][0]
            output = {"type": "function_call_output", "call_id": call["call_id"], "output": '{"sky":"clear"}'}
            await c.send({"type": "conversation.item.create", "item": output})
            await c.until("conversation.item.done")
            await update(c, {"tool_choice": "auto"})
            await c.send({"type": "response.create", "response": {"output_modalities": ["text"]}})
            return first, await c.until("response.done")

    first, second = run(main())
    call = first[-1]["response"]["output"][0]
    assert server.pipeline.requests[-2].tool_choice == "required"
    request = server.pipeline.requests[-1]
    assert request.tool_choice == "auto" and [t.name for t in request.tools] == ["get_weather"]
    assert [(m.role, m.parts) for m in request.messages[-3:]] == [
        ("user", (TextPart("Oslo"),)),
        ("assistant", (ToolCallPart(call["call_id"], "get_weather", call["arguments"]),)),
        ("tool", (ToolResultPart(call["call_id"], '{"sky":"clear"}'),)),
    ]
    response = second[-1]["response"]
    assert response["status"] == "completed"
    assert response["output"][0]["content"] == [
        {"type": "output_text", "text": 'The tool said: {"sky":"clear"}.'}
    ]


def test_response_create_overrides_tools_for_that_response_only(server: Server) -> None:
    async def main() -> tuple[list[dict], list[dict]]:
        async with connect(server) as c:
            await update(c, {"tools": [WEATHER], "tool_choice": "none"})
            override = {"tools": [TIME], "tool_choice": {"type": "function", "name": "get_time"}}
            first = await ask(c, "now", {"output_modalities": ["text"], **override})
            second = await ask(c, "get_weather here", {"output_modalities": ["text"]})
            return first, second

    first, second = run(main())
    by_response = server.pipeline.requests[-2:]
    assert [t.name for t in by_response[0].tools] == ["get_time"]
    assert by_response[0].tool_choice == NamedTool("get_time")
    assert [t.name for t in by_response[1].tools] == ["get_weather"] and by_response[1].tool_choice == "none"
    assert first[-1]["response"]["output"][0]["name"] == "get_time"
    # tool_choice none: no call, though the text names the tool
    assert [o["type"] for o in second[-1]["response"]["output"]] == ["message"]


def test_tool_errors_leave_the_session_as_it_was(server: Server) -> None:
    """Bad tools or a bad tool_choice in session.update: invalid_value (unsupported for MCP) naming
    the field; the session keeps its tools. A function_call_output for an unknown call_id is refused;
    a response.create with a bad tool_choice starts no response."""

    bad_updates: list[tuple[dict, str, str]] = [
        ({"tool_choice": "sometimes"}, "invalid_value", "session.tool_choice"),
        (
            {"tools": [{**WEATHER, "parameters": {"type": "strng"}}]},
            "invalid_value",
            "session.tools.0.parameters",
        ),
        ({"tools": [{**WEATHER, "name": "get weather!"}]}, "invalid_value", "session.tools.0.name"),
        ({"tools": [WEATHER, WEATHER]}, "invalid_value", "session.tools.1"),
        ({"tools": [{"type": "custom", "name": "x"}]}, "invalid_value", "session.tools.0"),
        (
            {"tools": [WEATHER, {"type": "mcp", "server_label": "s", "server_url": "https://x"}]},
            "unsupported",
            "session.tools.1.type",
        ),
        ({"tool_choice": {"type": "mcp", "server_label": "s"}}, "unsupported", "session.tool_choice.type"),
        (
            {"tools": [{"name": "f", "parameters": {}, "strict": True}]},
            "unknown_parameter",
            "session.tools.0.strict",
        ),
    ]

    async def main() -> tuple[list[dict], dict, list[dict]]:
        async with connect(server) as c:
            await update(
                c, {"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "name": "get_weather"}}
            )
            errors = []
            for i, (patch, _, _) in enumerate(bad_updates):
                await c.send(
                    {
                        "type": "session.update",
                        "event_id": f"evt_{i}",
                        "session": {"type": "realtime", **patch},
                    }
                )
                errors.append(await c.error())
            session = await update(c, {"instructions": "still here"})
            await c.send(
                {
                    "type": "conversation.item.create",
                    "item": {
                        "id": "item_out",
                        "type": "function_call_output",
                        "call_id": "call_x",
                        "output": "1",
                    },
                }
            )
            errors.append(await c.error())
            await c.send({"type": "conversation.item.retrieve", "item_id": "item_out"})
            errors.append(await c.error())
            for response in (
                {"tool_choice": {"type": "function", "name": "nope"}},
                {"tools": [TIME]},  # the session's named choice is not among them
                {"tools": [{"type": "mcp", "server_label": "s"}]},
                {"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
            ):
                await c.send({"type": "response.create", "response": response})
                errors.append(await c.error())
            await c.send({"type": "response.create", "response": {"output_modalities": ["text"]}})
            return errors, session, await c.until("response.done")

    errors, session, events = run(main())
    assert [(e["code"], e["param"]) for e in errors[: len(bad_updates)]] == [
        (c, p) for _, c, p in bad_updates
    ]
    assert [e["event_id"] for e in errors[: len(bad_updates)]] == [
        f"evt_{i}" for i in range(len(bad_updates))
    ]
    assert "MCP" in errors[5]["message"]
    assert session["tools"] == [WEATHER, TIME]
    assert session["tool_choice"] == {"type": "function", "name": "get_weather"}
    rest = [(e["code"], e["param"]) for e in errors[len(bad_updates) :]]
    assert rest == [
        ("invalid_value", "item.call_id"),
        ("item_retrieve_invalid_item_id", "item_id"),
        ("invalid_value", "response.tool_choice"),
        ("invalid_value", "response.tool_choice"),
        ("unsupported", "response.tools.0.type"),
        ("invalid_value", "response.input.0.call_id"),
    ]
    assert "Tool call ID 'call_x' not found" in errors[len(bad_updates)]["message"]
    # No response was started by the refused ones: the first response.created is the good one's.
    assert [e["type"] for e in events].count("response.created") == 1
    assert events[-1]["response"]["output"][0]["name"] == "get_weather"


def test_client_created_calls_and_outputs_are_history(server: Server) -> None:
    """function_call items may be created by the client (history, e.g. restored by a framework),
    and answered with function_call_output items; response.input may carry both."""

    async def main() -> list[dict]:
        async with connect(server) as c:
            call = {"type": "function_call", "call_id": "call_abc", "name": "get_time", "arguments": "{}"}
            await c.send({"type": "conversation.item.create", "item": call})
            created = (await c.until("conversation.item.done"))[-1]["item"]
            out = {"type": "function_call_output", "call_id": "call_abc", "output": "noon"}
            await c.send({"type": "conversation.item.create", "item": out})
            await c.until("conversation.item.done")
            side = {"type": "function_call", "call_id": "call_side", "name": "get_time", "arguments": "{}"}
            await c.send(
                {
                    "type": "response.create",
                    "response": {
                        "conversation": "none",
                        "output_modalities": ["text"],
                        "input": [
                            side,
                            {"type": "function_call_output", "call_id": "call_side", "output": "dusk"},
                        ],
                    },
                }
            )
            return [created, *(await c.until("response.done"))]

    created, *events = run(main())
    assert created["status"] == "completed" and created["id"].startswith("item_")
    request = server.pipeline.requests[-1]
    assert [m.role for m in request.messages] == ["assistant", "tool"]
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "The tool said: dusk."


def test_a_choice_set_before_its_tools_is_matched_when_a_response_is_created(server: Server) -> None:
    """pipecat and livekit send ``tool_choice`` in their first session.update and the tools in a
    later one: the update is accepted whole (nothing of it dropped), and the two are matched when a
    response is created. A response whose choice its tools cannot satisfy is refused, starting
    nothing; once the tools arrive the forced call is made."""

    async def main() -> tuple[list[dict], list[dict], list[dict]]:
        async with connect(server) as c:
            first = await update(c, {"instructions": "be brief", "tool_choice": "required"})
            named = await update(c, {"tool_choice": {"type": "function", "name": "get_weather"}})
            await c.send({"type": "conversation.item.create", "item": text_item("Weather in Oslo?")})
            await c.until("conversation.item.done")
            errors = []
            await c.send({"type": "response.create", "event_id": "evt_early"})
            errors.append(await c.error())
            await update(c, {"tools": [TIME]})  # still not the named function
            await c.send({"type": "response.create", "response": {"output_modalities": ["text"]}})
            errors.append(await c.error())
            await update(c, {"tools": [WEATHER, TIME]})
            await c.send({"type": "response.create", "response": {"output_modalities": ["text"]}})
            done = await c.until("response.done")
            return [first, named], errors, done

    sessions, errors, done = run(main())
    assert sessions[0]["instructions"] == "be brief" and sessions[0]["tool_choice"] == "required"
    assert sessions[1]["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert [(e["code"], e["param"], e["event_id"]) for e in errors] == [
        ("invalid_value", "session.tool_choice", "evt_early"),
        ("invalid_value", "session.tool_choice", None),
    ]
    assert "'get_weather'" in errors[0]["message"] and "'get_time'" in errors[1]["message"]
    assert [e["type"] for e in done].count("response.created") == 1
    assert [o["name"] for o in done[-1]["response"]["output"]] == ["get_weather"]
