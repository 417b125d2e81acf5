"""Conversation items between their wire shape and the session's own."""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable
from typing import Any

import numpy as np
from omnirt.codecs.audio import (
    SAMPLE_RATE,
    FormatType,
    b64decode,
    b64encode,
    decode_audio,
    encode_audio,
    float_to_int16,
    wire_rate,
)
from omnirt.sessions import items as s
from omnirt.sessions.errors import ErrorCode

from .client_events import validate
from .errors import ProtocolError
from .models import (
    ITEM_MODELS,
    PART_MODELS,
    ROLE_PARTS,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputAudioPart,
    InputImagePart,
    InputTextPart,
    ItemReference,
    MessageItem,
    OutputAudioPart,
    OutputTextPart,
)

#: Data URLs longer than this are not echoed back in item events (frames stay < 1 MiB).
MAX_ECHOED_URL = 256 * 1024
#: Audio is included in ``conversation.item.retrieved`` only while its base64 fits in this.
MAX_RETRIEVED_AUDIO_B64 = 768 * 1024
_DATA_URL = re.compile(r"^data:image/(png|jpeg|jpg|webp|gif);base64,(.*)$", re.DOTALL)


def audio_bytes(text: str, param: str) -> bytes:
    """Base64 audio from the client; ``invalid_value`` naming ``param`` when it is not valid."""
    try:
        return b64decode(text)
    except ValueError as exc:
        raise ProtocolError(ErrorCode.INVALID_VALUE, f"'{param}' is not valid base64: {exc}", param) from None


def _decode(data: bytes, fmt: FormatType, param: str) -> np.ndarray:
    try:
        return decode_audio(data, fmt)
    except ValueError as exc:
        raise ProtocolError(ErrorCode.INVALID_VALUE, f"'{param}': {exc}", param) from None


def item_from_wire(
    raw: dict[str, Any],
    *,
    new_id: Callable[[str], str],
    input_format: FormatType,
    output_format: FormatType,
    path: str = "item",
) -> s.Item:
    kind = raw.get("type")
    model = ITEM_MODELS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise ProtocolError(
            ErrorCode.INVALID_VALUE,
            f"Invalid item type {kind!r}; expected one of {', '.join(ITEM_MODELS)}.",
            f"{path}.type",
        )
    wire = validate(model, raw, path)
    item_id = wire.id or new_id("item")
    # A status "has no effect on the conversation" (OpenAI's GA types): an item a client adds is
    # whole. Only the server's own items are ever in progress (a reply still streaming), and
    # those are what the model's context leaves out; a client's copy of one (taken from
    # conversation.item.added, to restore a conversation) must not be left out with them.
    status = "incomplete" if wire.status == "incomplete" else "completed"
    if isinstance(wire, FunctionCallItem):
        return s.FunctionCallItem(item_id, wire.call_id or new_id("call"), wire.name, wire.arguments, status)
    if isinstance(wire, FunctionCallOutputItem):
        return s.FunctionCallOutputItem(item_id, wire.call_id, wire.output, status)
    assert isinstance(wire, MessageItem)
    content = [
        _part_from_wire(part, wire.role, input_format, output_format, f"{path}.content.{i}")
        for i, part in enumerate(wire.content)
    ]
    return s.MessageItem(item_id, wire.role, content, status)


def _part_from_wire(
    raw: dict[str, Any], role: str, input_format: FormatType, output_format: FormatType, path: str
) -> s.Content:
    kind = raw.get("type")
    if kind not in ROLE_PARTS[role]:
        raise ProtocolError(
            ErrorCode.INVALID_VALUE,
            f"Content type {kind!r} is not allowed in a {role} message "
            f"(expected one of {', '.join(ROLE_PARTS[role])}).",
            f"{path}.type",
        )
    part = validate(PART_MODELS[kind], raw, path)
    if isinstance(part, InputTextPart):
        return s.InputText(part.text)
    if isinstance(part, OutputTextPart):
        return s.OutputText(part.text)
    if isinstance(part, InputAudioPart):
        data = audio_bytes(part.audio, f"{path}.audio")
        return s.InputAudio(_decode(data, input_format, f"{path}.audio"), part.transcript)
    if isinstance(part, OutputAudioPart):
        out = s.OutputAudio(transcript=part.transcript or "")
        if part.audio:
            pcm = _decode(audio_bytes(part.audio, f"{path}.audio"), output_format, f"{path}.audio")
            out.append(float_to_int16(pcm), len(out.transcript))
        return out
    assert isinstance(part, InputImagePart)
    match = _DATA_URL.match(part.image_url)
    if match is None:
        raise ProtocolError(
            ErrorCode.INVALID_VALUE,
            "image_url must be a base64 data URL (data:image/png|jpeg|webp|gif;base64,...); "
            "this server fetches nothing.",
            f"{path}.image_url",
        )
    try:
        data = base64.b64decode(match.group(2), validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError(
            ErrorCode.INVALID_VALUE, "image_url holds invalid base64.", f"{path}.image_url"
        ) from None
    return s.InputImage(data, part.image_url, part.detail)


def response_input_from_wire(
    raw: list[dict[str, Any]],
    *,
    new_id: Callable[[str], str],
    input_format: FormatType,
    output_format: FormatType,
) -> list[s.Item | str]:
    """``response.input``: new items, or references (``item_reference``) to conversation items."""
    out: list[s.Item | str] = []
    for i, entry in enumerate(raw):
        path = f"response.input.{i}"
        if entry.get("type") == "item_reference":
            out.append(validate(ItemReference, entry, path).id)
        else:
            out.append(
                item_from_wire(
                    entry, new_id=new_id, input_format=input_format, output_format=output_format, path=path
                )
            )
    return out


# -- session -> wire ------------------------------------------------------------------------------
def item_to_wire(
    item: s.Item,
    *,
    input_format: FormatType = "audio/pcm",
    output_format: FormatType = "audio/pcm",
    with_audio: bool = False,
) -> dict[str, Any]:
    base: dict[str, Any] = {"id": item.id, "object": "realtime.item", "status": item.status}
    if isinstance(item, s.FunctionCallItem):
        return base | {
            "type": "function_call",
            "call_id": item.call_id,
            "name": item.name,
            "arguments": item.arguments,
        }
    if isinstance(item, s.FunctionCallOutputItem):
        return base | {"type": "function_call_output", "call_id": item.call_id, "output": item.output}
    content = [_part_to_wire(c, input_format, output_format, with_audio) for c in item.content]
    return base | {"type": "message", "role": item.role, "content": content}


def _part_to_wire(
    part: s.Content, input_format: FormatType, output_format: FormatType, with_audio: bool
) -> dict[str, Any]:
    if isinstance(part, s.InputText):
        return {"type": "input_text", "text": part.text}
    if isinstance(part, s.OutputText):
        return {"type": "output_text", "text": part.text}
    if isinstance(part, s.InputImage):
        out: dict[str, Any] = {"type": "input_image", "detail": part.detail}
        if len(part.url) <= MAX_ECHOED_URL:
            out["image_url"] = part.url
        return out
    if isinstance(part, s.InputAudio):
        out = {"type": "input_audio", "transcript": part.transcript}
        if with_audio and _may_fit(len(part.audio), input_format):
            _attach_audio(out, float_to_int16(part.audio), input_format)
        return out
    assert isinstance(part, s.OutputAudio)
    out = {"type": "output_audio", "transcript": part.transcript}
    if with_audio and _may_fit(len(part.audio), output_format):
        _attach_audio(out, part.audio, output_format)
    return out


def _may_fit(samples: int, fmt: FormatType) -> bool:
    """False when ``samples`` of 24 kHz audio are sure to encode over ``MAX_RETRIEVED_AUDIO_B64``
    (so they are not converted only to be dropped). The size is a lower bound: PCM16 is exact; the
    G.711 resampler gives about a third of the samples, less a margin to be safe."""
    if fmt == "audio/pcm":
        wire_bytes = samples * 2
    else:
        wire_bytes = max(0, samples * wire_rate(fmt) // SAMPLE_RATE - 64)
    return 4 * -(-wire_bytes // 3) <= MAX_RETRIEVED_AUDIO_B64


def _attach_audio(out: dict[str, Any], pcm: np.ndarray, fmt: FormatType) -> None:
    encoded = b64encode(encode_audio(pcm, fmt))
    if len(encoded) <= MAX_RETRIEVED_AUDIO_B64:
        out["audio"] = encoded
