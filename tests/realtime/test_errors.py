"""Bad input gets one ``error`` event (echoing the client's event_id) and changes nothing."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from omnirt.realtime.config import ServerConfig

from .conftest import MODEL, Client, Server, b64, connect, pcm_b64, run, running, text_item


@pytest.fixture(scope="module")
def limited() -> Iterator[Server]:
    config = ServerConfig(
        max_append_bytes=48_000,  # 1 s of 24 kHz PCM16 per append
        max_input_buffer_bytes=96_000,  # 2 s held
        max_client_event_bytes=200_000,
    )
    with running(config) as s:
        yield s


def test_malformed_frames(server: Server) -> None:
    """OpenAI's codes: not JSON: invalid_json; an unknown type: invalid_value (param type); no type:
    missing_required_parameter; a binary frame: invalid_event; not an object: invalid_event. A
    missing field: missing_required_parameter; an extra field: unknown_parameter; a wrong type:
    invalid_type. The session answers normally afterwards."""

    async def main() -> tuple[list[dict], dict]:
        async with connect(server) as c:
            frames: list[str | bytes] = [
                "{not json",
                "[1, 2]",
                json.dumps({"event_id": "evt_notype"}),
                json.dumps({"type": 7, "event_id": "evt_typetype"}),
                json.dumps({"type": "response.explode", "event_id": "evt_unknown"}),
                json.dumps({"type": "input_audio_buffer.append", "event_id": "evt_missing"}),
                json.dumps({"type": "input_audio_buffer.commit", "bogus": 1, "event_id": "evt_extra"}),
                json.dumps(
                    {
                        "type": "conversation.item.truncate",
                        "item_id": "x",
                        "content_index": "zero",
                        "audio_end_ms": 0,
                        "event_id": "evt_type",
                    }
                ),
                b"\x00\x01",
            ]
            errors = []
            for frame in frames:
                await c.ws.send(frame)
                errors.append(await c.error())
            await c.send({"type": "input_audio_buffer.clear"})
            return errors, await c.recv()

    errors, after = run(main())
    assert [(e["code"], e["event_id"], e["param"]) for e in errors] == [
        ("invalid_json", None, None),
        ("invalid_event", None, None),
        ("missing_required_parameter", "evt_notype", "type"),
        ("invalid_type", "evt_typetype", "type"),
        ("invalid_value", "evt_unknown", "type"),
        ("missing_required_parameter", "evt_missing", "audio"),
        ("unknown_parameter", "evt_extra", "bogus"),
        ("invalid_type", "evt_type", "content_index"),
        ("invalid_event", None, None),
    ]
    assert "'response.create'" in errors[4]["message"]  # lists the supported event types
    assert all(e["type"] == "invalid_request_error" for e in errors)
    assert after["type"] == "input_audio_buffer.cleared"


def test_append_errors_leave_the_buffer_as_it_was(limited: Server) -> None:
    """Invalid base64, an odd byte count, a payload over max_append_bytes, and audio past
    max_input_buffer_bytes (input_backpressure) are refused; a commit under 100 ms is
    input_audio_buffer_commit_empty; what was buffered before is committed intact."""

    async def main() -> tuple[list[dict], dict]:
        async with connect(limited, manual=True) as c:
            await c.send({"type": "input_audio_buffer.append", "audio": pcm_b64(50)})
            await c.send({"type": "input_audio_buffer.commit", "event_id": "evt_short"})
            errors = [await c.error()]
            for i, audio in enumerate(
                [
                    "not base64!!",
                    b64(b"\x01\x02\x03"),
                    pcm_b64(1001),  # over the 1 s append limit
                ]
            ):
                await c.send({"type": "input_audio_buffer.append", "audio": audio, "event_id": f"evt_{i}"})
                errors.append(await c.error())
            await c.send({"type": "input_audio_buffer.append", "audio": pcm_b64(1000)})
            await c.send(
                {"type": "input_audio_buffer.append", "audio": pcm_b64(1000), "event_id": "evt_full"}
            )
            errors.append(await c.error())
            await c.send({"type": "input_audio_buffer.commit"})
            committed = await c.recv()
            await c.until("conversation.item.done")
            await c.send({"type": "conversation.item.retrieve", "item_id": committed["item_id"]})
            retrieved = await c.recv()
            return errors, retrieved

    errors, retrieved = run(main())
    assert [(e["code"], e["event_id"]) for e in errors] == [
        ("input_audio_buffer_commit_empty", "evt_short"),
        ("invalid_value", "evt_0"),
        ("invalid_value", "evt_1"),
        ("invalid_value", "evt_2"),
        ("input_backpressure", "evt_full"),
    ]
    # 50 ms + 1000 ms made it into the item, nothing of the refused appends
    assert len(base64.b64decode(retrieved["item"]["content"][0]["audio"])) == 1050 * 48
    assert all(e["param"] == "audio" for e in errors[1:])


def test_committed_audio_is_exactly_what_was_accepted(limited: Server) -> None:
    async def main() -> dict:
        async with connect(limited, manual=True) as c:
            await c.send({"type": "input_audio_buffer.append", "audio": pcm_b64(120)})
            await c.send({"type": "input_audio_buffer.append", "audio": b64(b"\x01\x02\x03")})
            await c.error()
            await c.send({"type": "input_audio_buffer.commit"})
            item_id = (await c.until("conversation.item.done"))[0]["item_id"]
            await c.send({"type": "conversation.item.retrieve", "item_id": item_id})
            return await c.recv()

    retrieved = run(main())
    assert len(base64.b64decode(retrieved["item"]["content"][0]["audio"])) == 120 * 48


def test_client_event_over_the_size_limit(limited: Server) -> None:
    """A frame over max_client_event_bytes gets invalid_event; the session goes on."""

    async def main() -> tuple[dict, dict]:
        async with connect(limited) as c:
            await c.send({"type": "input_audio_buffer.append", "audio": "A" * 250_000})
            error = await c.error()
            await c.send({"type": "input_audio_buffer.clear"})
            return error, await c.recv()

    error, after = run(main())
    assert error["code"] == "invalid_event" and "limit" in error["message"]
    assert after["type"] == "input_audio_buffer.cleared"


def test_session_update_errors(server: Server) -> None:
    """Beta-only fields and unknown fields: unknown_parameter; a turn_detection type the GA types do
    not have: invalid_value; a threshold over 1: decimal_above_max_value; an unknown voice:
    invalid_value; max_output_tokens 0: integer_below_min_value; a 16 kHz rate:
    integer_below_min_value; instructions of the wrong type: invalid_type; each naming the field.
    A refused update changes nothing, not even its valid fields (as OpenAI's)."""

    async def main() -> tuple[list[dict], dict]:
        async with connect(server) as c:
            bad = [
                {"type": "realtime", "modalities": ["text"]},
                {"type": "realtime", "input_audio_format": "pcm16"},
                {"type": "realtime", "colour": "blue"},
                {"type": "realtime", "audio": {"input": {"turn_detection": {"type": "push_to_talk"}}}},
                {
                    "type": "realtime",
                    "audio": {"input": {"turn_detection": {"type": "server_vad", "threshold": 2}}},
                },
                {"type": "realtime", "audio": {"output": {"voice": "nobody"}}},
                {"type": "realtime", "audio": {"output": {"format": {"type": "audio/mp3"}}}},
                {"type": "realtime", "instructions": "changed", "max_output_tokens": 0},
                {"type": "realtime", "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}},
                {"type": "realtime", "instructions": 42},
                {"type": "realtime", "audio": {"output": {"speed": 0.1}}},
                {
                    "type": "realtime",
                    "audio": {
                        "input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 10**6}}
                    },
                },
            ]
            errors = []
            for i, session in enumerate(bad):
                await c.send({"type": "session.update", "session": session, "event_id": f"evt_{i}"})
                errors.append(await c.error())
            await c.send({"type": "session.update", "session": {"type": "realtime"}})
            return errors, (await c.recv())["session"]

    errors, session = run(main())
    assert [(e["code"], e["param"]) for e in errors] == [
        ("unknown_parameter", "session.modalities"),
        ("unknown_parameter", "session.input_audio_format"),
        ("unknown_parameter", "session.colour"),
        ("invalid_value", "session.audio.input.turn_detection"),
        ("decimal_above_max_value", "session.audio.input.turn_detection.threshold"),
        ("invalid_value", "session.audio.output.voice"),
        ("invalid_value", "session.audio.output.format.type"),
        ("integer_below_min_value", "session.max_output_tokens"),
        ("integer_below_min_value", "session.audio.input.format.rate"),
        ("invalid_type", "session.instructions"),
        ("decimal_below_min_value", "session.audio.output.speed"),
        ("integer_above_max_value", "session.audio.input.turn_detection.silence_duration_ms"),
    ]
    assert [e["event_id"] for e in errors] == [f"evt_{i}" for i in range(12)]
    assert "output_modalities" in errors[0]["message"]
    assert "Expected a value <= 1.0, but got 2 instead" in errors[4]["message"]
    assert session["instructions"] == "" and session["max_output_tokens"] == "inf"
    assert session["audio"]["input"]["turn_detection"]["type"] == "server_vad"  # the default, kept


def test_session_update_deep_merges_and_ignores_what_it_does_not_use(server: Server) -> None:
    async def main() -> list[dict]:
        async with connect(server) as c:
            updates = [
                {
                    "type": "realtime",
                    "instructions": "Be nice.",
                    "audio": {"output": {"speed": 1.2}},
                    "tracing": "auto",
                    "truncation": "auto",
                    "include": ["item.input_audio_transcription.logprobs"],
                    "reasoning": {"effort": "low"},
                    "parallel_tool_calls": True,
                    "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
                    "max_output_tokens": 100,
                },
                {"type": "realtime", "audio": {"input": {"format": {"type": "audio/pcma"}}}},
                {"type": "realtime", "instructions": "", "tools": [], "max_output_tokens": None},
            ]
            out = []
            for session in updates:
                await c.send({"type": "session.update", "session": session})
                out.append((await c.recv())["session"])
            return out

    first, second, third = run(main())
    assert first["instructions"] == "Be nice." and first["audio"]["output"]["speed"] == 1.2
    assert first["tools"][0]["name"] == "f" and first["max_output_tokens"] == 100
    assert second["instructions"] == "Be nice." and second["audio"]["output"]["speed"] == 1.2  # kept
    assert second["audio"]["input"]["format"] == {"type": "audio/pcma"}
    assert second["audio"]["output"]["format"] == {"type": "audio/pcm", "rate": 24000}
    assert third["instructions"] == "" and third["tools"] == [] and third["max_output_tokens"] == "inf"
    assert third["audio"]["input"]["format"] == {"type": "audio/pcma"}


def test_voice_cannot_change_after_audio(server: Server) -> None:
    """Before any audio the voice may change; once audio was produced a different voice gets
    cannot_update_voice (OpenAI's code) and the whole update is refused; restating the same voice,
    or another name of it (an OpenAI alias), is fine."""

    def voice(name: str, event_id: str = "evt", **more: object) -> dict:
        return {
            "type": "session.update",
            "event_id": event_id,
            "session": {"type": "realtime", "audio": {"output": {"voice": name}}, **more},
        }

    async def main() -> list[dict]:
        async with connect(server, manual=True) as c:
            await c.send(voice("alto"))
            out = [await c.recv()]
            await c.send({"type": "input_audio_buffer.append", "audio": pcm_b64(200)})
            await c.send({"type": "input_audio_buffer.commit"})
            await c.send({"type": "response.create"})
            out.append((await c.until("response.done"))[-1])
            await c.send(voice("echo", "evt_change", instructions="ignored"))
            out.append(await c.recv())
            await c.send(voice("alto"))
            out.append(await c.recv())
            await c.send(voice("ash"))  # OpenAI's second name: the model's second voice, alto
            out.append(await c.recv())
            return out

    before, done, changed, same, alias = run(main())
    assert before["session"]["audio"]["output"]["voice"] == "alto"
    assert done["response"]["audio"]["output"]["voice"] == "alto"
    assert server.pipeline.requests[-1].voice == "alto"
    assert changed["type"] == "error" and changed["error"]["code"] == "cannot_update_voice"
    assert (
        changed["error"]["param"] == "session.audio.output.voice"
        and changed["error"]["event_id"] == "evt_change"
    )
    assert same["type"] == "session.updated" and same["session"]["audio"]["output"]["voice"] == "alto"
    assert same["session"]["instructions"] == ""  # the refused update left nothing behind
    assert alias["type"] == "session.updated" and alias["session"]["audio"]["output"]["voice"] == "ash"


def test_openai_voice_names_are_aliases(server: Server) -> None:
    """A session starts with OpenAI's default voice, alloy; OpenAI's names are accepted in
    session.update and response.create and shown as asked, while the engine gets the model's
    voice (by default the i-th OpenAI name is the model's voice i mod n: the test model has echo
    and alto). The model's own names still work, and win over an alias of the same name."""

    async def turn(c: Client, response: dict | None = None) -> dict:
        await c.send({"type": "conversation.item.create", "item": text_item("hi")})
        await c.send({"type": "response.create", **({"response": response} if response else {})})
        return (await c.until("response.done"))[-1]["response"]

    async def main() -> list[Any]:
        async with connect(server) as c:
            created = c.events[0]["session"]
            first = await turn(c)
            first_voice = server.pipeline.requests[-1].voice
            await c.send(
                {
                    "type": "session.update",
                    "session": {
                        "type": "realtime",
                        "instructions": "Be brief.",
                        "audio": {"input": {"turn_detection": None}, "output": {"voice": "alloy"}},
                    },
                }
            )
            updated = (await c.recv())["session"]
            override = await turn(c, {"audio": {"output": {"voice": "marin"}}})
            override_voice = server.pipeline.requests[-1].voice
            own = await turn(c, {"audio": {"output": {"voice": "echo"}}})
            return [created, first, first_voice, updated, override, override_voice, own]

    created, first, first_voice, updated, override, override_voice, own = run(main())
    assert created["audio"]["output"]["voice"] == "alloy"
    assert first["audio"]["output"]["voice"] == "alloy" and first_voice == "echo"
    assert updated["audio"]["output"]["voice"] == "alloy" and updated["instructions"] == "Be brief."
    assert updated["audio"]["input"]["turn_detection"] is None
    assert override["audio"]["output"]["voice"] == "marin" and override_voice == "echo"  # 8th: 8 % 2
    assert own["audio"]["output"]["voice"] == "echo" and server.pipeline.requests[-1].voice == "echo"


def test_voice_aliases_are_server_configuration() -> None:
    """``voice_aliases`` (``--voice-alias NAME=VOICE``) override the defaults and add names; the
    aliases are listed by /v1/models."""
    config = ServerConfig(voice_aliases={"ash": "echo", "narrator": "alto"})

    async def main(s: Server) -> list[Any]:
        async with connect(s, manual=True) as c:
            voices = []
            for name in ("ash", "narrator", "cedar"):
                await c.send({"type": "conversation.item.create", "item": text_item("hi")})
                await c.send({"type": "response.create", "response": {"audio": {"output": {"voice": name}}}})
                done = (await c.until("response.done"))[-1]["response"]
                voices.append((done["audio"]["output"]["voice"], s.pipeline.requests[-1].voice))
            return voices

    with running(config) as s:
        voices = run(main(s))
        card = httpx.get(f"{s.base_url}/v1/models/{MODEL}", timeout=5).json()
    assert voices == [("ash", "echo"), ("narrator", "alto"), ("cedar", "alto")]
    assert card["voices"] == ["echo", "alto"]
    assert card["voice_aliases"] == {
        "alloy": "echo",
        "ash": "echo",
        "ballad": "echo",
        "coral": "alto",
        "sage": "alto",
        "shimmer": "echo",
        "verse": "alto",
        "marin": "echo",
        "cedar": "alto",
        "narrator": "alto",
    }


def test_an_item_too_large_to_echo_is_refused_up_front(server: Server) -> None:
    """A user item of five 256 Ki-character texts: each part fits, but its echo would be a frame
    over 1 MiB (older SDKs close on those) and it is more than the model's context: it is refused
    up front (context_length_exceeded on 'item', before the echo's size is checked; not the
    server_error it once got after being added) and is not in the conversation."""
    part = {"type": "input_text", "text": "x" * (256 * 1024)}
    item = {"type": "message", "role": "user", "content": [part] * 5, "id": "item_big"}

    async def main() -> tuple[dict, dict]:
        async with connect(server) as c:
            await c.send({"type": "conversation.item.create", "item": item, "event_id": "evt_big"})
            error = await c.error()
            await c.send({"type": "conversation.item.delete", "item_id": "item_big"})
            return error, await c.error()

    error, not_there = run(main())
    assert (error["code"], error["param"]) == ("context_length_exceeded", "item")
    assert error["type"] == "invalid_request_error" and error["event_id"] == "evt_big"
    assert not_there["code"] == "item_delete_invalid_item_id"


def test_errors_quoting_huge_client_values_stay_clear(server: Server) -> None:
    """An error that quotes what the client sent (an unknown id or event type, a field name, the
    event_id it echoes) is still that error when the value is huge: the quote is elided in the
    middle (message and param), an event_id too long to echo is left out (null), and the client
    gets the code it would get for a short value, not a bare ``server_error`` that names nothing
    (the error's frame used to pass 1 MiB and be replaced by one). The session goes on."""
    big = "x" * (1100 * 1024)
    cases: list[tuple[dict[str, Any], str, str | None]] = [
        ({"type": big, "event_id": "evt_type"}, "invalid_value", "type"),
        ({"type": "conversation.item.retrieve", "item_id": big}, "item_retrieve_invalid_item_id", "item_id"),
        ({"type": "conversation.item.delete", "item_id": big}, "item_delete_invalid_item_id", "item_id"),
        ({"type": "response.cancel", "response_id": big}, "response_cancel_not_active", "response_id"),
        (
            {"type": "conversation.item.create", "previous_item_id": big, "item": text_item("hi")},
            "item_create_invalid_previous_item_id",
            "previous_item_id",
        ),
        ({"type": "session.update", "session": {big: 1}}, "unknown_parameter", None),
        ({"type": "conversation.item.create", "item": {"type": big}}, "invalid_value", "item.type"),
        ({"type": "input_audio_buffer.clear", "bogus": 1, "event_id": big}, "unknown_parameter", "bogus"),
    ]

    async def main() -> tuple[list[dict], dict]:
        async with connect(server, manual=True) as c:
            errors = []
            for event, _, _ in cases:
                await c.send(event)
                errors.append(await c.error())
            await c.send({"type": "input_audio_buffer.clear"})
            return errors, await c.recv()

    errors, after = run(main())
    for (event, code, param), error in zip(cases, errors, strict=True):
        assert (error["type"], error["code"]) == ("invalid_request_error", code), error
        if param is not None:
            assert error["param"] == param, error
        else:  # the unknown field's name, elided
            assert error["param"].startswith("session.xxx") and len(error["param"]) < 1024, error
        assert len(error["message"]) < 16 * 1024
        expected_id = event.get("event_id")
        assert error["event_id"] == (expected_id if expected_id != big else None), error["event_id"][:64]
    assert after["type"] == "input_audio_buffer.cleared"


def test_values_of_the_wrong_json_type_are_not_coerced(server: Server) -> None:
    """A value of the wrong JSON type is ``invalid_type`` (PROTOCOL.md), never coerced: ``true``
    is not the integer 1 (a reply cut to one token), ``"100"`` not 100, ``"yes"`` not a boolean.
    Whole numbers written as decimals (``5.0``, what some clients' JSON encoders write for a
    float) are still taken as integers, as before. Nothing changes on a refusal."""
    vad = {"type": "server_vad"}
    bad: list[tuple[dict[str, Any], str]] = [
        ({"max_output_tokens": True}, "session.max_output_tokens"),
        ({"max_output_tokens": "100"}, "session.max_output_tokens"),
        ({"audio": {"input": {"turn_detection": {**vad, "create_response": "yes"}}}}, "create_response"),
        ({"audio": {"input": {"turn_detection": {**vad, "interrupt_response": 0}}}}, "interrupt_response"),
        ({"audio": {"input": {"turn_detection": {**vad, "threshold": "0.9"}}}}, "threshold"),
        (
            {"audio": {"input": {"turn_detection": {**vad, "silence_duration_ms": False}}}},
            "silence_duration_ms",
        ),
        ({"audio": {"output": {"speed": "1.2"}}}, "session.audio.output.speed"),
        ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": "24000"}}}}, "rate"),
    ]

    async def main() -> tuple[list[dict], dict, dict, dict]:
        async with connect(server, manual=True) as c:
            errors = []
            for patch, _ in bad:
                await c.send({"type": "session.update", "session": patch, "event_id": "evt_bad"})
                errors.append(await c.error())
            await c.send(
                {"type": "response.create", "response": {"max_output_tokens": True}, "event_id": "evt_resp"}
            )
            response_error = await c.error()
            await c.send(
                {
                    "type": "session.update",
                    "session": {
                        "max_output_tokens": 7.0,
                        "audio": {"input": {"turn_detection": {**vad, "silence_duration_ms": 300.0}}},
                    },
                }
            )
            updated = (await c.until("session.updated"))[-1]
            await c.send(
                {
                    "type": "conversation.item.truncate",
                    "item_id": "nope",
                    "content_index": 0.0,
                    "audio_end_ms": 12.0,
                }
            )
            return errors, response_error, updated, await c.error()

    errors, response_error, updated, truncate = run(main())
    for (_, param), error in zip(bad, errors, strict=True):
        assert (error["code"], error["event_id"]) == ("invalid_type", "evt_bad"), error
        assert error["param"].endswith(param), error
    assert (response_error["code"], response_error["param"]) == ("invalid_type", "response.max_output_tokens")
    session = updated["session"]
    assert session["max_output_tokens"] == 7
    assert session["audio"]["input"]["turn_detection"]["silence_duration_ms"] == 300
    assert session["audio"]["output"]["speed"] == 1.0
    assert truncate["code"] == "item_truncate_invalid_item_id"
