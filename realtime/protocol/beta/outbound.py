"""GA server events to beta server events, on their way to a beta client.

Every beta event is built with exactly the fields of its type in the openai SDK's beta models
(``openai.types.beta.realtime``): session and response objects are rebuilt field by field, items'
assistant parts renamed, events renamed. GA events the beta protocol has no counterpart for are
dropped (``conversation.item.done``: beta announces an item once, with
``conversation.item.created``). Extensions (``session.closed``, ``playback.acknowledged``) are
sent as they are: a client only gets them when it asked.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .names import (
    BETA_MODELS,
    EVENT_TO_BETA,
    FORMAT_TO_BETA,
    PART_TO_BETA,
    modalities_to_beta,
    param_to_beta,
)

log = logging.getLogger(__name__)

#: GA server events with no beta counterpart.
DROPPED = frozenset(
    (
        "conversation.item.done",
        "input_audio_buffer.timeout_triggered",
        "conversation.item.input_audio_transcription.segment",
    )
)
#: The fields of the beta ``TurnDetection``; ``idle_timeout_ms`` (GA) is kept only when set.
_TURN_FIELDS = (
    "type",
    "threshold",
    "prefix_padding_ms",
    "silence_duration_ms",
    "create_response",
    "interrupt_response",
    "eagerness",
)


def server_event_to_beta(event: dict[str, Any]) -> dict[str, Any] | None:
    """The beta form of one GA server event; None when the beta protocol has none."""
    kind = event["type"]
    convert = _CONVERTERS.get(kind)
    if convert is not None:
        return convert(event)
    renamed = EVENT_TO_BETA.get(kind)
    if renamed is not None:
        return {**event, "type": renamed}
    if kind in DROPPED:
        log.debug("not sent to a beta client: %s", kind)
        return None
    return event


def session_to_beta(ga: dict[str, Any]) -> dict[str, Any]:
    audio = ga.get("audio") or {}
    audio_in = audio.get("input") or {}
    audio_out = audio.get("output") or {}
    beta: dict[str, Any] = {"id": ga.get("id")}
    if ga.get("model") in BETA_MODELS:
        beta["model"] = ga["model"]
    beta |= {
        "modalities": modalities_to_beta(ga.get("output_modalities") or []),
        "instructions": ga.get("instructions"),
        "voice": _voice(audio_out.get("voice")),
        "input_audio_format": _format(audio_in.get("format")),
        "output_audio_format": _format(audio_out.get("format")),
        "input_audio_transcription": audio_in.get("transcription"),
        "input_audio_noise_reduction": audio_in.get("noise_reduction"),
        "turn_detection": _turn_detection(audio_in.get("turn_detection")),
        "speed": audio_out.get("speed"),
        "tools": ga.get("tools"),
        "tool_choice": _tool_choice(ga.get("tool_choice")),
        "max_response_output_tokens": ga.get("max_output_tokens"),
        "tracing": ga.get("tracing"),
    }
    return beta


def response_to_beta(ga: dict[str, Any]) -> dict[str, Any]:
    audio_out = (ga.get("audio") or {}).get("output") or {}
    modalities = ga.get("output_modalities")
    return {
        "id": ga.get("id"),
        "object": ga.get("object"),
        "status": ga.get("status"),
        "status_details": ga.get("status_details"),
        "output": [item_to_beta(item) for item in ga.get("output") or []],
        "conversation_id": ga.get("conversation_id"),
        "modalities": modalities_to_beta(modalities) if modalities is not None else None,
        "max_output_tokens": ga.get("max_output_tokens"),
        "voice": _voice(audio_out.get("voice")),
        "output_audio_format": _format(audio_out.get("format")),
        "usage": _usage(ga.get("usage")),
        "metadata": ga.get("metadata"),
    }


def item_to_beta(item: dict[str, Any]) -> dict[str, Any]:
    content = item.get("content")
    if not content:
        return item
    return {**item, "content": [_part_to_beta(part) for part in content]}


def _part_to_beta(part: dict[str, Any]) -> dict[str, Any]:
    renamed = PART_TO_BETA.get(part.get("type"))  # type: ignore[arg-type]
    return {**part, "type": renamed} if renamed is not None else part


def _voice(voice: Any) -> Any:
    return voice.get("id") if isinstance(voice, dict) else voice


def _format(fmt: Any) -> str | None:
    if not isinstance(fmt, dict):
        return None
    return FORMAT_TO_BETA.get(fmt.get("type"))  # type: ignore[arg-type]


def _turn_detection(td: Any) -> Any:
    if not isinstance(td, dict):
        return td
    out = {k: td[k] for k in _TURN_FIELDS if k in td}
    if td.get("idle_timeout_ms") is not None:
        out["idle_timeout_ms"] = td["idle_timeout_ms"]
    return out


def _tool_choice(choice: Any) -> Any:
    """A GA ``{"type": "function", "name": ...}`` is the function's name in beta (a string)."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return choice["name"]
    return choice


def _usage(usage: Any) -> Any:
    if not isinstance(usage, dict):
        return usage
    inp = usage.get("input_token_details") or {}
    out = usage.get("output_token_details") or {}
    return {
        "total_tokens": usage.get("total_tokens"),
        "input_tokens": usage.get("input_tokens"),
        "output_tokens": usage.get("output_tokens"),
        "input_token_details": {
            "text_tokens": inp.get("text_tokens"),
            "audio_tokens": inp.get("audio_tokens"),
            "cached_tokens": inp.get("cached_tokens"),
        },
        "output_token_details": {
            "text_tokens": out.get("text_tokens"),
            "audio_tokens": out.get("audio_tokens"),
        },
    }


def _session_event(event: dict[str, Any]) -> dict[str, Any]:
    return {**event, "session": session_to_beta(event["session"])}


def _response_event(event: dict[str, Any]) -> dict[str, Any]:
    return {**event, "response": response_to_beta(event["response"])}


def _item_event(event: dict[str, Any]) -> dict[str, Any]:
    return {**event, "item": item_to_beta(event["item"])}


def _item_added(event: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "conversation.item.created",
        "event_id": event["event_id"],
        "previous_item_id": event.get("previous_item_id"),
        "item": item_to_beta(event["item"]),
    }


def _transcription_completed(event: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in event.items() if k != "languages"}


def _error(event: dict[str, Any]) -> dict[str, Any]:
    error = event["error"]
    param = error.get("param")
    if not param:
        return event
    beta = param_to_beta(param)
    if beta == param:
        return event
    message = error.get("message")
    if isinstance(message, str):
        message = message.replace(param, beta)
    return {**event, "error": {**error, "param": beta, "message": message}}


_CONVERTERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "session.created": _session_event,
    "session.updated": _session_event,
    "response.created": _response_event,
    "response.done": _response_event,
    "conversation.item.added": _item_added,
    "conversation.item.retrieved": _item_event,
    "response.output_item.added": _item_event,
    "response.output_item.done": _item_event,
    "conversation.item.input_audio_transcription.completed": _transcription_completed,
    "error": _error,
}
