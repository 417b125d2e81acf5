"""Session events to GA server events (plain dicts, ready for JSON)."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import singledispatch
from typing import Any

from omnirt.codecs.audio import FormatType, b64encode
from omnirt.sessions import events as ev
from omnirt.sessions.config import SessionConfig
from omnirt.sessions.response import Response
from omnirt.stages.types import Usage

from ..redact import elide, public_message
from .items import item_to_wire

#: Every server frame stays under this (older SDKs close with 1009 above 1 MiB).
MAX_SERVER_FRAME = 1024 * 1024 - 1024


def audio_format(fmt: FormatType) -> dict[str, Any]:
    return {"type": "audio/pcm", "rate": 24000} if fmt == "audio/pcm" else {"type": fmt}


def session_to_wire(session_id: str, c: SessionConfig) -> dict[str, Any]:
    return {
        "type": "realtime",
        "object": "realtime.session",
        "id": session_id,
        "model": c.model,
        "output_modalities": list(c.output_modalities),
        "instructions": c.instructions,
        "audio": {
            "input": {
                "format": audio_format(c.input_format),
                "transcription": c.transcription,
                "noise_reduction": c.noise_reduction,
                "turn_detection": c.turn_detection,
            },
            "output": {"format": audio_format(c.output_format), "voice": c.voice, "speed": c.speed},
        },
        "tools": list(c.tools),
        "tool_choice": c.tool_choice,
        "max_output_tokens": c.max_output_tokens,
        "truncation": c.truncation,
        "tracing": None,
        "prompt": None,
    }


def usage_to_wire(u: Usage) -> dict[str, Any]:
    return {
        "total_tokens": u.input_tokens + u.output_tokens,
        "input_tokens": u.input_tokens,
        "output_tokens": u.output_tokens,
        "input_token_details": {
            "text_tokens": u.input_text_tokens,
            "audio_tokens": u.input_audio_tokens,
            "image_tokens": u.input_image_tokens,
            "cached_tokens": u.cached_tokens,
            "cached_tokens_details": {
                "text_tokens": u.cached_text_tokens,
                "audio_tokens": u.cached_audio_tokens,
                "image_tokens": u.cached_image_tokens,
            },
        },
        "output_token_details": {"text_tokens": u.output_text_tokens, "audio_tokens": u.output_audio_tokens},
    }


def _status_details(r: Response) -> dict[str, Any] | None:
    if r.status == "in_progress":
        return None
    details: dict[str, Any] = {"type": r.status}
    if r.reason is not None:
        details["reason"] = r.reason
    if r.error is not None:
        details["error"] = {
            "type": r.error.type,
            "code": r.error.code,
            "message": public_message(r.error.message),
        }
    return details


def response_to_wire(r: Response) -> dict[str, Any]:
    return {
        "id": r.id,
        "object": "realtime.response",
        "status": r.status,
        "status_details": _status_details(r),
        "output": [item_to_wire(i, output_format=r.output_format) for i in r.output],
        "conversation_id": r.conversation_id,
        "output_modalities": list(r.output_modalities),
        "max_output_tokens": r.max_output_tokens,
        "audio": {"output": {"format": audio_format(r.output_format), "voice": r.voice}},
        "usage": usage_to_wire(r.usage) if r.usage is not None else None,
        "metadata": r.metadata,
    }


#: An error's param quotes what the client sent (a field name); past this length it is elided in
#: the middle, as a message is past :data:`~..redact.MAX_ERROR_MESSAGE`, so that the error always
#: fits a frame and stays the error it is (not a bare ``server_error`` for a frame too large).
MAX_ERROR_PARAM = 256
#: Longest client ``event_id`` echoed in an error (6 bytes a character at worst, once escaped); a
#: longer one is left out (null), and the message says so.
MAX_ECHOED_EVENT_ID = 64 * 1024


def error_event(
    event_id: str,
    code: str,
    message: str,
    *,
    param: str | None = None,
    client_event_id: str | None = None,
    type: str = "invalid_request_error",
) -> dict[str, Any]:
    message = public_message(message)
    if client_event_id is not None and len(client_event_id) > MAX_ECHOED_EVENT_ID:
        message += f" (The event's event_id, of {len(client_event_id)} characters, is too long to echo.)"
        client_event_id = None
    return {
        "type": "error",
        "event_id": event_id,
        "error": {
            "type": type,
            "code": code,
            "message": message,
            "param": None if param is None else elide(param, MAX_ERROR_PARAM),
            "event_id": client_event_id,
        },
    }


class Serializer:
    """Turns session events into server event dicts, knowing the session's formats."""

    def __init__(self, new_id: Callable[[str], str], config: Callable[[], SessionConfig]) -> None:
        self._new_id = new_id
        self._config = config

    def __call__(self, event: ev.SessionEvent) -> dict[str, Any]:
        body = _body(event, self._config())
        return {"type": body.pop("type"), "event_id": self._new_id("event"), **body}


def dumps(event: dict[str, Any]) -> str:
    return json.dumps(event, separators=(",", ":"), ensure_ascii=False)


def _ref(ref: ev.PartRef) -> dict[str, Any]:
    return {
        "response_id": ref.response_id,
        "item_id": ref.item_id,
        "output_index": ref.output_index,
        "content_index": ref.content_index,
    }


@singledispatch
def _body(event: object, c: SessionConfig) -> dict[str, Any]:
    raise TypeError(f"no wire form for {type(event).__name__}")


#: Events whose fields go on the wire as they are, by name and in order, under their type.
_FLAT: dict[type, str] = {
    ev.SessionClosed: "session.closed",
    ev.InputAudioCleared: "input_audio_buffer.cleared",
    ev.SpeechStarted: "input_audio_buffer.speech_started",
    ev.SpeechStopped: "input_audio_buffer.speech_stopped",
    ev.TimeoutTriggered: "input_audio_buffer.timeout_triggered",
    ev.PlaybackAcknowledged: "playback.acknowledged",
    ev.ItemDeleted: "conversation.item.deleted",
    ev.ItemTruncated: "conversation.item.truncated",
    ev.FunctionCallArgumentsDelta: "response.function_call_arguments.delta",
    ev.FunctionCallArgumentsDone: "response.function_call_arguments.done",
}

#: Wire types of the events that come in pairs of one shape (added / done).
_PAIRED: dict[type, str] = {
    ev.SessionCreated: "session.created",
    ev.SessionUpdated: "session.updated",
    ev.ItemAdded: "conversation.item.added",
    ev.ItemDone: "conversation.item.done",
    ev.ResponseCreated: "response.created",
    ev.ResponseDone: "response.done",
    ev.OutputItemAdded: "response.output_item.added",
    ev.OutputItemDone: "response.output_item.done",
}


def _flat(e: Any, c: SessionConfig) -> dict[str, Any]:
    return {"type": _FLAT[type(e)], **vars(e)}


for _cls in _FLAT:
    _body.register(_cls, _flat)


@_body.register
def _(e: ev.SessionCreated | ev.SessionUpdated, c: SessionConfig) -> dict[str, Any]:
    return {"type": _PAIRED[type(e)], "session": session_to_wire(e.session_id, e.config)}


@_body.register
def _(e: ev.ErrorReported, c: SessionConfig) -> dict[str, Any]:
    body = error_event("", e.code, e.message, param=e.param, type=e.type)
    del body["event_id"]
    return body


@_body.register
def _(e: ev.InputAudioCommitted, c: SessionConfig) -> dict[str, Any]:
    return {
        "type": "input_audio_buffer.committed",
        "previous_item_id": e.previous_item_id,
        "item_id": e.item_id,
    }


def _item(item: Any, c: SessionConfig, with_audio: bool = False) -> dict[str, Any]:
    return item_to_wire(
        item, input_format=c.input_format, output_format=c.output_format, with_audio=with_audio
    )


@_body.register
def _(e: ev.ItemAdded | ev.ItemDone, c: SessionConfig) -> dict[str, Any]:
    return {"type": _PAIRED[type(e)], "previous_item_id": e.previous_item_id, "item": _item(e.item, c)}


@_body.register
def _(e: ev.ItemRetrieved, c: SessionConfig) -> dict[str, Any]:
    return {"type": "conversation.item.retrieved", "item": _item(e.item, c, with_audio=True)}


@_body.register
def _(e: ev.ResponseCreated | ev.ResponseDone, c: SessionConfig) -> dict[str, Any]:
    return {"type": _PAIRED[type(e)], "response": response_to_wire(e.response)}


@_body.register
def _(e: ev.OutputItemAdded | ev.OutputItemDone, c: SessionConfig) -> dict[str, Any]:
    return {
        "type": _PAIRED[type(e)],
        "response_id": e.response_id,
        "output_index": e.output_index,
        "item": _item(e.item, c),
    }


@_body.register
def _(e: ev.ContentPartAdded, c: SessionConfig) -> dict[str, Any]:
    part = {"type": "audio", "transcript": ""} if e.kind == "audio" else {"type": "text", "text": ""}
    return {"type": "response.content_part.added", **_ref(e.ref), "part": part}


@_body.register
def _(e: ev.ContentPartDone, c: SessionConfig) -> dict[str, Any]:
    part = {"type": "audio", "transcript": e.text} if e.kind == "audio" else {"type": "text", "text": e.text}
    return {"type": "response.content_part.done", **_ref(e.ref), "part": part}


@_body.register
def _(e: ev.OutputAudioDelta, c: SessionConfig) -> dict[str, Any]:
    return {"type": "response.output_audio.delta", **_ref(e.ref), "delta": b64encode(e.audio)}


@_body.register
def _(e: ev.OutputAudioDone, c: SessionConfig) -> dict[str, Any]:
    return {"type": "response.output_audio.done", **_ref(e.ref)}


@_body.register
def _(e: ev.OutputTextDelta, c: SessionConfig) -> dict[str, Any]:
    kind = "response.output_audio_transcript.delta" if e.transcript else "response.output_text.delta"
    return {"type": kind, **_ref(e.ref), "delta": e.delta}


@_body.register
def _(e: ev.OutputTextDone, c: SessionConfig) -> dict[str, Any]:
    if e.transcript:
        return {"type": "response.output_audio_transcript.done", **_ref(e.ref), "transcript": e.text}
    return {"type": "response.output_text.done", **_ref(e.ref), "text": e.text}


def transcription_usage_to_wire(u: Usage) -> dict[str, Any]:
    """``usage`` of ``input_audio_transcription.completed`` (the SDK's token-billed shape)."""
    return {
        "type": "tokens",
        "input_tokens": u.input_tokens,
        "output_tokens": u.output_text_tokens,
        "total_tokens": u.input_tokens + u.output_text_tokens,
        "input_token_details": {"text_tokens": u.input_text_tokens, "audio_tokens": u.input_audio_tokens},
    }


@_body.register
def _(e: ev.InputTranscriptionDelta, c: SessionConfig) -> dict[str, Any]:
    return {
        "type": "conversation.item.input_audio_transcription.delta",
        "item_id": e.item_id,
        "content_index": e.content_index,
        "delta": e.delta,
    }


@_body.register
def _(e: ev.InputTranscriptionCompleted, c: SessionConfig) -> dict[str, Any]:
    return {
        "type": "conversation.item.input_audio_transcription.completed",
        "item_id": e.item_id,
        "content_index": e.content_index,
        "transcript": e.transcript,
        "usage": transcription_usage_to_wire(e.usage),
    }


@_body.register
def _(e: ev.InputTranscriptionFailed, c: SessionConfig) -> dict[str, Any]:
    error = e.error
    return {
        "type": "conversation.item.input_audio_transcription.failed",
        "item_id": e.item_id,
        "content_index": e.content_index,
        "error": {
            "type": error.type,
            "code": error.code,
            "message": public_message(error.message),
            "param": None,
        },
    }
