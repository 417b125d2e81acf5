"""A response: what the client asked for (options) and what it became (status, output, usage)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from omnirt.codecs.audio import FormatType
from omnirt.stages.types import Usage

from .config import Modality
from .items import Item

ResponseStatus = Literal["in_progress", "completed", "cancelled", "incomplete", "failed"]
StatusReason = Literal["turn_detected", "client_cancelled", "max_output_tokens"]


@dataclass
class ResponseOptions:
    """Per-response overrides of ``response.create``; ``None`` keeps the session's value."""

    instructions: str | None = None
    output_modalities: list[Modality] | None = None
    max_output_tokens: int | Literal["inf"] | None = None
    #: ``"none"``: an out-of-band response that writes nothing to the conversation.
    conversation: Literal["auto", "none"] = "auto"
    #: Replaces the conversation as context: items, or ids (str) of conversation items.
    input: list[Item | str] | None = None
    metadata: dict[str, str] | None = None
    voice: str | None = None
    output_format: FormatType | None = None
    #: Function tools for this response only (wire shape, as ``SessionConfig.tools``).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


@dataclass
class ResponseError:
    type: str
    code: str
    message: str


@dataclass
class Response:
    id: str
    #: ``None`` for out-of-band responses.
    conversation_id: str | None
    output_modalities: list[Modality]
    max_output_tokens: int | Literal["inf"]
    voice: str
    output_format: FormatType
    metadata: dict[str, str] | None = None
    status: ResponseStatus = "in_progress"
    reason: StatusReason | None = None
    error: ResponseError | None = None
    output: list[Item] = field(default_factory=list)
    usage: Usage | None = None

    @property
    def wants_audio(self) -> bool:
        return "audio" in self.output_modalities
