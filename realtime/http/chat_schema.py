"""The ``POST /v1/chat/completions`` request body, validated with pydantic.

Shapes follow ``openai.types.chat.completion_create_params``. Fields this server does not use
(``user``, ``metadata``, ``store``, penalties, ...) are accepted and ignored; fields whose
meaning it cannot honour are refused with a 400 in :mod:`.chat_input` rather than ignored
silently (``n > 1``, audio output, logprobs, custom tools, the legacy ``functions``).

Types are strict (``"1"`` is not an integer) as in the OpenAI API. Every list of objects is a
discriminated union, and so is every other choice of objects (:func:`by_type`), which keeps
pydantic's error locations readable (see ``errors._param``).
"""

from __future__ import annotations

import functools
import operator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


def by_type(*models: type[BaseModel]) -> Any:
    """A union of ``models`` told apart by their ``type``, for a field that is not a list item:
    tagged with the class names, which error locations leave out (``errors._param``)."""
    tags = {m.model_fields["type"].annotation.__args__[0]: m.__name__ for m in models}  # type: ignore[union-attr]

    def tag(value: Any) -> str | None:
        kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        return tags.get(kind) if isinstance(kind, str) else None

    members = functools.reduce(operator.or_, (Annotated[m, Tag(m.__name__)] for m in models))
    expected = "one of " + ", ".join(f"'{t}'" for t in tags)
    return Annotated[
        members,
        Discriminator(
            tag, custom_error_type="invalid_union_member", custom_error_message=f"type must be {expected}"
        ),
    ]


# -- content parts --------------------------------------------------------------------------------


class TextContent(_Body):
    type: Literal["text"]
    text: str


class ImageURL(_Body):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImageContent(_Body):
    type: Literal["image_url"]
    image_url: ImageURL


class InputAudio(_Body):
    #: Base64 of the encoded audio.
    data: str
    #: ``wav``, ``mp3`` (the OpenAI formats), ``flac``, ``ogg``, or ``pcm16`` (raw 24 kHz mono s16le).
    format: str


class AudioContent(_Body):
    type: Literal["input_audio"]
    input_audio: InputAudio


class FileContent(_Body):
    type: Literal["file"]
    file: dict[str, Any]


class RefusalContent(_Body):
    type: Literal["refusal"]
    refusal: str


UserContentPart = Annotated[
    TextContent | ImageContent | AudioContent | FileContent, Field(discriminator="type")
]
AssistantContentPart = Annotated[TextContent | RefusalContent, Field(discriminator="type")]


# -- messages -------------------------------------------------------------------------------------


class SystemMessage(_Body):
    role: Literal["system"]
    content: str | list[Annotated[TextContent, Field(discriminator="type")]]
    name: str | None = None


class DeveloperMessage(_Body):
    role: Literal["developer"]
    content: str | list[Annotated[TextContent, Field(discriminator="type")]]
    name: str | None = None


class UserMessage(_Body):
    role: Literal["user"]
    content: str | list[UserContentPart]
    name: str | None = None


class CalledFunction(_Body):
    name: str
    #: The arguments as the model wrote them (a JSON object, as text).
    arguments: str


class FunctionToolCall(_Body):
    id: str
    type: Literal["function"]
    function: CalledFunction


class CustomToolCall(_Body):
    """A call of a custom (free-form) tool: refused, as custom tools are."""

    id: str
    type: Literal["custom"]
    custom: dict[str, Any]


ToolCallEntry = Annotated[FunctionToolCall | CustomToolCall, Field(discriminator="type")]


class AssistantMessage(_Body):
    role: Literal["assistant"]
    content: str | list[AssistantContentPart] | None = None
    refusal: str | None = None
    #: Earlier tool calls, kept in the context as calls.
    tool_calls: list[ToolCallEntry] | None = None
    #: A reference to earlier audio output; this server cannot resolve one.
    audio: dict[str, Any] | None = None
    name: str | None = None


class ToolMessage(_Body):
    role: Literal["tool"]
    content: str | list[Annotated[TextContent, Field(discriminator="type")]]
    tool_call_id: str


Message = Annotated[
    SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage,
    Field(discriminator="role"),
]


# -- the request ----------------------------------------------------------------------------------


class StreamOptions(_Body):
    include_usage: bool | None = None


# -- tools and response formats -------------------------------------------------------------------


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    #: JSON Schema of the arguments object (checked in :mod:`.chat_tools`).
    parameters: dict[str, Any] | None = None
    #: Accepted; forced calls are always decoded against the schema (``tool_choice``).
    strict: bool | None = None


class FunctionTool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class CustomTool(_Body):
    """A free-form tool: refused (only function tools are served)."""

    type: Literal["custom"]
    custom: dict[str, Any]


Tool = Annotated[FunctionTool | CustomTool, Field(discriminator="type")]


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class AllowedFunction(_Body):
    type: Literal["function"]
    function: FunctionName


class AllowedTools(_Body):
    mode: Literal["auto", "required"]
    tools: list[Annotated[AllowedFunction, Field(discriminator="type")]]


class AllowedToolsChoice(_Body):
    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


class CustomToolChoice(_Body):
    """Naming a custom tool: refused, as custom tools are."""

    type: Literal["custom"]
    custom: dict[str, Any]


ToolChoice = Literal["none", "auto", "required"] | by_type(
    NamedToolChoice, AllowedToolsChoice, CustomToolChoice
)


class TextResponseFormat(_Body):
    type: Literal["text"]


class JsonObjectResponseFormat(_Body):
    type: Literal["json_object"]


class JsonSchemaSpec(_Body):
    name: str
    description: str | None = None
    #: The schema (absent: any JSON value); named ``schema`` on the wire.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    #: Accepted; the reply is always decoded against the schema.
    strict: bool | None = None


class JsonSchemaResponseFormat(_Body):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = by_type(TextResponseFormat, JsonObjectResponseFormat, JsonSchemaResponseFormat)


class ChatCompletionRequest(_Body):
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = Field(default=None)
    n: int | None = Field(default=None, ge=1)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    #: Legacy function calling (before ``tools``): refused with a pointer to ``tools``.
    functions: list[Any] | None = None
    function_call: Any = None

    @property
    def output_token_limit(self) -> int | None:
        """``max_completion_tokens`` (current name) or the deprecated ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
