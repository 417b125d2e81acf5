"""Beta client events to GA client events, before the GA validation sees them.

Only the shapes change: every value is checked by the GA models afterwards (their errors name GA
paths; :func:`~.outbound.server_event_to_beta` renames them back). What only the beta shape can
get wrong (an audio format name, the temperature) is checked here, with the beta path. GA field
names on a beta connection pass through unchanged; ``null`` fields of items and turn detection
(clients that dump every field of the beta types send them) are left out, as the GA types
default them alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omnirt.sessions.errors import ErrorCode

from ..errors import ProtocolError
from .names import FORMAT_TO_GA, PART_TO_GA, TOOL_CHOICE_MODES, modalities_to_ga

#: Beta session fields that live under GA ``session.audio``: (side, GA name).
_SESSION_AUDIO: dict[str, tuple[str, str]] = {
    "input_audio_format": ("input", "format"),
    "input_audio_transcription": ("input", "transcription"),
    "input_audio_noise_reduction": ("input", "noise_reduction"),
    "turn_detection": ("input", "turn_detection"),
    "output_audio_format": ("output", "format"),
    "voice": ("output", "voice"),
    "speed": ("output", "speed"),
}
#: OpenAI's documented range for the beta ``temperature`` (the GA API has none; nor do we, so it
#: is checked and not applied).
TEMPERATURE_RANGE = (0.6, 1.2)


def client_event_to_ga(raw: dict[str, Any]) -> dict[str, Any]:
    """One beta client event (parsed JSON) as the GA event it stands for."""
    convert = _CONVERTERS.get(raw.get("type"))  # type: ignore[arg-type]
    return convert(raw) if convert is not None else raw


def session_to_ga(beta: dict[str, Any]) -> dict[str, Any]:
    """A beta ``session.update`` payload as a GA one."""
    out: dict[str, Any] = {}
    audio: dict[str, dict[str, Any]] = {}
    for name, value in beta.items():
        if name in _SESSION_AUDIO:
            side, field = _SESSION_AUDIO[name]
            if field == "format":
                value = _format(value, f"session.{name}")
            elif field == "turn_detection":
                value = _turn_detection(value)
            audio.setdefault(side, {})[field] = value
        elif name == "modalities":
            out["output_modalities"] = modalities_to_ga(value)
        elif name == "max_response_output_tokens":
            out["max_output_tokens"] = value
        elif name == "tool_choice":
            out["tool_choice"] = _tool_choice(value)
        elif name == "temperature":
            _check_temperature(value, "session.temperature")
        elif name == "client_secret":  # ephemeral-token options: nothing to apply on a live session
            continue
        else:
            out[name] = value
    if audio:
        out["audio"] = _merge_audio(out.get("audio"), audio)
    return out


def response_to_ga(beta: dict[str, Any]) -> dict[str, Any]:
    """A beta ``response.create`` ``response`` as a GA one."""
    out: dict[str, Any] = {}
    output: dict[str, Any] = {}
    for name, value in beta.items():
        if name == "modalities":
            out["output_modalities"] = modalities_to_ga(value)
        elif name == "max_response_output_tokens":
            out["max_output_tokens"] = value
        elif name == "voice":
            output["voice"] = value
        elif name == "output_audio_format":
            output["format"] = _format(value, "response.output_audio_format")
        elif name == "tool_choice":
            out["tool_choice"] = _tool_choice(value)
        elif name == "temperature":
            _check_temperature(value, "response.temperature")
        elif name == "input" and isinstance(value, list):
            out["input"] = [item_to_ga(entry) for entry in value]
        else:
            out[name] = value
    if output:
        out["audio"] = _merge_audio(out.get("audio"), {"output": output})
    return out


def item_to_ga(item: Any) -> Any:
    """A beta conversation item as a GA one: assistant ``text`` / ``audio`` parts become
    ``output_text`` / ``output_audio``; other roles' parts are named alike in both."""
    if not isinstance(item, dict):
        return item
    out = {k: v for k, v in item.items() if v is not None}
    content = out.get("content")
    if isinstance(content, list):
        assistant = out.get("role") == "assistant"
        out["content"] = [_part_to_ga(part, assistant) for part in content]
    return out


def _part_to_ga(part: Any, assistant: bool) -> Any:
    if not isinstance(part, dict):
        return part
    out = {k: v for k, v in part.items() if v is not None}
    if assistant and out.get("type") in PART_TO_GA:
        out["type"] = PART_TO_GA[out["type"]]
    return out


def _format(value: Any, param: str) -> Any:
    if value is None:
        return None
    if isinstance(value, str) and value in FORMAT_TO_GA:
        return dict(FORMAT_TO_GA[value])
    raise ProtocolError(
        ErrorCode.INVALID_VALUE,
        f"Invalid value for '{param}': expected one of {', '.join(map(repr, FORMAT_TO_GA))} (got {value!r}).",
        param,
    )


def _turn_detection(value: Any) -> Any:
    """The beta type merges both VAD kinds and lets ``type`` default to ``server_vad``."""
    if not isinstance(value, dict):
        return value
    out = {k: v for k, v in value.items() if v is not None}
    out.setdefault("type", "server_vad")
    return out


def _tool_choice(value: Any) -> Any:
    """Beta ``tool_choice`` is a string: a mode, or the name of the function to call."""
    if isinstance(value, str) and value and value not in TOOL_CHOICE_MODES:
        return {"type": "function", "name": value}
    return value


def _check_temperature(value: Any, param: str) -> None:
    low, high = TEMPERATURE_RANGE
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProtocolError(ErrorCode.INVALID_TYPE, f"Invalid type for '{param}': expected a number.", param)
    if not low <= value <= high:
        raise ProtocolError(
            ErrorCode.DECIMAL_BELOW_MIN if value < low else ErrorCode.DECIMAL_ABOVE_MAX,
            f"Invalid '{param}': expected a number from {low} to {high} (got {value!r}).",
            param,
        )


def _merge_audio(ga: Any, beta: dict[str, dict[str, Any]]) -> Any:
    """Beta fields over a GA ``audio`` object the client sent beside them (a client mixing both)."""
    if not isinstance(ga, dict):
        return beta if ga is None else ga  # a malformed GA object: the GA validation names it
    merged = dict(ga)
    for side, fields in beta.items():
        current = merged.get(side)
        merged[side] = {**current, **fields} if isinstance(current, dict) else fields
    return merged


def _session_update(raw: dict[str, Any]) -> dict[str, Any]:
    session = raw.get("session")
    return {**raw, "session": session_to_ga(session)} if isinstance(session, dict) else raw


def _response_create(raw: dict[str, Any]) -> dict[str, Any]:
    response = raw.get("response")
    return {**raw, "response": response_to_ga(response)} if isinstance(response, dict) else raw


def _item_create(raw: dict[str, Any]) -> dict[str, Any]:
    return {**raw, "item": item_to_ga(raw["item"])} if "item" in raw else raw


_CONVERTERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "session.update": _session_update,
    "response.create": _response_create,
    "conversation.item.create": _item_create,
}
