"""Streams one response from the engine into session events, and closes it exactly once.

Event order per PROTOCOL.md: ``response.created``; on the first output the assistant item opens
(``output_item.added``, ``conversation.item.added``, ``content_part.added``); deltas; then
``output_audio.done``, transcript/text done, ``content_part.done``, ``output_item.done``,
``conversation.item.done``, ``response.done``. Cancelling closes the response synchronously, so
nothing of it follows its ``response.done``.

A function call (:class:`ToolCall`, always complete) becomes a ``function_call`` item of its own
output index: ``output_item.added``, ``conversation.item.added``, ``function_call_arguments.delta``
and ``.done``, ``output_item.done``, ``conversation.item.done``, all at once. While the message item
is open (its audio lags the text) calls wait, and follow it when it closes at the end; a
cancelled or failed response drops the calls still waiting.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from typing import Protocol

import numpy as np
from omnirt.codecs.audio import AudioEncoder, FormatType, bytes_per_ms
from omnirt.stages.types import (
    AudioDelta,
    Finished,
    GenerationRequest,
    Output,
    Started,
    TextDelta,
    ToolCall,
    Usage,
)

from .conversation import Conversation
from .events import (
    ContentPartAdded,
    ContentPartDone,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    ItemAdded,
    ItemDone,
    OutputAudioDelta,
    OutputAudioDone,
    OutputItemAdded,
    OutputItemDone,
    OutputTextDelta,
    OutputTextDone,
    PartRef,
    ResponseCreated,
    ResponseDone,
    SessionEvent,
)
from .items import FunctionCallItem, MessageItem, OutputAudio, OutputText
from .response import Response, ResponseError, StatusReason

log = logging.getLogger(__name__)

#: Audio deltas on the wire carry 20 to 200 ms (the last one of a response may be shorter).
MIN_DELTA_MS = 20
MAX_DELTA_MS = 200


class OutputStream(Protocol):
    usage: object

    def cancel(self) -> None: ...

    def hold(self, held: bool) -> None: ...

    def __aiter__(self): ...


class Submitter(Protocol):
    """What a session needs of the engine (``EngineClient``)."""

    def submit(self, request: GenerationRequest) -> OutputStream: ...


class AudioChunker:
    """Cuts encoded audio into wire deltas of MIN..MAX ms, whole samples only."""

    def __init__(self, fmt: FormatType) -> None:
        self.per_ms = bytes_per_ms(fmt)
        self.sample_bytes = 2 if fmt == "audio/pcm" else 1
        self._pending = bytearray()

    def push(self, data: bytes) -> list[bytes]:
        self._pending += data
        if len(self._pending) < MIN_DELTA_MS * self.per_ms:
            return []
        return self._split(len(self._pending))

    def flush(self) -> list[bytes]:
        return self._split(len(self._pending)) if self._pending else []

    def _split(self, size: int) -> list[bytes]:
        pieces = math.ceil(size / (MAX_DELTA_MS * self.per_ms))
        step = (size // pieces) // self.sample_bytes * self.sample_bytes
        out = [bytes(self._pending[i * step : (i + 1) * step]) for i in range(pieces - 1)]
        out.append(bytes(self._pending[(pieces - 1) * step : size]))
        del self._pending[:size]
        return out


class ResponseRun:
    """One response in flight: the engine stream, the output item it fills, its events."""

    def __init__(
        self,
        response: Response,
        request: GenerationRequest,
        *,
        client: Submitter,
        emit: Callable[[SessionEvent], None],
        new_id: Callable[[str], str],
        conversation: Conversation | None,
        on_audio: Callable[[], None],
        on_done: Callable[[ResponseRun], None],
        on_truncated: Callable[[int], None] | None = None,
    ) -> None:
        self.response = response
        self.request = request
        #: Told how many of the request's messages its truncation left out (when any were).
        self._on_truncated = on_truncated
        self._client = client
        self._emit = emit
        self._new_id = new_id
        self._conversation = conversation
        self._on_audio = on_audio
        self._on_done = on_done
        self._item: MessageItem | None = None
        self._ref: PartRef | None = None
        self._generated = ""
        #: Calls made while the reply's message item is open: they follow it when it closes.
        self._held: list[ToolCall] = []
        self._encoder = AudioEncoder(response.output_format)
        self._chunker = AudioChunker(response.output_format)
        self._stream: OutputStream | None = None
        self.task: asyncio.Task[None] | None = None
        self.finished = False

    @property
    def id(self) -> str:
        return self.response.id

    def start(self) -> None:
        self._emit(ResponseCreated(self.response))
        try:
            self._stream = self._client.submit(self.request)
        except Exception as exc:  # the engine refused synchronously: the response still ends
            log.exception("response %s could not be submitted", self.id)
            self._finish(Finished("error", Usage(), f"could not start generation: {exc}"))
            return
        self.task = asyncio.get_running_loop().create_task(self._pump(), name=f"response {self.id}")

    def cancel(self, reason: StatusReason | None = "client_cancelled") -> None:
        """Stop generating now; ``response.done`` (cancelled, with ``reason`` unless None) is
        emitted before this returns."""
        if self.finished:
            return
        usage = Usage()
        if self._stream is not None:
            self._stream.cancel()
            usage = self._stream.usage  # type: ignore[assignment]
        self._finish(Finished("cancelled", usage), reason)

    def hold(self, held: bool) -> None:
        """Hold (or release) the generation: while held it makes nothing (the client is behind)."""
        if self._stream is not None and not self.finished:
            self._stream.hold(held)

    async def _pump(self) -> None:
        assert self._stream is not None
        try:
            async for output in self._stream:
                if self.finished:
                    return
                self._handle(output)
        except Exception as exc:  # a bug here must still end the response for the client
            log.exception("response %s failed", self.id)
            self._stream.cancel()
            self._finish(Finished("error", self._stream.usage, f"internal error: {exc}"))  # type: ignore[arg-type]

    def _handle(self, output: Output) -> None:
        if isinstance(output, Started):
            if output.dropped and self._on_truncated is not None:
                self._on_truncated(output.dropped)
        elif isinstance(output, TextDelta):
            self._text(output)
        elif isinstance(output, AudioDelta):
            self._audio(output)
        elif isinstance(output, ToolCall):
            if self._ref is not None:  # the message's audio may still be coming: it stays open
                self._held.append(output)
            else:
                self._call(output)
        elif isinstance(output, Finished):
            self._finish(output)

    # -- the output item ---------------------------------------------------------------------
    def _open(self) -> PartRef:
        if self._ref is not None:
            return self._ref
        item = MessageItem(self._new_id("item"), "assistant", [], status="in_progress")
        self._item = item
        output_index = len(self.response.output)
        self.response.output.append(item)
        self._emit(OutputItemAdded(self.id, output_index, item))
        if self._conversation is not None:
            previous = self._conversation.insert(item)
            self._emit(ItemAdded(item, previous))
        part = OutputAudio() if self.response.wants_audio else OutputText()
        item.content.append(part)
        self._ref = PartRef(self.id, item.id, output_index, 0)
        self._emit(ContentPartAdded(self._ref, "audio" if self.response.wants_audio else "text"))
        return self._ref

    def _text(self, delta: TextDelta) -> None:
        if not delta.text:
            return
        ref = self._open()
        assert self._item is not None
        part = self._item.content[0]
        self._generated += delta.text
        if isinstance(part, OutputAudio):
            if not part.frozen:
                part.transcript += delta.text
        elif isinstance(part, OutputText):
            part.text += delta.text
        self._emit(OutputTextDelta(ref, delta.text, transcript=self.response.wants_audio))

    def _audio(self, delta: AudioDelta) -> None:
        if not self.response.wants_audio or len(delta.pcm) == 0:
            return
        ref = self._open()
        assert self._item is not None
        part = self._item.content[0]
        assert isinstance(part, OutputAudio)
        part.append(delta.pcm, delta.text_chars)
        self._on_audio()
        for chunk in self._chunker.push(self._encoder.encode(delta.pcm)):
            self._emit(OutputAudioDelta(ref, chunk))

    def _call(self, call: ToolCall) -> None:
        """A complete function call becomes a ``function_call`` item, opened and closed at once."""
        item = FunctionCallItem(
            self._new_id("item"), self._new_id("call"), call.name, "", status="in_progress"
        )
        output_index = len(self.response.output)
        self.response.output.append(item)
        self._emit(OutputItemAdded(self.id, output_index, item))
        if self._conversation is not None:
            self._emit(ItemAdded(item, self._conversation.insert(item)))
        if call.arguments:
            self._emit(
                FunctionCallArgumentsDelta(self.id, item.id, output_index, item.call_id, call.arguments)
            )
        item.arguments = call.arguments
        self._emit(
            FunctionCallArgumentsDone(self.id, item.id, output_index, item.call_id, call.name, call.arguments)
        )
        item.status = "completed"
        self._emit(OutputItemDone(self.id, output_index, item))
        if self._conversation is not None:
            self._emit(ItemDone(item, self._conversation.previous_id(item.id)))

    # -- the end -----------------------------------------------------------------------------
    def _finish(self, finished: Finished, cancel_reason: StatusReason | None = "client_cancelled") -> None:
        if self.finished:
            return
        self.finished = True
        response = self.response
        if finished.reason == "stop":
            response.status = "completed"
        elif finished.reason == "length":
            response.status, response.reason = "incomplete", "max_output_tokens"
        elif finished.reason == "cancelled":
            response.status, response.reason = "cancelled", cancel_reason
        else:
            response.status = "failed"
            if finished.code == "rejected":
                response.error = ResponseError(
                    "invalid_request_error", "invalid_value", finished.error or "input refused"
                )
            else:
                response.error = ResponseError(
                    "server_error", "server_error", finished.error or "generation failed"
                )
        response.usage = finished.usage
        if self._ref is not None and self._item is not None:
            self._close_item(self._ref, self._item, complete=finished.reason == "stop")
        if finished.reason in ("stop", "length"):
            for call in self._held:
                self._call(call)
        elif self._held:  # cancelled or failed: the model's calls are not offered to the client
            log.info(
                "response %s ended %s; %d function call(s) dropped", self.id, finished.reason, len(self._held)
            )
        self._emit(ResponseDone(response))
        self._on_done(self)

    def _close_item(self, ref: PartRef, item: MessageItem, complete: bool) -> None:
        if self.response.wants_audio:
            tail = self._encoder.encode(np.zeros(0, dtype=np.int16), last=True)
            for chunk in self._chunker.push(tail) + self._chunker.flush():
                self._emit(OutputAudioDelta(ref, chunk))
            self._emit(OutputAudioDone(ref))
        transcript = self.response.wants_audio
        self._emit(OutputTextDone(ref, self._generated, transcript=transcript))
        self._emit(ContentPartDone(ref, "audio" if transcript else "text", self._generated))
        item.status = "completed" if complete else "incomplete"
        self._emit(OutputItemDone(self.id, ref.output_index, item))
        if self._conversation is not None and item.id in self._conversation:
            self._emit(ItemDone(item, self._conversation.previous_id(item.id)))
