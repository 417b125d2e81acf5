"""Bounds on the shape and size of client values, checked before anything touches session state.

Issue 16's poisoned sessions: a deeply nested value stored by ``session.update`` made every later
update fail with ``server_error`` (a traceback each), and a change whose echo was over the 1 MiB
frame limit was applied and its ``session.updated`` / ``conversation.item.done`` dropped. Each is
now refused up front with a client error code and the session unchanged and usable.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from omnirt.realtime.protocol.json_text import MAX_INT_DIGITS
from omnirt.realtime.transport_log import INVALID_UTF8_LINE

from .conftest import Server, connect, run, text_item, validate


def nested_schema(levels: int) -> dict[str, Any]:
    """An object schema with ``levels`` objects inside each other (2 JSON levels each)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def nested_list(levels: int) -> Any:
    value: Any = "x"
    for _ in range(levels):
        value = [value]
    return value


def tool(name: str, *, description: str = "", parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"type": "function", "name": name, "description": description, "parameters": parameters or {}}


#: (name, client event, the param the error must name (a prefix)). 300 schema levels is what
#: poisoned a session before (accepted, then every update failed); 20 is already over the bound.
DEEP_EVENTS = [
    (
        "tool parameters, 300 levels",
        {"type": "session.update", "session": {"tools": [tool("f", parameters=nested_schema(300))]}},
        "session.tools.0.parameters.properties.a",
    ),
    (
        "tool parameters, 20 levels",
        {"type": "session.update", "session": {"tools": [tool("f", parameters=nested_schema(20))]}},
        "session.tools.0.parameters.properties.a",
    ),
    (
        "transcription",
        {
            "type": "session.update",
            "session": {"audio": {"input": {"transcription": {"model": nested_list(200)}}}},
        },
        "session.audio.input.transcription.model.0",
    ),
    (
        "tool_choice",
        {
            "type": "session.update",
            "session": {"tool_choice": {"type": "function", "name": nested_list(200)}},
        },
        "session.tool_choice.name.0",
    ),
    (
        "response metadata",
        {"type": "response.create", "response": {"metadata": {"k": nested_list(200)}}},
        "response.metadata.k.0",
    ),
    (
        "item content",
        {"type": "conversation.item.create", "item": {**text_item("hi"), "content": nested_list(200)}},
        "item.content.0",
    ),
]


def assert_clean_log(caplog: pytest.LogCaptureFixture) -> None:
    """No traceback and nothing at ERROR: refusing a client's input is not a server failure."""
    for record in caplog.records:
        assert record.exc_info is None, record.getMessage()
        assert record.levelno < logging.ERROR, record.getMessage()


def refused_then_usable(server: Server, frame: str) -> tuple[dict, str, dict]:
    """Send ``frame`` on a new session; the error it gets, then the raw frame and the validated
    event answering a ``session.update`` sent after it (the session still usable)."""

    async def main() -> tuple[dict, str, dict]:
        async with connect(server, manual=True) as c:
            await c.send(frame)
            error = await c.error()
            await c.send({"type": "session.update", "session": {"instructions": "still here"}})
            raw = await c.ws.recv()
            return error, raw, validate(raw)

    return run(main())


def test_deep_values_refused_and_session_usable(server: Server, caplog: pytest.LogCaptureFixture) -> None:
    """Each deeply nested value gets invalid_value naming where it is too deep; the session keeps
    its state (no tools stored) and the next ordinary session.update succeeds. A real schema
    (8 nested objects, 21 JSON levels in the event) is accepted."""
    caplog.set_level(logging.INFO)

    async def main() -> tuple[list[dict], list[dict], dict]:
        errors, updates = [], []
        async with connect(server, manual=True) as c:
            for i, (_, event, _) in enumerate(DEEP_EVENTS):
                await c.send({**event, "event_id": f"evt_deep{i}"})
                errors.append(await c.error())
                await c.send({"type": "session.update", "session": {"instructions": f"ok {i}"}})
                updates.append(await c.recv())
            await c.send(
                {"type": "session.update", "session": {"tools": [tool("g", parameters=nested_schema(8))]}}
            )
            accepted = await c.recv()
        return errors, updates, accepted

    errors, updates, accepted = run(main())
    for i, ((name, _, param), error) in enumerate(zip(DEEP_EVENTS, errors, strict=True)):
        assert error["code"] == "invalid_value", (name, error)
        assert error["type"] == "invalid_request_error"
        assert error["param"].startswith(param), (name, error["param"])
        assert "nested more than 32 levels" in error["message"]
        assert error["event_id"] == f"evt_deep{i}"
    for i, updated in enumerate(updates):
        assert updated["type"] == "session.updated", updated
        assert updated["session"]["instructions"] == f"ok {i}"
        assert updated["session"]["tools"] == [] and updated["session"]["tool_choice"] == "auto"
        assert updated["session"]["audio"]["input"]["transcription"] is None
    assert accepted["type"] == "session.updated", accepted
    assert accepted["session"]["tools"][0]["parameters"] == nested_schema(8)
    assert_clean_log(caplog)


def test_oversized_session_refused_before_applied(server: Server, caplog: pytest.LogCaptureFixture) -> None:
    """A 1.5 MB tool description: string_above_max_length; tools whose descriptions fit one by one
    but whose session.updated would be over 1 MiB: invalid_value on 'session'; 129 tools:
    invalid_value on session.tools. None of them is applied (the next update echoes no tools), and
    no server_error is sent."""
    caplog.set_level(logging.INFO)

    async def main() -> tuple[list[dict], dict]:
        async with connect(server, manual=True) as c:
            errors = []
            for tools in (
                [tool("big", description="d" * 1_500_000)],
                [tool(f"t{i}", description="d" * 200_000) for i in range(6)],
                [tool(f"t{i}") for i in range(129)],
            ):
                await c.send({"type": "session.update", "session": {"tools": tools}})
                errors.append(await c.error())
            await c.send({"type": "session.update", "session": {"instructions": "after"}})
            return errors, await c.recv()

    errors, updated = run(main())
    codes = [(e["code"], e["param"]) for e in errors]
    assert codes == [
        ("string_above_max_length", "session.tools.0.description"),
        ("invalid_value", "session"),
        ("invalid_value", "session.tools"),
    ], codes
    assert "session.updated" in errors[1]["message"] and "bytes" in errors[1]["message"]
    assert updated["type"] == "session.updated"
    assert updated["session"]["tools"] == [] and updated["session"]["instructions"] == "after"
    assert_clean_log(caplog)


def test_large_item_refused_before_added(server: Server, caplog: pytest.LogCaptureFixture) -> None:
    """An item whose parts each fit but whose conversation.item.done would be over 1 MiB is
    refused on 'item' and not added (retrieve finds nothing); a response
    metadata value over 512 characters gets string_above_max_length. The conversation stays
    usable: an ordinary item is added after them."""
    caplog.set_level(logging.INFO)
    big = {
        "type": "message",
        "role": "user",
        "id": "big",
        "content": [{"type": "input_text", "text": "t" * 250_000} for _ in range(5)],
    }

    async def main() -> tuple[list[dict], list[dict]]:
        async with connect(server, manual=True) as c:
            errors = []
            await c.send({"type": "conversation.item.create", "item": big, "event_id": "evt_big"})
            errors.append(await c.error())
            await c.send({"type": "conversation.item.retrieve", "item_id": "big"})
            errors.append(await c.error())
            await c.send({"type": "response.create", "response": {"metadata": {"k": "v" * 513}}})
            errors.append(await c.error())
            await c.send({"type": "conversation.item.create", "item": text_item("small", "small")})
            return errors, await c.until("conversation.item.done")

    errors, events = run(main())
    # Text this long is more than the model's context: refused as such (the prompt bound runs
    # before the echo's size is checked, tests/realtime/test_prompt_size.py).
    assert [(e["code"], e["param"]) for e in errors] == [
        ("context_length_exceeded", "item"),
        ("item_retrieve_invalid_item_id", "item_id"),
        ("string_above_max_length", "response.metadata.k"),
    ], errors
    assert errors[0]["event_id"] == "evt_big" and "context" in errors[0]["message"]
    assert [e["type"] for e in events] == ["conversation.item.added", "conversation.item.done"]
    assert events[-1]["item"]["id"] == "small" and events[-1]["previous_item_id"] is None
    assert_clean_log(caplog)


def test_too_many_values_refused(server: Server, caplog: pytest.LogCaptureFixture) -> None:
    """An event holding more than 65,536 JSON values (a flat 70,000-value enum) gets invalid_value
    before validation; the session is unchanged."""
    caplog.set_level(logging.INFO)
    schema = {"type": "object", "properties": {"a": {"type": "integer", "enum": list(range(70_000))}}}

    async def main() -> tuple[dict, dict]:
        async with connect(server, manual=True) as c:
            await c.send({"type": "session.update", "session": {"tools": [tool("f", parameters=schema)]}})
            error = await c.error()
            await c.send({"type": "session.update", "session": {"instructions": "x"}})
            return error, await c.recv()

    error, updated = run(main())
    assert error["code"] == "invalid_value" and "65536 JSON values" in error["message"], error
    assert updated["type"] == "session.updated" and updated["session"]["tools"] == []
    assert_clean_log(caplog)


def test_json_nested_past_the_parser_is_invalid_json(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    """A frame nested 100,000 levels deep cannot even be parsed (the parser's stack ends first):
    invalid_json, not a server_error; the session goes on."""
    caplog.set_level(logging.INFO)
    deep = '{"type": "session.update", "session": {"instructions": ' + "[" * 100_000 + "]" * 100_000 + "}}"

    error, _, updated = refused_then_usable(server, deep)
    assert (error["code"], error["type"]) == ("invalid_json", "invalid_request_error"), error
    assert updated["type"] == "session.updated" and updated["session"]["instructions"] == "still here"
    assert_clean_log(caplog)


@pytest.mark.parametrize("padding", [0, 300_000])  # parsed on the loop, and in a worker thread
def test_integer_past_the_digit_limit_is_invalid_json(
    server: Server, caplog: pytest.LogCaptureFixture, padding: int
) -> None:
    """An integer of 5,000 digits (over Python's int() limit of 4,300, which makes its JSON parser
    raise a plain ValueError) is invalid_json naming the limit (MAX_INT_DIGITS), not a
    server_error (found by the fuzzer, tests/fuzz); the session goes on."""
    caplog.set_level(logging.INFO)
    frame = (
        '{"type": "session.update", "session": {"instructions": "' + "x" * padding + '", '
        '"max_output_tokens": ' + "9" * 5_000 + "}}"
    )

    error, _, updated = refused_then_usable(server, frame)
    assert (error["code"], error["type"]) == ("invalid_json", "invalid_request_error"), error
    assert f"at most {MAX_INT_DIGITS}" in error["message"], error
    assert updated["type"] == "session.updated" and updated["session"]["instructions"] == "still here"
    assert_clean_log(caplog)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_text_frame_not_utf8_closes_1007_with_one_log_line(server: Server) -> None:
    """A text frame that is not UTF-8: the transport closes with 1007 (RFC 6455), and logs one INFO
    line, not the traceback at ERROR uvicorn writes (found by the fuzzer, tests/fuzz); other
    sessions go on."""
    transport = logging.getLogger("uvicorn.error")
    records, level = _Records(), transport.level
    transport.addHandler(records)
    transport.setLevel(logging.INFO)

    async def main() -> tuple[int | None, dict]:
        async with connect(server) as bad:
            await bad.ws.send(b'{"type": "session.update", "session": {"instructions": "\xff"}}', text=True)
            code = await bad.closed()
        async with connect(server, manual=True) as good:
            await good.send({"type": "session.update", "session": {"instructions": "still here"}})
            return code, await good.recv()

    try:
        code, updated = run(main())
    finally:
        transport.removeHandler(records)
        transport.setLevel(level)
    assert code == 1007
    assert updated["type"] == "session.updated"
    assert all(r.levelno < logging.ERROR and r.exc_info is None for r in records.records), records.records
    utf8 = [r for r in records.records if "UTF-8" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in utf8] == [(logging.INFO, INVALID_UTF8_LINE)]


#: Events with a lone surrogate escape where no field type checks the text (free-form values, keys,
#: the append's event_id), and the param each error must name.
SURROGATE_EVENTS = [
    (
        '{"type": "session.update", "session": {"tools": [{"type": "function", "name": "f", "parameters": '
        '{"type": "object", "properties": {"a": {"type": "string", "description": "\\udfff"}}}}]}}',
        "session.tools.0.parameters.properties.a.description",
    ),
    ('{"type": "session.update", "session": {"tracing": {"\\ud800": 1}}}', "session.tracing"),
    ('{"type": "input_audio_buffer.append", "audio": "AAAA", "event_id": "e\\ud800"}', "event_id"),
]


@pytest.mark.parametrize(("frame", "param"), SURROGATE_EVENTS)
def test_lone_surrogate_refused_and_connection_kept(
    server: Server, caplog: pytest.LogCaptureFixture, frame: str, param: str
) -> None:
    """A lone surrogate escape (``"\\ud800"``: valid JSON to Python's parser, no character) in a
    free-form value was stored, and the session's next echo could not be encoded: the connection
    dropped without a word (found by the fuzzer, tests/fuzz). Now invalid_value naming where, and
    the session goes on unchanged."""
    caplog.set_level(logging.INFO)

    error, _, updated = refused_then_usable(server, frame)
    assert (error["code"], error["param"]) == ("invalid_value", param), error
    assert "lone surrogate" in error["message"]
    assert updated["type"] == "session.updated" and updated["session"]["tools"] == []
    assert_clean_log(caplog)


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_numbers_json_lacks_are_invalid_json(
    server: Server, caplog: pytest.LogCaptureFixture, number: str
) -> None:
    """Python's parser reads NaN, Infinity and 1e999 as floats; stored in a free-form value (a
    tool's schema), they were echoed in ``session.updated`` as the same tokens, which no strict
    JSON parser (a browser's, the SDKs') reads. Refused as invalid_json; nothing stored."""
    caplog.set_level(logging.INFO)
    frame = (
        '{"type": "session.update", "session": {"tools": [{"type": "function", "name": "f", "parameters": '
        '{"type": "object", "properties": {"a": {"type": "number", "maximum": ' + number + "}}}}]}}"
    )

    error, updated, _ = refused_then_usable(server, frame)
    assert (error["code"], error["type"]) == ("invalid_json", "invalid_request_error"), error
    assert number in error["message"]
    parsed = json.loads(updated, parse_constant=lambda token: pytest.fail(f"{token} sent back"))
    assert parsed["type"] == "session.updated" and parsed["session"]["tools"] == []
    assert_clean_log(caplog)
