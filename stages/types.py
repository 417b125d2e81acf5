"""The typed boundary between ``sessions/`` (and the HTTP handlers) and ``stages/``.

Sessions build a :class:`GenerationRequest` from their conversation and read back a stream of
:class:`TextDelta`, :class:`AudioDelta` and one final :class:`Finished`. Nothing here knows about
WebSockets or about model internals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

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


Part = TextPart | AudioPart | ImagePart


@dataclass(frozen=True)
class ContextMessage:
    role: Role
    parts: tuple[Part, ...]


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


@dataclass
class Usage:
    input_text_tokens: int = 0
    input_audio_tokens: int = 0
    input_image_tokens: int = 0
    output_text_tokens: int = 0
    #: Codec frames produced by the talker (one per 80 ms of audio).
    output_audio_tokens: int = 0

    @property
    def input_tokens(self) -> int:
        return self.input_text_tokens + self.input_audio_tokens + self.input_image_tokens

    @property
    def output_tokens(self) -> int:
        return self.output_text_tokens + self.output_audio_tokens


@dataclass(frozen=True)
class TextDelta:
    """New text of the reply (the transcript when audio is produced too)."""

    text: str
    tokens: int = 1


@dataclass(frozen=True)
class Started:
    """Sent once, when the prompt has been read (prefilled): the input side of the usage."""

    usage: Usage


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


Output = Started | TextDelta | AudioDelta | Finished


@dataclass(frozen=True)
class ModelInfo:
    """What the loaded model is, for ``/v1/models``, logs and the UI."""

    id: str
    architecture: str
    random_weights: bool
    source: str
    voices: tuple[str, ...] = ()
    max_context_tokens: int = 4096
