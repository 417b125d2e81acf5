"""The typed boundary between ``sessions/`` (and the HTTP handlers) and ``stages/``.

Sessions build a :class:`GenerationRequest` from their conversation and read back a stream of
:class:`TextDelta`, :class:`AudioDelta` and one final :class:`Finished`. Nothing here knows about
WebSockets or about model internals.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

Role = Literal["system", "user", "assistant", "tool"]

#: Sample rate of every PCM array that crosses this boundary.
SAMPLE_RATE = 24_000


@dataclass(frozen=True)
class TextPart:
    text: str


@dataclass(frozen=True)
class AudioPart:
    """Mono float32 PCM in [-1, 1] at :data:`SAMPLE_RATE`."""

    pcm: np.ndarray


@dataclass(frozen=True)
class ImagePart:
    """An encoded image (PNG, JPEG, ...) exactly as the client sent it."""

    data: bytes


@dataclass(frozen=True)
class ToolCallPart:
    """A function call the assistant made (in an ``assistant`` message)."""

    call_id: str
    name: str
    #: The arguments as the model wrote them: a JSON object, as text.
    arguments: str


@dataclass(frozen=True)
class ToolResultPart:
    """What a function returned (in a ``tool`` message), for the call ``call_id``."""

    call_id: str
    output: str


Part = TextPart | AudioPart | ImagePart | ToolCallPart | ToolResultPart


@dataclass(frozen=True)
class ToolSpec:
    """A function the model may call."""

    name: str
    description: str = ""
    #: JSON Schema of the arguments object.
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class NamedTool:
    """``tool_choice`` naming one function: the model must call it."""

    name: str


#: ``auto``: the model decides; ``none``: no calls (tools still shown to the model);
#: ``required``: at least one call, of any tool; :class:`NamedTool`: a call of that function.
#: ``required`` and :class:`NamedTool` are enforced by constrained decoding.
ToolChoice = Literal["auto", "none", "required"] | NamedTool


@dataclass(frozen=True)
class JsonSchemaFormat:
    """Structured output: the reply text is one JSON value valid against ``schema``
    (constrained decoding). ``{"type": "object"}`` is chat completions' ``json_object``."""

    schema: dict[str, Any]
    name: str = "response"


@dataclass(frozen=True)
class ContextMessage:
    role: Role
    parts: tuple[Part, ...]


@dataclass(frozen=True)
class Truncation:
    """Leave a prompt's oldest messages out when it does not fit, instead of refusing it (the
    Realtime API's session ``truncation``).

    The conversation is what follows the leading ``system`` message (the instructions; with the
    tools, the prompt's head, never dropped). It may hold ``budget`` tokens: the context less the
    head and the reply's room (its ``max_output_tokens``, at most a quarter of the context), or
    ``post_instructions`` when that is lower. Over it, messages are dropped from the oldest on
    until the rest holds at most ``retention_ratio`` of ``budget`` (so the next turns fit without
    dropping again, and reuse the cached prefix), and on past any answer (an assistant's reply, a
    tool's result): what is kept starts with a question; the last message is always kept. A
    prompt whose last message alone is over ``budget`` is refused, as without truncation."""

    retention_ratio: float = 1.0
    post_instructions: int | None = None


@dataclass
class GenerationRequest:
    request_id: str
    messages: list[ContextMessage]
    #: Produce speech (thinker -> talker -> code2wav) as well as text.
    output_audio: bool = True
    #: Output token budget of the thinker; ``None`` means the server's limit.
    max_output_tokens: int | None = None
    voice: str | None = None
    #: 0 means greedy decoding.
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    #: Functions the model may call (rendered into the prompt by the model's chat template).
    tools: list[ToolSpec] = field(default_factory=list)
    tool_choice: ToolChoice = "auto"
    #: Constrain the reply text to JSON valid against a schema (text output only).
    response_format: JsonSchemaFormat | None = None
    #: Nobody waits to hear it (input transcription): admitted after every waiting request that is
    #: not background, so it never delays a reply's start.
    background: bool = False
    #: Leave the oldest messages out of a prompt that does not fit (None: refuse it).
    truncation: Truncation | None = None
    #: ``time.monotonic()`` when the reply was asked for (the request made): its first audio is
    #: due ``first_audio_target`` after this, time spent waiting for a slot or behind a batch
    #: step included.
    asked_at: float = field(default_factory=time.monotonic)


@dataclass
class Usage:
    input_text_tokens: int = 0
    input_audio_tokens: int = 0
    input_image_tokens: int = 0
    output_text_tokens: int = 0
    #: Codec frames produced by the talker (one per 80 ms of audio).
    output_audio_tokens: int = 0
    #: Input tokens not read again: a prefix another request had read (counted in the above).
    cached_text_tokens: int = 0
    cached_audio_tokens: int = 0
    cached_image_tokens: int = 0

    @property
    def input_tokens(self) -> int:
        return self.input_text_tokens + self.input_audio_tokens + self.input_image_tokens

    @property
    def cached_tokens(self) -> int:
        return self.cached_text_tokens + self.cached_audio_tokens + self.cached_image_tokens

    @property
    def output_tokens(self) -> int:
        return self.output_text_tokens + self.output_audio_tokens


@dataclass(frozen=True)
class TextDelta:
    """New text of the reply (the transcript when audio is produced too)."""

    text: str
    tokens: int = 1


@dataclass(frozen=True)
class ToolCall:
    """A complete function call the model made, parsed out of its output (never in any
    :class:`TextDelta`). ``arguments`` is a JSON object as text; with ``tool_choice``
    ``required`` or a :class:`NamedTool` it is valid against the tool's schema."""

    name: str
    arguments: str
    #: Reply tokens the call took (its tags included), for running usage; not compared.
    tokens: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Started:
    """Sent once, when the prompt has been read (prefilled): the input side of the usage, and how
    many of the request's messages (after its leading ``system`` message, oldest first) its
    :class:`Truncation` left out."""

    usage: Usage
    dropped: int = 0


@dataclass(frozen=True)
class AudioDelta:
    """A chunk of reply audio, int16 PCM at :data:`SAMPLE_RATE`.

    ``text_chars`` is how many characters of the reply text had been spoken once this chunk
    ends: the alignment that lets a session cut the transcript to what the user heard.
    """

    pcm: np.ndarray
    text_chars: int
    frames: int = 1


FinishReason = Literal["stop", "length", "cancelled", "error"]

#: Why a request ended with ``reason == "error"``: the pipeline refused its input (the client's
#: fault), a model step failed, the engine queue was full, or the server is stopping.
ErrorCode = Literal["rejected", "internal", "overloaded", "shutdown"]


@dataclass(frozen=True)
class Finished:
    reason: FinishReason
    usage: Usage
    error: str | None = None
    code: ErrorCode | None = None


Output = Started | TextDelta | ToolCall | AudioDelta | Finished


@dataclass(frozen=True)
class ModelInfo:
    """What the loaded model is, for ``/v1/models``, logs and the UI."""

    id: str
    architecture: str
    random_weights: bool
    source: str
    voices: tuple[str, ...] = ()
    max_context_tokens: int = 4096
    #: ``none``, or how the model's weights are quantized (``int8``, ``fp8``: W8A8 linear layers).
    quantization: str = "none"
