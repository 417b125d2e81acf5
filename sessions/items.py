"""Conversation items and their content parts, as the session stores them.

Audio is held in the server's own representation (24 kHz mono): user audio as float32, reply
audio as int16 together with its text alignment, so a truncation can cut both consistently.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from omnirt.stages.types import SAMPLE_RATE

ItemStatus = Literal["completed", "incomplete", "in_progress"]
MessageRole = Literal["user", "assistant", "system"]


@dataclass
class InputText:
    text: str


@dataclass
class InputAudio:
    """User audio, float32 at 24 kHz."""

    audio: np.ndarray
    transcript: str | None = None


@dataclass
class InputImage:
    data: bytes
    #: The data URL the client sent (echoed back only when small).
    url: str
    detail: str = "auto"


@dataclass
class OutputText:
    text: str = ""


@dataclass
class OutputAudio:
    """Reply audio (int16, 24 kHz) and its transcript.

    ``marks`` holds ``(end_sample, text_chars)`` per engine chunk: how much of the transcript had
    been spoken when that much audio had played. ``frozen`` is set by a truncation: what comes
    later in the stream is still sent to the client but no longer stored.
    """

    chunks: list[np.ndarray] = field(default_factory=list)
    transcript: str = ""
    marks: list[tuple[int, int]] = field(default_factory=list)
    samples: int = 0
    frozen: bool = False

    def append(self, pcm: np.ndarray, text_chars: int) -> None:
        if self.frozen:
            return
        self.chunks.append(np.asarray(pcm, dtype=np.int16))
        self.samples += len(pcm)
        self.marks.append((self.samples, text_chars))

    @property
    def audio(self) -> np.ndarray:
        if len(self.chunks) != 1:
            self.chunks = [np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.int16)]
        return self.chunks[0]

    @property
    def duration_ms(self) -> int:
        return self.samples * 1000 // SAMPLE_RATE

    @property
    def end_ms(self) -> int:
        """The duration rounded up: the largest ``audio_end_ms`` a truncation may give. A client
        that measures what it received in fractional milliseconds and bounds its truncation by
        their ceiling (openai-agents does) names the end of the audio that way."""
        return -(-self.samples * 1000 // SAMPLE_RATE)

    def truncate(self, audio_end_ms: int) -> None:
        """Keep the first ``audio_end_ms`` of audio (all of it up to :attr:`end_ms`) and the
        transcript spoken by then."""
        end = min(audio_end_ms * SAMPLE_RATE // 1000, self.samples)
        chars = 0
        for mark_end, mark_chars in self.marks:
            if mark_end <= end:
                chars = mark_chars
        self.chunks = [self.audio[:end]]
        self.samples = end
        self.marks = [(e, c) for e, c in self.marks if e <= end]
        self.transcript = self.transcript[:chars]
        self.frozen = True


Content = InputText | InputAudio | InputImage | OutputText | OutputAudio


@dataclass
class MessageItem:
    id: str
    role: MessageRole
    content: list[Content]
    status: ItemStatus = "completed"


@dataclass
class FunctionCallItem:
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus = "completed"


@dataclass
class FunctionCallOutputItem:
    id: str
    call_id: str
    output: str
    status: ItemStatus = "completed"


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem


def content_bytes(part: Content) -> int:
    """What a content part holds, for the conversation's byte cap: characters of text, bytes of
    audio (as stored: float32 user audio, int16 reply audio) and of images (decoded and URL)."""
    if isinstance(part, InputText | OutputText):
        return len(part.text)
    if isinstance(part, InputAudio):
        return part.audio.nbytes + len(part.transcript or "")
    if isinstance(part, InputImage):
        return len(part.data) + len(part.url)
    return part.samples * 2 + len(part.transcript)


def item_bytes(item: Item) -> int:
    """What an item holds (:func:`content_bytes` of its parts; a call's name, arguments, output)."""
    if isinstance(item, MessageItem):
        return sum(content_bytes(c) for c in item.content)
    if isinstance(item, FunctionCallItem):
        return len(item.name) + len(item.arguments) + len(item.call_id)
    return len(item.output) + len(item.call_id)


def media_bytes(item: Item) -> int:
    """The bytes of audio and images an item holds: what :func:`drop_media` frees."""
    if not isinstance(item, MessageItem):
        return 0
    total = 0
    for part in item.content:
        if isinstance(part, InputAudio):
            total += part.audio.nbytes
        elif isinstance(part, OutputAudio):
            total += part.samples * 2
        elif isinstance(part, InputImage):
            total += len(part.data) + len(part.url)
    return total


def drop_media(item: Item) -> None:
    """Drops an item's audio and images, keeping its text and transcripts (an old item the model
    no longer sees: the conversation's bytes cap with truncation on)."""
    if not isinstance(item, MessageItem):
        return
    for part in item.content:
        if isinstance(part, InputAudio):
            part.audio = np.zeros(0, dtype=np.float32)
        elif isinstance(part, OutputAudio):
            part.chunks, part.marks, part.samples, part.frozen = [], [], 0, True
        elif isinstance(part, InputImage):
            part.data, part.url = b"", ""


def item_text_chars(item: Item) -> int:
    """Characters of text an item puts in a prompt (its text parts and transcripts; a call's
    name, arguments and output), for the context bound (:mod:`omnirt.stages.prompt_size`)."""
    if isinstance(item, MessageItem):
        total = 0
        for part in item.content:
            if isinstance(part, InputText | OutputText):
                total += len(part.text)
            elif isinstance(part, InputAudio):
                total += len(part.transcript or "")
            elif isinstance(part, OutputAudio):
                total += len(part.transcript)
        return total
    if isinstance(item, FunctionCallItem):
        return len(item.name) + len(item.arguments) + len(item.call_id)
    return len(item.output) + len(item.call_id)
