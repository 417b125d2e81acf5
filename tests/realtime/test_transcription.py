"""Input audio transcription over a real WebSocket (EchoPipeline in the real engine): the session
setting, manual and server VAD turns, retrieve. Every frame is validated strictly (conftest).
The echo pipeline answers a transcription with ``You said: <its instruction>.``."""

from __future__ import annotations

from typing import Any

import numpy as np
from omnirt.stages.types import AudioPart, TextPart

from tests.vad.speech import RATE, SENTENCES, place, spoken, to_pcm16

from .conftest import Server, _Receiver, connect, pcm_b64, run, sdk_connect
from .vad_helpers import kinds, stream_audio

TRANSCRIBED = "conversation.item.input_audio_transcription"


def transcription_update(transcription: dict[str, Any] | None, turn_detection: Any = None) -> dict:
    return {
        "type": "session.update",
        "session": {
            "type": "realtime",
            "audio": {"input": {"transcription": transcription, "turn_detection": turn_detection}},
        },
    }


async def until_all(client: _Receiver, wanted: set[str], timeout: float = 10.0) -> list[dict]:
    """Events until every type in ``wanted`` has been seen."""
    events: list[dict] = []
    while not wanted <= {e["type"] for e in events}:
        events.append(await client.recv(timeout))
    return events


def test_manual_turn_is_transcribed_beside_the_reply_and_retrievable(server: Server) -> None:
    """The official SDK, with the settings the frameworks send: committed, item added/done, then
    the transcription's deltas and completed (with usage) beside the reply, which is created at
    once. The stored transcript shows in conversation.item.retrieved; the reply's context holds
    the user's audio alone."""
    setting = {"model": "gpt-4o-mini-transcribe", "language": "en", "prompt": "Say: hello."}

    async def main() -> tuple[dict, list[dict], dict]:
        async with sdk_connect(server) as client:
            await client.conn.send(transcription_update(setting))
            updated = (await client.until("session.updated"))[-1]
            await client.conn.send({"type": "input_audio_buffer.append", "audio": pcm_b64(1000)})
            await client.conn.send({"type": "input_audio_buffer.commit"})
            await client.conn.send({"type": "response.create", "response": {"output_modalities": ["text"]}})
            events = await until_all(client, {"response.done", f"{TRANSCRIBED}.completed"})
            item_id = events[0]["item_id"]
            await client.conn.send({"type": "conversation.item.retrieve", "item_id": item_id})
            retrieved = (await client.until("conversation.item.retrieved"))[-1]
            return updated, events, retrieved

    updated, events, retrieved = run(main())
    assert updated["session"]["audio"]["input"]["transcription"] == setting
    assert updated["session"]["audio"]["input"]["turn_detection"] is None
    types = kinds(events)
    assert types[:3] == ["input_audio_buffer.committed", "conversation.item.added", "conversation.item.done"]
    item_id = events[0]["item_id"]
    assert events[1]["item"]["content"] == [{"type": "input_audio", "transcript": None}]
    deltas = [e for e in events if e["type"] == f"{TRANSCRIBED}.delta"]
    (completed,) = [e for e in events if e["type"] == f"{TRANSCRIBED}.completed"]
    assert types.index("response.created") < types.index(f"{TRANSCRIBED}.completed")
    assert all((e["item_id"], e["content_index"]) == (item_id, 0) for e in deltas + [completed])
    transcript = (
        "You said: Transcribe the English audio into text.\n"
        "Context that may help with spelling and vocabulary (do not transcribe it): Say: hello.."
    )
    assert "".join(e["delta"] for e in deltas) == completed["transcript"] == transcript
    usage = completed["usage"]
    assert usage["type"] == "tokens" and usage["output_tokens"] == len(transcript.split(" "))
    assert usage["input_token_details"] == {"text_tokens": 2, "audio_tokens": 25}
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    part = retrieved["item"]["content"][0]
    assert part["type"] == "input_audio" and part["transcript"] == transcript and part["audio"]
    reply_id = events[types.index("response.created")]["response"]["id"]
    (reply,) = [r for r in server.pipeline.requests if r.request_id == reply_id]
    user_parts = [p for m in reply.messages if m.role == "user" for p in m.parts]
    assert [type(p) for p in user_parts] == [AudioPart]
    asr = [r for r in server.pipeline.requests if r.request_id.startswith("tr_")][-1]
    assert asr.output_audio is False and [type(p) for p in asr.messages[0].parts] == [AudioPart, TextPart]


def test_server_vad_turn_is_transcribed_after_the_reply_starts(server: Server) -> None:
    """Real speech (espeak-ng) with server VAD: the reply is created in the same step as the
    commit, before the transcription is even submitted; deltas and completed follow."""
    placed = place(spoken(SENTENCES[1]), lead_ms=500, tail_ms=900)

    async def main() -> list[dict]:
        async with connect(server) as c:
            await c.send(transcription_update({"model": "whisper-1"}, {"type": "server_vad"}))
            await c.until("session.updated")
            await stream_audio(c, placed.pcm16())
            return await until_all(c, {"response.done", f"{TRANSCRIBED}.completed"})

    events = run(main())
    types = kinds(events)
    assert types[:6] == [
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "conversation.item.added",
        "conversation.item.done",
        "response.created",
    ]
    item_id = events[0]["item_id"]
    deltas = [e for e in events if e["type"] == f"{TRANSCRIBED}.delta"]
    (completed,) = [e for e in events if e["type"] == f"{TRANSCRIBED}.completed"]
    assert deltas and completed["item_id"] == item_id
    assert completed["transcript"] == "".join(e["delta"] for e in deltas) == (
        "You said: Transcribe the audio into text.."
    )


def test_transcription_setting_is_validated_and_null_turns_it_off(server: Server) -> None:
    """A field the setting does not have: unknown_parameter; a wrong type: invalid_value; both
    leave the session as it was. ``{}`` turns it on, ``null`` off: a commit then has no
    transcription events."""

    async def main() -> tuple[list[dict], list[dict], list[dict]]:
        async with connect(server) as c:
            await c.send(transcription_update({"model": "whisper-1", "temperature": 0}))
            await c.send(transcription_update({"language": 7}))
            errors = [await c.error(), await c.error()]
            await c.send(transcription_update({}))
            on = await c.until("session.updated")
            await c.send(transcription_update(None))
            off = await c.until("session.updated")
            await c.send({"type": "input_audio_buffer.append", "audio": pcm_b64(200)})
            await c.send({"type": "input_audio_buffer.commit"})
            # the reply steps beside where a transcription would: its deltas would come before this
            await c.send({"type": "response.create", "response": {"output_modalities": ["text"]}})
            after = await c.until("response.done")
            return errors, on + off, after

    errors, updates, after = run(main())
    assert [(e["code"], e["param"]) for e in errors] == [
        ("unknown_parameter", "session.audio.input.transcription.temperature"),
        ("invalid_type", "session.audio.input.transcription.language"),
    ]
    assert [u["session"]["audio"]["input"]["transcription"] for u in updates] == [{}, None]
    assert not [e for e in after if e["type"].startswith(TRANSCRIBED)]


def test_idle_timeout_commit_is_transcribed(server: Server) -> None:
    """The item server VAD commits when its idle timeout fires is transcribed too, after the reply
    it starts has been created."""

    async def main() -> list[dict]:
        async with connect(server) as c:
            vad = {"type": "server_vad", "idle_timeout_ms": 600}
            await c.send(transcription_update({"model": "gpt-4o-transcribe", "language": "de"}, vad))
            await c.until("session.updated")
            await stream_audio(c, to_pcm16(np.zeros(RATE * 2, np.float32)))
            return await until_all(c, {"response.done", f"{TRANSCRIBED}.completed"})

    events = run(main())
    types = kinds(events)
    assert types[:5] == [
        "input_audio_buffer.timeout_triggered",
        "input_audio_buffer.committed",
        "conversation.item.added",
        "conversation.item.done",
        "response.created",
    ]
    (completed,) = [e for e in events if e["type"] == f"{TRANSCRIBED}.completed"]
    assert completed["item_id"] == events[0]["item_id"]
    assert completed["transcript"] == "You said: Transcribe the German audio into text.."
