"""Bad input gets one ``error`` event (echoing the client's event_id) and changes nothing."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator

import pytest
from omnirt.realtime.config import ServerConfig

from .conftest import Server, b64, connect, pcm_b64, run, running


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
    """Not JSON, not an object, no type, an unknown type, a binary frame: invalid_event.
    A missing field: missing_required_parameter; an extra field: unknown_parameter; a wrong
    type: invalid_value. The session answers normally afterwards."""

    async def main() -> tuple[list[dict], dict]:
        async with connect(server) as c:
            frames: list[str | bytes] = [
                "{not json",
                "[1, 2]",
                json.dumps({"event_id": "evt_notype"}),
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
        ("invalid_event", None, None),
        ("invalid_event", None, None),
        ("invalid_event", "evt_notype", "type"),
        ("invalid_event", "evt_unknown", "type"),
        ("missing_required_parameter", "evt_missing", "audio"),
        ("unknown_parameter", "evt_extra", "bogus"),
        ("invalid_value", "evt_type", "content_index"),
        ("invalid_event", None, None),
    ]
    assert all(e["type"] == "invalid_request_error" for e in errors)
    assert after["type"] == "input_audio_buffer.cleared"


def test_append_errors_leave_the_buffer_as_it_was(limited: Server) -> None:
    """Invalid base64, an odd byte count, a payload over max_append_bytes, and audio past
    max_input_buffer_bytes (input_backpressure) are refused; a commit under 100 ms is
    input_audio_buffer_commit_empty; what was buffered before is committed intact."""

    async def main() -> tuple[list[dict], dict]:
        async with connect(limited) as c:
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
        async with connect(limited) as c:
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
    not have, or a threshold over 1: invalid_value naming the field; an unknown voice: invalid_value.
    The session stays as it was."""

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
        ("invalid_value", "session.audio.input.turn_detection.threshold"),
        ("invalid_value", "session.audio.output.voice"),
        ("invalid_value", "session.audio.output.format.type"),
        ("invalid_value", "session.max_output_tokens"),
    ]
    assert [e["event_id"] for e in errors] == [f"evt_{i}" for i in range(8)]
    assert "output_modalities" in errors[0]["message"]
    assert session["instructions"] == "" and session["audio"]["input"]["turn_detection"] is None


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
    invalid_value (restating the same one is fine)."""

    def voice(name: str, event_id: str = "evt") -> dict:
        return {
            "type": "session.update",
            "event_id": event_id,
            "session": {"type": "realtime", "audio": {"output": {"voice": name}}},
        }

    async def main() -> list[dict]:
        async with connect(server) as c:
            await c.send(voice("alto"))
            out = [await c.recv()]
            await c.send({"type": "input_audio_buffer.append", "audio": pcm_b64(200)})
            await c.send({"type": "input_audio_buffer.commit"})
            await c.send({"type": "response.create"})
            out.append((await c.until("response.done"))[-1])
            await c.send(voice("echo", "evt_change"))
            out.append(await c.recv())
            await c.send(voice("alto"))
            out.append(await c.recv())
            return out

    before, done, changed, same = run(main())
    assert before["session"]["audio"]["output"]["voice"] == "alto"
    assert done["response"]["audio"]["output"]["voice"] == "alto"
    assert server.pipeline.requests[-1].voice == "alto"
    assert changed["type"] == "error" and changed["error"]["code"] == "invalid_value"
    assert (
        changed["error"]["param"] == "session.audio.output.voice"
        and changed["error"]["event_id"] == "evt_change"
    )
    assert same["type"] == "session.updated" and same["session"]["audio"]["output"]["voice"] == "alto"
