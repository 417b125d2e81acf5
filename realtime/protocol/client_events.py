"""Parsing client frames into validated events, and their payloads into session inputs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omnirt.sessions.errors import ErrorCode
from pydantic import BaseModel, ValidationError

from . import json_text
from .bounds import check_shape, is_text
from .errors import ProtocolError, from_validation
from .models import (
    BETA_SESSION_FIELDS,
    EVENT_MODELS,
    IGNORED_SESSION_FIELDS,
    AudioAppend,
    ClientEvent,
    McpTool,
    SessionPatch,
    ToolChoiceMcp,
)

APPEND = "input_audio_buffer.append"
_APPEND_FIELDS = frozenset(("type", "audio", "event_id"))
_construct_append = AudioAppend.model_construct
#: ``session.update`` fields accepted and not applied: the session's type, the (fixed) model, the
#: read-only ones a client echoing the session object sends back, and the ignored ones.
_DROPPED_SESSION_FIELDS = ("type", "model", "id", "object", "expires_at", *IGNORED_SESSION_FIELDS)


def event_id_of(raw: object) -> str | None:
    """The client's ``event_id``, to echo in an error; None when there is none, or it is not text
    (a lone surrogate: it could not be sent back)."""
    if isinstance(raw, dict) and isinstance(raw.get("event_id"), str) and is_text(raw["event_id"]):
        return raw["event_id"]
    return None


def parse_client_event(
    text: str | bytes,
    *,
    max_bytes: int,
    translate: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> ClientEvent:
    """One text frame to a validated event; raises :class:`ProtocolError` (with the client's
    ``event_id`` when it could be read).

    ``translate`` turns another protocol's event (the beta one) into its GA form before the
    validation; the audio appends, alike in both, skip it."""
    if len(text) > max_bytes:
        raise ProtocolError(
            ErrorCode.INVALID_EVENT,
            f"Client event of {len(text)} bytes is over this server's limit of {max_bytes} bytes.",
        )
    try:
        raw = json_text.loads(text)
    except json_text.InvalidJson as exc:
        raise ProtocolError(
            ErrorCode.INVALID_JSON, f"Invalid event: failed to parse JSON value ({exc})."
        ) from None
    if type(raw) is dict and raw.get("type") == APPEND:
        # The hot event (every audio chunk): when it is plainly valid, skip pydantic. Exactly what
        # AudioAppend.model_validate accepts from JSON: a str 'audio', an optional str or null
        # 'event_id', no other field; ASCII (so they hold no lone surrogate: check_shape's rule).
        # Anything else takes the validating path for its error.
        audio = raw.get("audio")
        event_id = raw.get("event_id")
        if (
            type(audio) is str
            and audio.isascii()
            and (event_id is None or (type(event_id) is str and event_id.isascii()))
            and _APPEND_FIELDS.issuperset(raw)
        ):
            return _construct_append(**raw)
    event_id = event_id_of(raw)
    if not isinstance(raw, dict):
        raise ProtocolError(ErrorCode.INVALID_EVENT, "An event must be a JSON object.")
    try:
        check_shape(raw)
    except ProtocolError as exc:
        exc.event_id = event_id
        raise
    kind = raw.get("type")
    if not isinstance(kind, str):
        if kind is None:
            raise ProtocolError(
                ErrorCode.MISSING_REQUIRED_PARAMETER,
                "Missing required parameter: 'type'.",
                "type",
                event_id=event_id,
            )
        raise ProtocolError(
            ErrorCode.INVALID_TYPE, "Invalid type for 'type': expected a string.", "type", event_id=event_id
        )
    model = EVENT_MODELS.get(kind)
    if model is None:
        raise ProtocolError(
            ErrorCode.INVALID_VALUE,
            f"Invalid value: '{kind}'. Supported values are: {', '.join(repr(k) for k in EVENT_MODELS)}.",
            "type",
            event_id=event_id,
        )
    if translate is not None:
        try:
            raw = translate(raw)
        except ProtocolError as exc:
            exc.event_id = event_id
            raise
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        err = from_validation(exc)
        err.event_id = event_id
        raise err from None


def validate(model: type[BaseModel], raw: Any, prefix: str) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise from_validation(exc, prefix) from None


def parse_session_patch(raw: dict[str, Any]) -> dict[str, Any]:
    """A ``session.update`` payload to the nested dict of fields the client set (nulls kept).

    Beta-only fields are refused with ``unknown_parameter`` naming their GA place; the fields in
    ``IGNORED_SESSION_FIELDS`` are accepted and dropped."""
    for name, ga in BETA_SESSION_FIELDS.items():
        if name in raw:
            where = f"; in the GA API it is '{ga}'" if ga else "; it has no GA equivalent"
            raise ProtocolError(
                ErrorCode.UNKNOWN_PARAMETER,
                f"Unknown parameter: 'session.{name}' (a beta-only field{where}; beta clients "
                "connect with the 'OpenAI-Beta: realtime=v1' header).",
                f"session.{name}",
            )
    patch = validate(SessionPatch, raw, "session")
    refuse_mcp(patch.tools, patch.tool_choice, "session")
    data = patch.model_dump(exclude_unset=True)
    for name in _DROPPED_SESSION_FIELDS:
        data.pop(name, None)
    return data


def refuse_mcp(tools: list[Any] | None, tool_choice: Any, where: str) -> None:
    """MCP tools (and a ``tool_choice`` naming one) get ``unsupported``: this server connects to no
    MCP server, and leaving them out silently would change what the model can do."""
    for i, tool in enumerate(tools or []):
        if isinstance(tool, McpTool):
            raise ProtocolError(
                ErrorCode.UNSUPPORTED,
                "MCP tools are not supported by this server (it connects to no MCP server); "
                "declare what the model may call as function tools.",
                f"{where}.tools.{i}.type",
            )
    if isinstance(tool_choice, ToolChoiceMcp):
        raise ProtocolError(
            ErrorCode.UNSUPPORTED,
            "MCP tools are not supported by this server; tool_choice may name a function tool.",
            f"{where}.tool_choice.type",
        )
