"""Input audio transcription, by the served model itself.

With ``audio.input.transcription`` set, every user audio item the input buffer commits (a manual
commit, a server VAD turn, the VAD idle timeout) is transcribed: a text-only
:class:`~omnirt.stages.types.GenerationRequest` holding the item's audio and an ASR instruction
goes to the engine like any other request (it is batched with the replies) and runs beside the
response, never before it. Its text streams as
``conversation.item.input_audio_transcription.delta`` events, then ``.completed`` stores the
transcript on the item's ``input_audio`` part; a request that fails ends with ``.failed``.
Deleting the item or closing the session cancels it, and nothing of it is sent after that.

The transcript is for the client only: the model's context keeps the user's audio as the user's
turn (``context.build_messages`` never turns it into text).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from omnirt.stages.types import (
    SAMPLE_RATE,
    AudioPart,
    ContextMessage,
    Finished,
    GenerationRequest,
    TextDelta,
    TextPart,
    Usage,
)

from .events import (
    InputTranscriptionCompleted,
    InputTranscriptionDelta,
    InputTranscriptionFailed,
    SessionEvent,
    TranscriptionError,
)
from .items import InputAudio
from .streaming import OutputStream, Submitter

log = logging.getLogger(__name__)

#: The ASR instruction of the Qwen3-Omni model card ("Transcribe the <language> audio into
#: text."), and its form when the language is not given.
ASR_INSTRUCTION = "Transcribe the {language} audio into text."
ASR_INSTRUCTION_ANY_LANGUAGE = "Transcribe the audio into text."
#: How the client's ``prompt`` (vocabulary, names, style) is put to the model.
ASR_CONTEXT = "Context that may help with spelling and vocabulary (do not transcribe it): {prompt}"
#: And its ``keywords``.
ASR_KEYWORDS = "Words and names that may occur: {keywords}."

#: The languages Qwen3-Omni hears, by their ISO-639-1 code (OpenAI's ``language`` field).
LANGUAGES: Mapping[str, str] = {
    "ar": "Arabic",
    "de": "German",
    "en": "English",
    "es": "Spanish",
    "fr": "French",
    "id": "Indonesian",
    "it": "Italian",
    "ja": "Japanese",
    "ko": "Korean",
    "ms": "Malay",
    "nl": "Dutch",
    "pt": "Portuguese",
    "ru": "Russian",
    "tr": "Turkish",
    "ur": "Urdu",
    "vi": "Vietnamese",
    "yue": "Cantonese",
    "zh": "Chinese",
}

#: Output budget of a transcription: a floor, plus tokens per second of audio (fast speech is
#: about 4 words a second; CJK text takes a token per character or so).
BASE_TOKENS = 16
TOKENS_PER_SECOND = 10


@dataclass(frozen=True)
class TranscriptionSettings:
    """What ``audio.input.transcription`` asks for. ``model`` is accepted whatever it names: the
    served model transcribes."""

    model: str | None = None
    language: str | None = None
    prompt: str | None = None
    keywords: tuple[str, ...] = ()

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> TranscriptionSettings:
        """From the session's ``transcription`` object (blank strings count as absent)."""

        def text(name: str) -> str | None:
            value = config.get(name)
            return (value.strip() or None) if isinstance(value, str) else None

        keywords = tuple(k.strip() for k in config.get("keywords") or () if isinstance(k, str) and k.strip())
        return cls(text("model"), text("language"), text("prompt"), keywords)


def language_name(code: str) -> str:
    """``"en"`` / ``"en-US"`` -> ``"English"``; a code we do not know is used as given."""
    return LANGUAGES.get(code.lower().split("-")[0].split("_")[0], code)


def instruction(settings: TranscriptionSettings) -> str:
    """The text put after the audio in the transcription request (the one place it is written)."""
    if settings.language:
        text = ASR_INSTRUCTION.format(language=language_name(settings.language))
    else:
        text = ASR_INSTRUCTION_ANY_LANGUAGE
    if settings.prompt:
        text += "\n" + ASR_CONTEXT.format(prompt=settings.prompt)
    if settings.keywords:
        text += "\n" + ASR_KEYWORDS.format(keywords=", ".join(settings.keywords))
    return text


def token_budget(samples: int, cap: int) -> int:
    """Output tokens allowed for ``samples`` of 24 kHz audio, at most ``cap``."""
    return max(1, min(cap, BASE_TOKENS + math.ceil(samples / SAMPLE_RATE * TOKENS_PER_SECOND)))


def transcription_request(
    request_id: str, audio: np.ndarray, settings: TranscriptionSettings, *, max_tokens: int
) -> GenerationRequest:
    """A text-only, greedy request for the transcript of ``audio`` (float32, 24 kHz)."""
    parts = (AudioPart(np.asarray(audio, dtype=np.float32)), TextPart(instruction(settings)))
    return GenerationRequest(
        request_id=request_id,
        messages=[ContextMessage("user", parts)],
        output_audio=False,
        max_output_tokens=token_budget(len(audio), max_tokens),
        temperature=0.0,
        background=True,
    )


def _error(finished: Finished) -> TranscriptionError:
    message = finished.error or "transcription failed"
    if finished.code == "rejected":
        return TranscriptionError("transcription_error", "invalid_value", message)
    if finished.code == "overloaded":
        return TranscriptionError("transcription_error", "resource_exhausted", message)
    return TranscriptionError("transcription_error", "server_error", message)


class TranscriptionRun:
    """The transcription of one user audio part: its engine request and its events."""

    def __init__(
        self,
        item_id: str,
        content_index: int,
        part: InputAudio,
        request: GenerationRequest,
        *,
        client: Submitter,
        emit: Callable[[SessionEvent], None],
        on_done: Callable[[TranscriptionRun], None],
    ) -> None:
        self.item_id = item_id
        self.content_index = content_index
        self.part = part
        self.request = request
        self._client = client
        self._emit = emit
        self._on_done = on_done
        self._stream: OutputStream | None = None
        self._text = ""
        self.task: asyncio.Task[None] | None = None
        self.finished = False

    def start(self) -> None:
        if len(self.part.audio) == 0:  # nothing was said: nothing to ask the model
            self._finish(Finished("stop", Usage()))
            return
        try:
            self._stream = self._client.submit(self.request)
        except Exception as exc:  # the engine refused synchronously: the client still hears of it
            log.exception("transcription of %s could not be submitted", self.item_id)
            self._finish(Finished("error", Usage(), f"could not start the transcription: {exc}", "internal"))
            return
        self.task = asyncio.get_running_loop().create_task(
            self._pump(), name=f"transcription {self.item_id}"
        )

    def cancel(self) -> None:
        """Stop at once, silently: no event of this transcription follows."""
        if self.finished:
            return
        self.finished = True
        if self._stream is not None:
            self._stream.cancel()
        if self.task is not None:
            self.task.cancel()
        self._on_done(self)

    async def _pump(self) -> None:
        assert self._stream is not None
        try:
            async for output in self._stream:
                if self.finished:
                    return
                if isinstance(output, TextDelta) and output.text:
                    self._text += output.text
                    self._emit(InputTranscriptionDelta(self.item_id, self.content_index, output.text))
                elif isinstance(output, Finished):
                    self._finish(output)
        except Exception as exc:  # a bug here must still end the transcription for the client
            log.exception("transcription of %s failed", self.item_id)
            self._stream.cancel()
            self._finish(Finished("error", Usage(), f"internal error: {exc}", "internal"))

    def _finish(self, finished: Finished) -> None:
        if self.finished:
            return
        if finished.reason == "cancelled":  # cancelled by the engine side: ends silently
            self.cancel()
            return
        self.finished = True
        if finished.reason == "error":
            self._emit(InputTranscriptionFailed(self.item_id, self.content_index, _error(finished)))
        else:  # "stop", or "length": the transcript as far as its budget went
            self.part.transcript = self._text
            self._emit(
                InputTranscriptionCompleted(self.item_id, self.content_index, self._text, finished.usage)
            )
        self._on_done(self)
