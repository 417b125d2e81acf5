"""What a session emits. ``realtime/`` turns each into one server event.

Events may reference live session state (items, responses): a sink must serialize an event
before it returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from omnirt.stages.types import Usage

from .config import SessionConfig
from .items import Item
from .response import Response


@dataclass(frozen=True)
class SessionCreated:
    session_id: str
    config: SessionConfig


@dataclass(frozen=True)
class SessionUpdated:
    session_id: str
    config: SessionConfig


@dataclass(frozen=True)
class SessionClosed:
    session_id: str


@dataclass(frozen=True)
class ErrorReported:
    """An error the session reports on its own (not the answer to a client event)."""

    code: str
    message: str
    param: str | None = None
    type: str = "server_error"


@dataclass(frozen=True)
class InputAudioCommitted:
    item_id: str
    previous_item_id: str | None


@dataclass(frozen=True)
class InputAudioCleared:
    pass


@dataclass(frozen=True)
class SpeechStarted:
    audio_start_ms: int
    item_id: str


@dataclass(frozen=True)
class SpeechStopped:
    audio_end_ms: int
    item_id: str


@dataclass(frozen=True)
class TimeoutTriggered:
    audio_start_ms: int
    audio_end_ms: int
    item_id: str


@dataclass(frozen=True)
class PlaybackAcknowledged:
    """Extension: the answer to ``playback.ack``."""

    response_id: str
    item_id: str
    played_ms: int
    #: Audio of the item the conversation history holds after the ack.
    committed_ms: int


@dataclass(frozen=True)
class ItemAdded:
    item: Item
    previous_item_id: str | None


@dataclass(frozen=True)
class ItemDone:
    item: Item
    previous_item_id: str | None


@dataclass(frozen=True)
class ItemRetrieved:
    item: Item


@dataclass(frozen=True)
class ItemDeleted:
    item_id: str


@dataclass(frozen=True)
class ItemTruncated:
    item_id: str
    content_index: int
    audio_end_ms: int


@dataclass(frozen=True)
class InputTranscriptionDelta:
    """More of the transcript of a user audio part."""

    item_id: str
    content_index: int
    delta: str


@dataclass(frozen=True)
class InputTranscriptionCompleted:
    item_id: str
    content_index: int
    transcript: str
    usage: Usage


@dataclass(frozen=True)
class TranscriptionError:
    type: str
    code: str
    message: str


@dataclass(frozen=True)
class InputTranscriptionFailed:
    item_id: str
    content_index: int
    error: TranscriptionError


@dataclass(frozen=True)
class ResponseCreated:
    response: Response


@dataclass(frozen=True)
class ResponseDone:
    response: Response


@dataclass(frozen=True)
class OutputItemAdded:
    response_id: str
    output_index: int
    item: Item


@dataclass(frozen=True)
class OutputItemDone:
    response_id: str
    output_index: int
    item: Item


@dataclass(frozen=True)
class PartRef:
    """Where a content part sits: every response-streaming event carries one."""

    response_id: str
    item_id: str
    output_index: int
    content_index: int


PartKind = Literal["audio", "text"]


@dataclass(frozen=True)
class ContentPartAdded:
    ref: PartRef
    kind: PartKind


@dataclass(frozen=True)
class ContentPartDone:
    ref: PartRef
    kind: PartKind
    #: The transcript (audio parts) or text (text parts) as generated.
    text: str


@dataclass(frozen=True)
class OutputAudioDelta:
    ref: PartRef
    #: Wire bytes in the session's output format.
    audio: bytes


@dataclass(frozen=True)
class OutputAudioDone:
    ref: PartRef


@dataclass(frozen=True)
class OutputTextDelta:
    ref: PartRef
    delta: str
    #: True: the transcript of an audio part (``response.output_audio_transcript.*``).
    transcript: bool


@dataclass(frozen=True)
class OutputTextDone:
    ref: PartRef
    text: str
    transcript: bool


@dataclass(frozen=True)
class FunctionCallArgumentsDelta:
    response_id: str
    item_id: str
    output_index: int
    call_id: str
    delta: str


@dataclass(frozen=True)
class FunctionCallArgumentsDone:
    response_id: str
    item_id: str
    output_index: int
    call_id: str
    name: str
    arguments: str


SessionEvent = (
    SessionCreated
    | SessionUpdated
    | SessionClosed
    | ErrorReported
    | InputAudioCommitted
    | InputAudioCleared
    | SpeechStarted
    | SpeechStopped
    | TimeoutTriggered
    | PlaybackAcknowledged
    | ItemAdded
    | ItemDone
    | ItemRetrieved
    | ItemDeleted
    | ItemTruncated
    | InputTranscriptionDelta
    | InputTranscriptionCompleted
    | InputTranscriptionFailed
    | ResponseCreated
    | ResponseDone
    | OutputItemAdded
    | OutputItemDone
    | ContentPartAdded
    | ContentPartDone
    | OutputAudioDelta
    | OutputAudioDone
    | OutputTextDelta
    | OutputTextDone
    | FunctionCallArgumentsDelta
    | FunctionCallArgumentsDone
)
