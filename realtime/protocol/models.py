"""Pydantic models of what clients send: the GA shapes, strict (unknown fields are refused)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from omnirt.codecs.audio import FormatType
from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag

#: Largest text accepted in one field (instructions, a text part): keeps echoed events < 1 MiB.
MAX_TEXT_CHARS = 256 * 1024
#: Client-chosen item ids may be up to this long.
MAX_ITEM_ID = 32
#: Function names (OpenAI's rule: 1-64 letters, digits, ``_`` and ``-``; checked in full by the
#: session), voice names, call ids and other short identifiers.
MAX_NAME = 64
MAX_CALL_ID = 256
#: Function tools per session or response, content parts per message item, items in
#: ``response.input``.
MAX_TOOLS = 128
MAX_PARTS = 128
MAX_RESPONSE_INPUT = 1000
#: OpenAI's ``metadata`` bounds: 16 pairs, keys up to 64 and values up to 512 characters.
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512


def _whole_number(value: Any) -> Any:
    """A decimal with no fraction (``5.0``: what some clients' encoders write) as the integer."""
    return int(value) if type(value) is float and value.is_integer() else value


#: An integer field: strict (``true`` and ``"5"`` are refused, not coerced), except that a whole
#: number written as a decimal is taken.
Int = Annotated[int, BeforeValidator(_whole_number)]


class Strict(BaseModel):
    """Unknown fields are refused, and so is a value of the wrong JSON type (``invalid_type``):
    pydantic's lax mode would read ``true`` as 1, ``"100"`` as 100 and ``"no"`` as False."""

    model_config = ConfigDict(extra="forbid", strict=True)


class AudioFormat(Strict):
    type: FormatType | None = None
    #: Only 24 kHz (``integer_below_min_value`` / ``..._above_max_value`` otherwise, as OpenAI).
    rate: Int | None = Field(default=None, ge=24000, le=24000)


class NoiseReduction(Strict):
    type: Literal["near_field", "far_field"] | None = None


class ServerVad(Strict):
    """``turn_detection`` of type ``server_vad`` (the GA ``ServerVad`` shape)."""

    type: Literal["server_vad"]
    threshold: float | None = Field(default=None, ge=0.0, le=1.0)
    prefix_padding_ms: Int | None = Field(default=None, ge=0, le=10_000)
    silence_duration_ms: Int | None = Field(default=None, ge=0, le=10_000)
    create_response: bool | None = None
    interrupt_response: bool | None = None
    idle_timeout_ms: Int | None = Field(default=None, ge=100, le=3_600_000)


class SemanticVad(Strict):
    """``semantic_vad``: accepted and run as server VAD with an eagerness-dependent silence."""

    type: Literal["semantic_vad"]
    eagerness: Literal["low", "medium", "high", "auto"] | None = None
    create_response: bool | None = None
    interrupt_response: bool | None = None


_TURN_TAGS = {"server_vad": "ServerVad", "semantic_vad": "SemanticVad"}


def _turn_tag(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return _TURN_TAGS.get(kind) if isinstance(kind, str) else None


#: Tags are class names so that error paths read ``...turn_detection.threshold``.
TurnDetection = Annotated[
    Annotated[ServerVad, Tag("ServerVad")] | Annotated[SemanticVad, Tag("SemanticVad")],
    Discriminator(
        _turn_tag,
        custom_error_type="invalid_turn_detection",
        custom_error_message="type must be 'server_vad' or 'semantic_vad' (or turn_detection null)",
    ),
]


class Transcription(Strict):
    """``audio.input.transcription``: the served model transcribes, whatever ``model`` names;
    ``language``, ``prompt`` and ``keywords`` guide it; ``languages`` and ``delay`` are accepted
    and have no effect."""

    model: str | None = Field(default=None, max_length=256)
    language: str | None = Field(default=None, max_length=64)
    prompt: str | None = Field(default=None, max_length=MAX_TEXT_CHARS)
    keywords: list[Annotated[str, Field(max_length=256)]] | None = Field(default=None, max_length=256)
    languages: list[Annotated[str, Field(max_length=64)]] | None = Field(default=None, max_length=64)
    delay: Literal["minimal", "low", "medium", "high", "xhigh"] | None = None


class AudioInputPatch(Strict):
    format: AudioFormat | None = None
    transcription: Transcription | None = None
    noise_reduction: NoiseReduction | None = None
    turn_detection: TurnDetection | None = None


class VoiceId(Strict):
    id: str = Field(max_length=MAX_NAME)


class AudioOutputPatch(Strict):
    format: AudioFormat | None = None
    voice: Annotated[str, Field(max_length=MAX_NAME)] | VoiceId | None = None
    speed: float | None = Field(default=None, ge=0.25, le=1.5)


class AudioPatch(Strict):
    input: AudioInputPatch | None = None
    output: AudioOutputPatch | None = None


class FunctionTool(Strict):
    """A function the model may call (``RealtimeFunctionTool``); its name and schema are checked
    by the session (``sessions/tools.py``)."""

    type: Literal["function"] = "function"
    name: str = Field(max_length=MAX_NAME)
    description: str | None = Field(default=None, max_length=MAX_TEXT_CHARS)
    parameters: dict[str, Any] | None = None


class McpTool(BaseModel):
    """An MCP server as a tool: recognised only to be refused with ``unsupported`` (this server
    connects to no MCP server), so its fields are not checked."""

    model_config = ConfigDict(extra="allow")
    type: Literal["mcp"]


def _typed_tag(tags: dict[str, str], default: str | None) -> Any:
    def tag(value: Any) -> str | None:
        kind = value.get("type", default) if isinstance(value, dict) else getattr(value, "type", None)
        return tags.get(kind) if isinstance(kind, str) else None

    return tag


#: ``type`` defaults to ``function``, as in the SDK's ``RealtimeFunctionTool``.
Tool = Annotated[
    Annotated[FunctionTool, Tag("FunctionTool")] | Annotated[McpTool, Tag("McpTool")],
    Discriminator(
        _typed_tag({"function": "FunctionTool", "mcp": "McpTool"}, "function"),
        custom_error_type="invalid_tool",
        custom_error_message="type must be 'function'",
    ),
]


class ToolChoiceFunction(Strict):
    type: Literal["function"]
    name: str = Field(max_length=MAX_NAME)


class ToolChoiceMcp(BaseModel):
    """Refused with ``unsupported``, as :class:`McpTool`."""

    model_config = ConfigDict(extra="allow")
    type: Literal["mcp"]


ToolChoice = (
    Literal["auto", "none", "required"]
    | Annotated[
        Annotated[ToolChoiceFunction, Tag("ToolChoiceFunction")]
        | Annotated[ToolChoiceMcp, Tag("ToolChoiceMcp")],
        Discriminator(
            _typed_tag({"function": "ToolChoiceFunction", "mcp": "ToolChoiceMcp"}, None),
            custom_error_type="invalid_tool_choice",
            custom_error_message="expected 'auto', 'none', 'required' or {'type': 'function', 'name': ...}",
        ),
    ]
)


TokenLimit = Annotated[Int, Field(ge=1, le=4096)] | Literal["inf"]


class TruncationTokenLimits(Strict):
    #: The most tokens the conversation after the instructions (and tools) may hold.
    post_instructions: Int | None = Field(default=None, ge=1)


class RetentionRatioTruncation(Strict):
    type: Literal["retention_ratio"]
    #: The share of the conversation's room that a truncation keeps (0.0 - 1.0).
    retention_ratio: float = Field(ge=0.0, le=1.0)
    token_limits: TruncationTokenLimits | None = None


def _truncation_tag(value: Any) -> str | None:
    if isinstance(value, str):
        return "TruncationMode"
    return "RetentionRatioTruncation" if isinstance(value, dict | RetentionRatioTruncation) else None


#: ``auto``: leave the oldest messages out when the conversation does not fit; ``disabled``: a
#: response whose context does not fit fails; or a retention ratio (PROTOCOL.md).
Truncation = Annotated[
    Annotated[Literal["auto", "disabled"], Tag("TruncationMode")]
    | Annotated[RetentionRatioTruncation, Tag("RetentionRatioTruncation")],
    Discriminator(
        _truncation_tag,
        custom_error_type="invalid_truncation",
        custom_error_message=(
            "expected 'auto', 'disabled' or {'type': 'retention_ratio', 'retention_ratio': ...}"
        ),
    ),
]

#: Session fields accepted and ignored (they change nothing here).
IGNORED_SESSION_FIELDS = ("tracing", "prompt", "include", "reasoning", "parallel_tool_calls")
#: Beta-era session fields and where GA puts them (``None``: no GA equivalent).
BETA_SESSION_FIELDS: dict[str, str | None] = {
    "modalities": "session.output_modalities",
    "voice": "session.audio.output.voice",
    "input_audio_format": "session.audio.input.format",
    "output_audio_format": "session.audio.output.format",
    "input_audio_transcription": "session.audio.input.transcription",
    "input_audio_noise_reduction": "session.audio.input.noise_reduction",
    "turn_detection": "session.audio.input.turn_detection",
    "speed": "session.audio.output.speed",
    "max_response_output_tokens": "session.max_output_tokens",
    "temperature": None,
}


class SessionPatch(Strict):
    type: Literal["realtime"] | None = None
    #: The served model is fixed by the server; a requested name is accepted and not applied.
    model: str | None = Field(default=None, max_length=256)
    instructions: str | None = Field(default=None, max_length=MAX_TEXT_CHARS)
    output_modalities: list[Literal["audio", "text"]] | None = None
    audio: AudioPatch | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    max_output_tokens: TokenLimit | None = Field(default=None)
    tracing: Any = None
    prompt: Any = None
    include: Any = None
    truncation: Truncation | None = None
    reasoning: Any = None
    parallel_tool_calls: Any = None
    # Clients that echo the session object back send these; they are read-only.
    id: str | None = None
    object: Literal["realtime.session"] | None = None
    expires_at: Int | None = None


# -- items ------------------------------------------------------------------------------------
class InputTextPart(Strict):
    type: Literal["input_text"]
    text: str = Field(max_length=MAX_TEXT_CHARS)


class InputAudioPart(Strict):
    type: Literal["input_audio"]
    audio: str
    transcript: str | None = Field(default=None, max_length=MAX_TEXT_CHARS)


class InputImagePart(Strict):
    type: Literal["input_image"]
    image_url: str
    detail: Literal["auto", "low", "high"] = "auto"


class OutputTextPart(Strict):
    type: Literal["output_text"]
    text: str = Field(max_length=MAX_TEXT_CHARS)


class OutputAudioPart(Strict):
    type: Literal["output_audio"]
    audio: str | None = None
    transcript: str | None = Field(default=None, max_length=MAX_TEXT_CHARS)


PART_MODELS: dict[str, type[Strict]] = {
    "input_text": InputTextPart,
    "input_audio": InputAudioPart,
    "input_image": InputImagePart,
    "output_text": OutputTextPart,
    "output_audio": OutputAudioPart,
}

#: Which content part types each role may hold.
ROLE_PARTS: dict[str, tuple[str, ...]] = {
    "user": ("input_text", "input_audio", "input_image"),
    "assistant": ("output_text", "output_audio"),
    "system": ("input_text",),
}

ItemStatus = Literal["completed", "incomplete", "in_progress"]


class _ItemBase(Strict):
    id: str | None = Field(default=None, min_length=1, max_length=MAX_ITEM_ID)
    object: Literal["realtime.item"] | None = None
    status: ItemStatus | None = None


class MessageItem(_ItemBase):
    type: Literal["message"]
    role: Literal["user", "assistant", "system"]
    content: list[dict[str, Any]] = Field(max_length=MAX_PARTS)


class FunctionCallItem(_ItemBase):
    type: Literal["function_call"]
    name: str = Field(max_length=MAX_NAME)
    arguments: str = Field(max_length=MAX_TEXT_CHARS)
    call_id: str | None = Field(default=None, max_length=MAX_CALL_ID)


class FunctionCallOutputItem(_ItemBase):
    type: Literal["function_call_output"]
    call_id: str = Field(max_length=MAX_CALL_ID)
    output: str = Field(max_length=MAX_TEXT_CHARS)


class ItemReference(Strict):
    type: Literal["item_reference"]
    id: str


ITEM_MODELS: dict[str, type[Strict]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
}


# -- responses --------------------------------------------------------------------------------
class ResponseAudioOutput(Strict):
    format: AudioFormat | None = None
    voice: str | None = Field(default=None, max_length=MAX_NAME)


class ResponseAudio(Strict):
    output: ResponseAudioOutput | None = None


class ResponseParams(Strict):
    instructions: str | None = Field(default=None, max_length=MAX_TEXT_CHARS)
    output_modalities: list[Literal["audio", "text"]] | None = Field(default=None, min_length=1)
    max_output_tokens: TokenLimit | None = None
    conversation: str | None = Field(default=None, max_length=MAX_NAME)
    input: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_RESPONSE_INPUT)
    metadata: (
        dict[
            Annotated[str, Field(max_length=MAX_METADATA_KEY)],
            Annotated[str, Field(max_length=MAX_METADATA_VALUE)],
        ]
        | None
    ) = Field(default=None, max_length=16)
    audio: ResponseAudio | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    prompt: Any = None
    reasoning: Any = None
    parallel_tool_calls: Any = None


# -- client events ----------------------------------------------------------------------------
class ClientEvent(Strict):
    event_id: str | None = None


class SessionUpdate(ClientEvent):
    type: Literal["session.update"]
    session: dict[str, Any]


class AudioAppend(ClientEvent):
    type: Literal["input_audio_buffer.append"]
    audio: str


class AudioCommit(ClientEvent):
    type: Literal["input_audio_buffer.commit"]


class AudioClear(ClientEvent):
    type: Literal["input_audio_buffer.clear"]


class ItemCreate(ClientEvent):
    type: Literal["conversation.item.create"]
    item: dict[str, Any]
    previous_item_id: str | None = None


class ItemRetrieve(ClientEvent):
    type: Literal["conversation.item.retrieve"]
    item_id: str


class ItemDelete(ClientEvent):
    type: Literal["conversation.item.delete"]
    item_id: str


class ItemTruncate(ClientEvent):
    type: Literal["conversation.item.truncate"]
    item_id: str
    content_index: Int = Field(ge=0)
    audio_end_ms: Int = Field(ge=0)


class ResponseCreate(ClientEvent):
    type: Literal["response.create"]
    response: ResponseParams | None = None


class ResponseCancel(ClientEvent):
    type: Literal["response.cancel"]
    response_id: str | None = None


class SessionClose(ClientEvent):
    type: Literal["session.close"]


class PlaybackAck(ClientEvent):
    """Extension: how much of a reply's audio the user heard."""

    type: Literal["playback.ack"]
    response_id: str
    item_id: str
    played_ms: Int = Field(ge=0)


EVENT_MODELS: dict[str, type[ClientEvent]] = {
    m.model_fields["type"].annotation.__args__[0]: m  # type: ignore[union-attr]
    for m in (
        SessionUpdate,
        AudioAppend,
        AudioCommit,
        AudioClear,
        ItemCreate,
        ItemRetrieve,
        ItemDelete,
        ItemTruncate,
        ResponseCreate,
        ResponseCancel,
        SessionClose,
        PlaybackAck,
    )
}
