"""The ``POST /v1/chat/completions`` request body, validated with pydantic.

Shapes follow ``openai.types.chat.completion_create_params``. Fields this server does not use
(``user``, ``metadata``, ``store``, penalties, ...) are accepted and ignored; fields whose
meaning it cannot honour are refused with a 400 in :mod:`.chat_input` rather than ignored
silently (``n > 1``, audio output, JSON response formats, logprobs, forced tool calls).

Types are strict (``"1"`` is not an integer) as in the OpenAI API. Every list of objects is a
discriminated union, which keeps pydantic's error locations readable (see ``errors._param``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


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


class AssistantMessage(_Body):
    role: Literal["assistant"]
    content: str | list[AssistantContentPart] | None = None
    refusal: str | None = None
    #: Earlier tool calls, kept in the context as their JSON text.
    tool_calls: list[dict[str, Any]] | None = None
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


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]


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
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    @property
    def output_token_limit(self) -> int | None:
        """``max_completion_tokens`` (current name) or the deprecated ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
