"""Applying validated client events to a session."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from omnirt.sessions.errors import ErrorCode
from omnirt.sessions.response import ResponseOptions
from omnirt.sessions.session import RealtimeSession

from . import models as m
from .client_events import parse_session_patch, refuse_mcp
from .errors import ProtocolError
from .items import audio_bytes, item_from_wire, response_input_from_wire


@dataclass(frozen=True)
class Limits:
    #: Largest decoded ``input_audio_buffer.append`` payload.
    max_append_bytes: int


class CloseRequested(Exception):
    """The client sent ``session.close``."""


def decode_payload(event: m.ClientEvent, limits: Limits) -> bytes | None:
    """The binary payload of an event (``input_audio_buffer.append``), checked against the limits.

    Pure and thread-safe, so large frames can be decoded off the event loop."""
    if not isinstance(event, m.AudioAppend):
        return None
    # base64 is 4 chars per 3 bytes: refuse oversized payloads before decoding them.
    if len(event.audio) // 4 * 3 > limits.max_append_bytes + 3:
        raise ProtocolError(
            ErrorCode.INVALID_VALUE,
            f"Audio payload is over this server's limit of {limits.max_append_bytes} bytes per append.",
            "audio",
        )
    data = audio_bytes(event.audio, "audio")
    if len(data) > limits.max_append_bytes:
        raise ProtocolError(
            ErrorCode.INVALID_VALUE,
            f"Audio payload of {len(data)} bytes is over this server's limit of "
            f"{limits.max_append_bytes} bytes per append.",
            "audio",
        )
    return data


def apply(
    event: m.ClientEvent,
    session: RealtimeSession,
    new_id: Callable[[str], str],
    payload: bytes | None,
) -> None:
    """Run one client event; raises ``SessionError``/``ProtocolError`` (session unchanged) or
    :class:`CloseRequested`. ``payload`` is :func:`decode_payload`'s result for the event."""
    cfg = session.config
    if isinstance(event, m.AudioAppend):
        assert payload is not None, "decode_payload() the event first"
        session.append_audio(payload)
    elif isinstance(event, m.AudioCommit):
        session.commit_audio()
    elif isinstance(event, m.AudioClear):
        session.clear_audio()
    elif isinstance(event, m.SessionUpdate):
        session.update(parse_session_patch(event.session))
    elif isinstance(event, m.ItemCreate):
        item = item_from_wire(
            event.item, new_id=new_id, input_format=cfg.input_format, output_format=cfg.output_format
        )
        session.create_item(item, event.previous_item_id)
    elif isinstance(event, m.ItemRetrieve):
        session.retrieve_item(event.item_id)
    elif isinstance(event, m.ItemDelete):
        session.delete_item(event.item_id)
    elif isinstance(event, m.ItemTruncate):
        session.truncate_item(event.item_id, event.content_index, event.audio_end_ms)
    elif isinstance(event, m.ResponseCreate):
        session.create_response(response_options(event.response, session, new_id))
    elif isinstance(event, m.ResponseCancel):
        session.cancel_response(event.response_id)
    elif isinstance(event, m.PlaybackAck):
        session.ack_playback(event.response_id, event.item_id, event.played_ms)
    elif isinstance(event, m.SessionClose):
        raise CloseRequested
    else:  # pragma: no cover - EVENT_MODELS and this function list the same events
        raise ProtocolError(ErrorCode.INVALID_EVENT, f"Unhandled event type '{event.type}'.")  # type: ignore[attr-defined]


def response_options(
    params: m.ResponseParams | None, session: RealtimeSession, new_id: Callable[[str], str]
) -> ResponseOptions:
    if params is None:
        return ResponseOptions()
    conversation = params.conversation or "auto"
    if conversation not in ("auto", "none"):
        raise ProtocolError(
            ErrorCode.INVALID_VALUE,
            f"response.conversation must be 'auto' or 'none' (got '{conversation}').",
            "response.conversation",
        )
    refuse_mcp(params.tools, params.tool_choice, "response")
    cfg = session.config
    output = params.audio.output if params.audio and params.audio.output else None
    output_format = output.format.type if output and output.format and output.format.type else None
    replacement = None
    if params.input is not None:
        replacement = response_input_from_wire(
            params.input, new_id=new_id, input_format=cfg.input_format, output_format=cfg.output_format
        )
    return ResponseOptions(
        instructions=params.instructions,
        output_modalities=list(params.output_modalities) if params.output_modalities else None,
        max_output_tokens=params.max_output_tokens,
        conversation=conversation,  # type: ignore[arg-type]
        input=replacement,
        metadata=params.metadata,
        voice=output.voice if output else None,
        output_format=output_format,
        tools=None if params.tools is None else [t.model_dump(exclude_unset=True) for t in params.tools],
        tool_choice=(
            params.tool_choice.model_dump()
            if isinstance(params.tool_choice, m.ToolChoiceFunction)
            else params.tool_choice
        ),
    )
