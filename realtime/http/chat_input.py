"""From a validated chat request to the engine's :class:`GenerationRequest`.

Checks what the schema cannot (features this server does not offer are refused with a 400
that says so, never ignored when ignoring would change the answer), and converts the
messages: text as is, ``developer`` as ``system``, images from ``data:`` URLs (nothing is
fetched), audio decoded and resampled to 24 kHz mono.
"""

from __future__ import annotations

import io

import numpy as np
import soundfile
from omnirt.codecs.audio import b64decode, pcm16_to_float, resample
from omnirt.stages.types import (
    SAMPLE_RATE,
    AudioPart,
    ContextMessage,
    GenerationRequest,
    ImagePart,
    Part,
    TextPart,
    ToolCallPart,
    ToolResultPart,
)

from .chat_schema import (
    AssistantMessage,
    AudioContent,
    ChatCompletionRequest,
    CustomToolCall,
    DeveloperMessage,
    FileContent,
    ImageContent,
    SystemMessage,
    TextContent,
    ToolMessage,
    UserMessage,
)
from .chat_tools import engine_format, engine_tools
from .errors import bad_request

#: Longest decoded input audio accepted in one part (checked before decoding).
MAX_INPUT_AUDIO_SECONDS = 600
#: At most this many stop sequences, as in the OpenAI API.
MAX_STOP_SEQUENCES = 4
#: Containers decoded with libsndfile; ``pcm16`` is raw 24 kHz mono s16le.
ENCODED_AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg")


def check_supported(req: ChatCompletionRequest) -> None:
    """400 for requests whose meaning this server cannot honour."""
    if req.n is not None and req.n != 1:
        raise bad_request("Only n=1 is supported: one choice per request.", param="n")
    if req.modalities is not None and "audio" in req.modalities:
        raise bad_request(
            'Audio output is not available on /v1/chat/completions here: use modalities ["text"], '
            "or the /v1/realtime WebSocket for spoken replies.",
            param="modalities",
        )
    if req.stream_options is not None and not req.stream:
        raise bad_request(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.", param="stream_options"
        )
    if req.logprobs:
        raise bad_request("logprobs are not supported by this server.", param="logprobs")
    if isinstance(req.stop, list) and len(req.stop) > MAX_STOP_SEQUENCES:
        raise bad_request(f"At most {MAX_STOP_SEQUENCES} stop sequences are allowed.", param="stop")


def generation_request(
    req: ChatCompletionRequest, request_id: str, *, max_output_tokens: int
) -> GenerationRequest:
    """The engine request for ``req`` (text output only). Decodes media: run it off the event loop."""
    limit = req.output_token_limit
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    tools, tool_choice = engine_tools(req)
    return GenerationRequest(
        request_id=request_id,
        messages=context_messages(req),
        output_audio=False,
        max_output_tokens=min(limit, max_output_tokens) if limit is not None else max_output_tokens,
        # Omitted sampling parameters take the OpenAI defaults.
        **sampling(req.temperature, req.top_p),
        seed=req.seed,
        stop=[s for s in stop if s],
        tools=tools,
        tool_choice=tool_choice,
        response_format=engine_format(req),
    )


def sampling(temperature: float | None, top_p: float | None) -> dict[str, float]:
    """The engine's ``temperature`` and ``top_p`` (in (0, 1]) for the request's: omitted, OpenAI's
    defaults (1, 1). ``top_p: 0``, which OpenAI takes, keeps the most likely token alone: greedy
    decoding, as ``temperature: 0``."""
    temperature = 1.0 if temperature is None else temperature
    top_p = 1.0 if top_p is None else top_p
    if top_p == 0:
        return {"temperature": 0.0, "top_p": 1.0}
    return {"temperature": temperature, "top_p": top_p}


def context_messages(req: ChatCompletionRequest) -> list[ContextMessage]:
    out: list[ContextMessage] = []
    calls: set[str] = set()  # ids of the tool calls so far
    for i, message in enumerate(req.messages):
        where = f"messages[{i}]"
        match message:
            case SystemMessage() | DeveloperMessage():
                out.append(ContextMessage("system", _text_parts(message.content)))
            case ToolMessage():
                if message.tool_call_id not in calls:
                    raise bad_request(
                        f"Invalid parameter: a 'tool' message must answer a tool call of an earlier "
                        f"assistant message; no call has the id '{message.tool_call_id}'.",
                        param=f"{where}.tool_call_id",
                    )
                content = message.content
                text = content if isinstance(content, str) else "".join(p.text for p in content)
                out.append(ContextMessage("tool", (ToolResultPart(message.tool_call_id, text),)))
            case UserMessage():
                out.append(ContextMessage("user", _user_parts(message, where)))
            case AssistantMessage():
                parts = _assistant_parts(message, where)
                calls.update(p.call_id for p in parts if isinstance(p, ToolCallPart))
                out.append(ContextMessage("assistant", parts))
    return out


def _text_parts(content: str | list[TextContent]) -> tuple[Part, ...]:
    if isinstance(content, str):
        return (TextPart(content),)
    return tuple(TextPart(p.text) for p in content)


def _user_parts(message: UserMessage, where: str) -> tuple[Part, ...]:
    if isinstance(message.content, str):
        return (TextPart(message.content),)
    parts: list[Part] = []
    for j, part in enumerate(message.content):
        here = f"{where}.content[{j}]"
        match part:
            case TextContent():
                parts.append(TextPart(part.text))
            case ImageContent():
                parts.append(ImagePart(decode_image_url(part.image_url.url, f"{here}.image_url.url")))
            case AudioContent():
                pcm = decode_audio(part.input_audio.data, part.input_audio.format, f"{here}.input_audio")
                parts.append(AudioPart(pcm))
            case FileContent():
                raise bad_request(
                    "File content parts are not supported by this server.", param=f"{here}.type"
                )
    return tuple(parts)


def _assistant_parts(message: AssistantMessage, where: str) -> tuple[Part, ...]:
    parts: list[Part] = []
    if isinstance(message.content, str):
        parts.append(TextPart(message.content))
    elif message.content is not None:
        for part in message.content:
            parts.append(TextPart(part.text if isinstance(part, TextContent) else part.refusal))
    if message.refusal:
        parts.append(TextPart(message.refusal))
    for j, call in enumerate(message.tool_calls or []):
        if isinstance(call, CustomToolCall):
            raise bad_request(
                "Custom tool calls are not supported by this server; only 'function' calls.",
                param=f"{where}.tool_calls[{j}].type",
            )
        parts.append(ToolCallPart(call.id, call.function.name, call.function.arguments))
    if message.audio is not None and not parts:
        raise bad_request(
            "Assistant audio references cannot be resolved (this server stores no earlier replies); "
            "send the reply's transcript as 'content' instead.",
            param=f"{where}.audio",
        )
    if not parts:
        raise bad_request(
            "Missing required parameter: an assistant message needs 'content' or 'tool_calls'.",
            param=f"{where}.content",
            code="missing_required_parameter",
        )
    return tuple(parts)


def _b64decode(data: str, param: str) -> bytes:
    try:
        return b64decode(data)
    except ValueError:
        raise bad_request("The data is not valid base64.", param=param) from None


def decode_image_url(url: str, param: str) -> bytes:
    """The bytes of a ``data:image/...;base64,`` URL. Remote URLs are refused: nothing is fetched."""
    if url.startswith(("http://", "https://")):
        raise bad_request(
            "This server does not fetch image URLs; send the image inline as a data URL "
            "(data:image/png;base64,...).",
            param=param,
        )
    if not url.startswith("data:"):
        raise bad_request("image_url.url must be a data URL (data:image/png;base64,...).", param=param)
    header, comma, payload = url[len("data:") :].partition(",")
    if not comma or not header.endswith(";base64") or not header.startswith("image/"):
        raise bad_request(
            "image_url.url must be a base64 image data URL (data:image/...;base64,...).", param=param
        )
    data = _b64decode(payload, param)
    if not data:
        raise bad_request("The image is empty.", param=param)
    return data


def decode_audio(data: str, fmt: str, param: str) -> np.ndarray:
    """Decode an ``input_audio`` part to float32 mono PCM at :data:`SAMPLE_RATE`."""
    fmt = fmt.lower()
    raw = _b64decode(data, f"{param}.data")
    if fmt == "pcm16":
        try:
            pcm = pcm16_to_float(raw)
        except ValueError:  # an odd byte count
            raise bad_request(
                "pcm16 audio must hold whole 16-bit samples (an even byte count).", param=f"{param}.data"
            ) from None
    elif fmt in ENCODED_AUDIO_FORMATS:
        pcm = _decode_container(raw, f"{param}.data")
    else:
        raise bad_request(
            f"Unsupported audio format '{fmt}'; use one of {', '.join(ENCODED_AUDIO_FORMATS)} or pcm16.",
            param=f"{param}.format",
        )
    if pcm.size == 0:
        raise bad_request("The audio is empty.", param=f"{param}.data")
    if pcm.size > MAX_INPUT_AUDIO_SECONDS * SAMPLE_RATE:
        raise bad_request(f"Audio is longer than {MAX_INPUT_AUDIO_SECONDS} s.", param=f"{param}.data")
    return pcm


def _decode_container(raw: bytes, param: str) -> np.ndarray:
    try:
        with soundfile.SoundFile(io.BytesIO(raw)) as f:
            if f.samplerate <= 0 or f.frames > MAX_INPUT_AUDIO_SECONDS * f.samplerate:
                raise bad_request(f"Audio is longer than {MAX_INPUT_AUDIO_SECONDS} s.", param=param)
            audio = f.read(dtype="float32", always_2d=True)
            rate = f.samplerate
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as exc:
        raise bad_request(f"The audio could not be decoded: {exc}.", param=param) from None
    mono = audio.mean(axis=1, dtype=np.float32)
    return resample(mono, rate, SAMPLE_RATE)
