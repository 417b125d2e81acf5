"""The Realtime beta protocol (``OpenAI-Beta: realtime=v1``), served by translation at the edge.

Clients: the openai SDK's own beta client (``client.beta.realtime.connect``, which sends the
header), a raw WebSocket offering the ``openai-beta.realtime-v1`` subprotocol, and one connecting
as livekit's Azure mode does (``?api-version=...`` and an ``api-key`` header). Every frame they
receive is validated against the SDK's beta models (``openai.types.beta.realtime``) and must
carry no field those models lack (exact shapes, nested objects included); no GA-only event name
ever reaches a beta client. GA clients on the same server are checked to be unaffected.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import websockets
from omnirt.realtime.config import ServerConfig
from openai.types.beta.realtime import RealtimeServerEvent as BetaServerEvent
from pydantic import BaseModel, TypeAdapter

from tests.vad.speech import SENTENCES, spoken, to_pcm16

from .conftest import (
    EXTENSION_EVENTS,
    MAX_FRAME,
    MODEL,
    Server,
    connect,
    run,
    running,
    sdk_connect,
    text_item,
)

BETA_ADAPTER: TypeAdapter[Any] = TypeAdapter(BetaServerEvent)
#: Server event names of the GA protocol that the beta protocol names otherwise or lacks.
GA_ONLY = {
    "conversation.item.added",
    "conversation.item.done",
    "response.output_audio.delta",
    "response.output_audio.done",
    "response.output_audio_transcript.delta",
    "response.output_audio_transcript.done",
    "response.output_text.delta",
    "response.output_text.done",
    "input_audio_buffer.timeout_triggered",
}
#: How a beta response starts, and ends (beta has no ``conversation.item.done``).
RESPONSE_HEAD = [
    "response.created",
    "response.output_item.added",
    "conversation.item.created",
    "response.content_part.added",
]
TEXT_RESPONSE_TAIL = [
    "response.text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.done",
]
AUDIO_RESPONSE_TAIL = [
    "response.audio.done",
    "response.audio_transcript.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.done",
]
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def _no_extra_fields(model: Any, where: str) -> None:
    """Every object in the event has only the fields its beta model declares."""
    if isinstance(model, BaseModel):
        extra = model.model_extra or {}
        assert not extra, f"{where}: fields the beta models lack: {sorted(extra)}"
        for name in type(model).model_fields:
            _no_extra_fields(getattr(model, name), f"{where}.{name}")
    elif isinstance(model, list):
        for i, value in enumerate(model):
            _no_extra_fields(value, f"{where}.{i}")


def validate_beta(raw: str | bytes, seen_ids: set[str]) -> dict[str, Any]:
    assert len(raw) < MAX_FRAME, f"server frame of {len(raw)} bytes"
    event = json.loads(raw)
    assert isinstance(event.get("event_id"), str) and event["event_id"].startswith("event_")
    assert event["type"] not in GA_ONLY, f"GA event sent to a beta client: {event['type']}"
    if event["type"] not in EXTENSION_EVENTS:
        _no_extra_fields(BETA_ADAPTER.validate_python(event), event["type"])
    assert event["event_id"] not in seen_ids, "event_id reused"
    seen_ids.add(event["event_id"])
    return event


class BetaClient:
    """Receives through ``frame`` (a coroutine function), validating every frame strictly."""

    def __init__(self, frame: Any) -> None:
        self._frame = frame
        self.events: list[dict[str, Any]] = []
        self._ids: set[str] = set()

    async def recv(self, timeout: float = 5.0) -> dict[str, Any]:
        event = validate_beta(await asyncio.wait_for(self._frame(), timeout), self._ids)
        self.events.append(event)
        return event

    async def until(self, kind: str, timeout: float = 10.0) -> list[dict[str, Any]]:
        out = []
        while True:
            out.append(await self.recv(timeout))
            if out[-1]["type"] == kind:
                return out


@contextlib.asynccontextmanager
async def raw_beta(
    url: str, *, headers: dict[str, str] | None = None, subprotocols: list[str] | None = None
) -> AsyncIterator[tuple[Any, BetaClient]]:
    async with websockets.connect(
        url,
        additional_headers=headers or {},
        subprotocols=subprotocols,  # type: ignore[arg-type]
        max_size=MAX_FRAME,
    ) as ws:
        yield ws, BetaClient(ws.recv)


async def _send(ws: Any, event: dict[str, Any]) -> None:
    await ws.send(json.dumps(event))


def _kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


def test_sdk_beta_client_completes_a_text_turn_and_a_spoken_turn(server: Server) -> None:
    """``client.beta.realtime.connect``: session.update with the flat beta fields, a text turn
    (``response.text.*``) and a spoken turn (espeak-ng speech, manual commit) answered with
    ``response.audio.delta`` / ``response.audio_transcript.delta``; ``conversation.item.created``
    for each item, ``response.done`` with beta response objects; the assistant item retrieved
    with its audio as a beta ``audio`` part."""
    speech = to_pcm16(spoken(SENTENCES[0]))

    async def main() -> dict[str, Any]:
        async with server.sdk().beta.realtime.connect(model=MODEL) as conn:
            c = BetaClient(conn.recv_bytes)
            created = await c.recv()
            await conn.session.update(
                session={
                    "modalities": ["text", "audio"],
                    "voice": "alto",
                    "instructions": "Be brief.",
                    "input_audio_format": "pcm16",
                    "output_audio_format": "pcm16",
                    "turn_detection": None,
                    "tools": [WEATHER_TOOL],
                    "tool_choice": "auto",
                    "temperature": 0.8,
                    "max_response_output_tokens": 200,
                }
            )
            updated = (await c.until("session.updated"))[-1]

            await conn.conversation.item.create(item=text_item("Hello there"))
            text_item_created = (await c.until("conversation.item.created"))[-1]
            await conn.response.create(response={"modalities": ["text"]})
            text_turn = await c.until("response.done")

            for i in range(0, len(speech), 4800):  # 100 ms appends, as a live client sends them
                await conn.input_audio_buffer.append(audio=base64.b64encode(speech[i : i + 4800]).decode())
            await conn.input_audio_buffer.commit()
            committed = await c.until("conversation.item.created")
            await conn.response.create()
            spoken_turn = await c.until("response.done")

            assistant_id = spoken_turn[-1]["response"]["output"][0]["id"]
            await conn.conversation.item.retrieve(item_id=assistant_id)
            retrieved = (await c.until("conversation.item.retrieved"))[-1]
            return {
                "created": created,
                "updated": updated,
                "text_item": text_item_created,
                "text_turn": text_turn,
                "committed": committed,
                "spoken_turn": spoken_turn,
                "retrieved": retrieved,
            }

    r = run(main())
    session = r["created"]["session"]
    assert session["id"].startswith("sess_") and "model" not in session  # not one of the beta enum
    assert session["input_audio_format"] == session["output_audio_format"] == "pcm16"
    assert session["modalities"] == ["text", "audio"] and session["max_response_output_tokens"] == "inf"

    session = r["updated"]["session"]
    assert session["modalities"] == ["text", "audio"] and session["voice"] == "alto"
    assert session["instructions"] == "Be brief." and session["turn_detection"] is None
    assert session["tools"] == [WEATHER_TOOL] and session["tool_choice"] == "auto"
    assert session["max_response_output_tokens"] == 200

    user_text = r["text_item"]["item"]
    assert user_text["role"] == "user" and user_text["content"] == [
        {"type": "input_text", "text": "Hello there"}
    ]
    text_turn = r["text_turn"]
    kinds = _kinds(text_turn)
    assert kinds[:4] == RESPONSE_HEAD
    assert kinds[-4:] == TEXT_RESPONSE_TAIL
    assert set(kinds[4:-4]) == {"response.text.delta"}
    text = "".join(e["delta"] for e in text_turn if e["type"] == "response.text.delta")
    assert text == "You said: Hello there."
    assistant_created = text_turn[2]
    assert assistant_created["previous_item_id"] == user_text["id"]
    done = text_turn[-1]["response"]
    assert done["status"] == "completed" and done["modalities"] == ["text"]
    assert done["output"][0]["content"] == [{"type": "text", "text": text}]
    assert done["voice"] == "alto" and done["output_audio_format"] == "pcm16"

    committed = r["committed"]
    assert _kinds(committed) == ["input_audio_buffer.committed", "conversation.item.created"]
    user_audio = committed[1]["item"]
    assert user_audio["id"] == committed[0]["item_id"] and user_audio["role"] == "user"
    assert user_audio["content"] == [{"type": "input_audio", "transcript": None}]

    turn = r["spoken_turn"]
    kinds = _kinds(turn)
    assert kinds[:4] == RESPONSE_HEAD
    assert kinds[-5:] == AUDIO_RESPONSE_TAIL
    assert set(kinds[4:-5]) == {"response.audio.delta", "response.audio_transcript.delta"}
    rid = turn[0]["response"]["id"]
    item_id = turn[1]["item"]["id"]
    for e in turn[3:-2]:
        assert e["response_id"] == rid and e["item_id"] == item_id, e["type"]
    assert turn[-2]["response_id"] == rid and turn[-2]["item"]["id"] == item_id
    assert turn[2]["item"]["id"] == item_id and turn[2]["previous_item_id"] == user_audio["id"]
    assert turn[3]["part"] == {"type": "audio", "transcript": ""}
    audio = b"".join(base64.b64decode(e["delta"]) for e in turn if e["type"] == "response.audio.delta")
    assert len(audio) > 0 and len(audio) % 2 == 0
    transcript = "".join(e["delta"] for e in turn if e["type"] == "response.audio_transcript.delta")
    assert transcript.startswith("You said:") and transcript.endswith("ms of audio.")
    done = turn[-1]["response"]
    assert done["id"] == rid and done["status"] == "completed" and done["modalities"] == ["text", "audio"]
    assert done["output"][0]["content"] == [{"type": "audio", "transcript": transcript}]
    assert done["usage"]["output_tokens"] > 0

    part = r["retrieved"]["item"]["content"][0]
    assert part["type"] == "audio" and base64.b64decode(part["audio"]) == audio


def test_beta_subprotocol_errors_name_beta_fields_and_leave_the_session(server: Server) -> None:
    """A browser-style client (``openai-beta.realtime-v1`` subprotocol, no header) gets the beta
    protocol. Bad beta fields are refused naming the beta field, the session keeps what it had;
    good ones (G.711 formats, a named tool choice, VAD without a ``type``) are applied and echoed
    in beta form."""
    bad_sessions: list[tuple[dict[str, Any], str, str]] = [
        ({"input_audio_format": "pcm8"}, "invalid_value", "session.input_audio_format"),
        ({"output_audio_format": {"type": "audio/pcm"}}, "invalid_value", "session.output_audio_format"),
        ({"voice": "nobody"}, "invalid_value", "session.voice"),
        ({"max_response_output_tokens": 0}, "integer_below_min_value", "session.max_response_output_tokens"),
        ({"modalities": ["video"]}, "invalid_value", "session.modalities.0"),
        (
            {"turn_detection": {"type": "server_vad", "threshold": 2}},
            "decimal_above_max_value",
            "session.turn_detection.threshold",
        ),
        ({"temperature": 3}, "decimal_above_max_value", "session.temperature"),
        ({"instructions": "changed", "colour": "blue"}, "unknown_parameter", "session.colour"),
    ]
    bad_responses: list[tuple[dict[str, Any], str, str]] = [
        ({"max_response_output_tokens": 0}, "integer_below_min_value", "response.max_response_output_tokens"),
        ({"voice": "nobody"}, "invalid_value", "response.voice"),
        ({"output_audio_format": "mp3"}, "invalid_value", "response.output_audio_format"),
    ]

    async def main() -> tuple[list[dict], dict, dict, dict]:
        url = server.ws_url
        async with raw_beta(url, subprotocols=["realtime", "openai-beta.realtime-v1"]) as (ws, c):
            created = (await c.recv())["session"]
            errors = []
            for i, session in enumerate(s for s, _, _ in bad_sessions):
                await _send(ws, {"type": "session.update", "session": session, "event_id": f"evt_s{i}"})
                errors.append((await c.until("error"))[-1]["error"])
            for i, response in enumerate(r for r, _, _ in bad_responses):
                await _send(ws, {"type": "response.create", "response": response, "event_id": f"evt_r{i}"})
                errors.append((await c.until("error"))[-1]["error"])
            await _send(ws, {"type": "session.update", "session": {}})
            unchanged = (await c.until("session.updated"))[-1]["session"]
            await _send(
                ws,
                {
                    "type": "session.update",
                    "session": {
                        "input_audio_format": "g711_ulaw",
                        "output_audio_format": "g711_alaw",
                        "input_audio_noise_reduction": {"type": "near_field"},
                        "turn_detection": {"silence_duration_ms": 300, "eagerness": None},
                        "speed": 1.2,
                        "tools": [WEATHER_TOOL],
                        "tool_choice": "get_weather",
                        "modalities": ["text"],
                        "client_secret": {"expires_after": {"anchor": "created_at", "seconds": 60}},
                    },
                },
            )
            applied = (await c.until("session.updated"))[-1]["session"]
            return errors, created, unchanged, applied

    errors, created, unchanged, applied = run(main())
    expected = [(code, param) for _, code, param in bad_sessions + bad_responses]
    assert [(e["code"], e["param"]) for e in errors] == expected
    assert [e["event_id"] for e in errors] == [f"evt_s{i}" for i in range(len(bad_sessions))] + [
        f"evt_r{i}" for i in range(len(bad_responses))
    ]
    message = errors[3]["message"]  # the GA validation's message, naming the field
    assert "'session.max_response_output_tokens'" in message and "max_output_tokens" not in message
    assert unchanged == created  # nothing of the refused updates was applied
    assert applied["input_audio_format"] == "g711_ulaw" and applied["output_audio_format"] == "g711_alaw"
    assert applied["input_audio_noise_reduction"] == {"type": "near_field"}
    vad = applied["turn_detection"]
    assert vad["type"] == "server_vad" and vad["silence_duration_ms"] == 300
    assert "idle_timeout_ms" not in vad  # GA-only, and not set
    assert applied["speed"] == 1.2 and applied["modalities"] == ["text"]
    assert applied["tool_choice"] == "get_weather"  # GA {"type":"function","name":...}, as beta writes it


@pytest.fixture(scope="module")
def keyed() -> Any:
    with running(ServerConfig(api_keys=["azure-key"])) as s:
        yield s


def test_azure_preview_client_gets_the_beta_protocol(keyed: Server) -> None:
    """As livekit's Azure mode connects: ``/realtime?api-version=...&deployment=...`` with an
    ``api-key`` header and no ``OpenAI-Beta`` header. An assistant item with a beta ``text`` part
    is stored as the GA ``output_text`` and shown back as ``text``; a wrong key is refused."""
    base = keyed.base_url.replace("http://", "ws://") + "/v1/realtime"
    url = base + "?api-version=2024-10-01-preview&deployment=omni"

    async def main() -> tuple[dict, dict, dict, int | None]:
        async with raw_beta(url, headers={"api-key": "azure-key"}) as (ws, c):
            created = await c.recv()
            item = {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "text", "text": "Hi, how can I help?", "audio": None}],
                "call_id": None,
            }
            await _send(ws, {"type": "conversation.item.create", "item": item, "previous_item_id": "root"})
            added = (await c.until("conversation.item.created"))[-1]
        async with raw_beta(url, headers={"api-key": "wrong"}) as (ws, c):
            error = await c.recv()
            with contextlib.suppress(websockets.ConnectionClosed):
                await ws.recv()
            return created, added, error, ws.close_code

    created, added, error, close_code = run(main())
    assert created["type"] == "session.created" and created["session"]["input_audio_format"] == "pcm16"
    assert added["item"]["content"] == [{"type": "text", "text": "Hi, how can I help?"}]
    assert added["previous_item_id"] is None  # first in the conversation
    assert keyed.pipeline.requests == []  # an item only: nothing generated
    assert error["error"]["code"] == "invalid_api_key" and close_code == 3000


def test_ga_clients_are_unaffected(server: Server) -> None:
    """The GA SDK on the same server gets GA events only, and beta fields stay refused there; an
    ``OpenAI-Beta`` header that does not name ``realtime=v1`` leaves a connection GA."""

    async def main() -> tuple[list[dict], dict, dict]:
        async with sdk_connect(server) as c:
            await c.conn.session.update(
                session={
                    "type": "realtime",
                    "output_modalities": ["text"],
                    "audio": {"input": {"turn_detection": None}},
                }
            )
            await c.until("session.updated")
            await c.conn.conversation.item.create(item=text_item("Hello there"))
            await c.conn.response.create()
            events = await c.until("response.done")
            await c.conn.send(
                {"type": "session.update", "session": {"type": "realtime", "modalities": ["text"]}}
            )
            error = (await c.until("error"))[-1]["error"]
        async with connect(server, headers={"OpenAI-Beta": "assistants=v2"}) as raw:
            session = raw.events[0]["session"]
        return events, error, session

    events, error, session = run(main())
    kinds = set(_kinds(events))
    assert {"conversation.item.added", "conversation.item.done", "response.output_text.delta"} <= kinds
    assert not kinds & {"conversation.item.created", "response.text.delta", "response.text.done"}
    done = events[-1]["response"]
    assert done["output_modalities"] == ["text"] and done["output"][0]["content"][0]["type"] == "output_text"
    assert error["code"] == "unknown_parameter" and error["param"] == "session.modalities"
    assert "OpenAI-Beta" in error["message"]
    assert session["type"] == "realtime" and "audio" in session and "modalities" not in session
