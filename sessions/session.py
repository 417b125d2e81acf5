"""One realtime session: configuration, input buffer, conversation, and its responses.

The session is driven by method calls (one per client event) and reports through ``emit``
(typed :mod:`~omnirt.sessions.events`). A refused request raises :class:`SessionError` and leaves
the session unchanged. Only one response that writes to the conversation runs at a time;
out-of-band responses (``conversation: "none"``) may run beside it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from omnirt.stages.types import GenerationRequest

from .config import SessionConfig, SessionLimits
from .context import build_messages
from .conversation import Conversation
from .errors import ErrorCode, SessionError
from .events import (
    InputAudioCleared,
    InputAudioCommitted,
    ItemAdded,
    ItemDeleted,
    ItemDone,
    ItemRetrieved,
    ItemTruncated,
    SessionClosed,
    SessionCreated,
    SessionEvent,
    SessionUpdated,
)
from .input_buffer import InputAudioBuffer
from .items import InputAudio, Item, MessageItem, OutputAudio
from .response import Response, ResponseOptions
from .streaming import ResponseRun, Submitter
from .turns import TurnPolicy, policy_for

log = logging.getLogger(__name__)

IdFactory = Callable[[str], str]


class RealtimeSession:
    def __init__(
        self,
        client: Submitter,
        *,
        model: str,
        limits: SessionLimits,
        emit: Callable[[SessionEvent], None],
        new_id: IdFactory,
    ) -> None:
        self.client = client
        self.limits = limits
        self._emit_to = emit
        self.new_id = new_id
        self.id = new_id("sess")
        self.config = SessionConfig(model=model, voice=limits.voices[0] if limits.voices else "alloy")
        self.conversation = Conversation(new_id("conv"))
        self.input = InputAudioBuffer(self.config.input_format, limits.max_input_buffer_bytes)
        self.turns: TurnPolicy = policy_for(self.config.turn_detection)
        #: The response writing to the conversation, if any.
        self.active: ResponseRun | None = None
        self.runs: dict[str, ResponseRun] = {}
        self.audio_produced = False
        self.closed = False

    def _emit(self, event: SessionEvent) -> None:
        if not self.closed:
            self._emit_to(event)

    # -- session ---------------------------------------------------------------------------------
    def open(self) -> None:
        self._emit(SessionCreated(self.id, self.config))

    def update(self, patch: dict[str, Any]) -> None:
        config = self.config.merged(patch, limits=self.limits, voice_locked=self.audio_produced)
        turns = policy_for(config.turn_detection)
        self.config = config
        if turns.name != self.turns.name:
            self.turns = turns
        self.input.set_format(config.input_format)
        self._emit(SessionUpdated(self.id, self.config))

    async def close(self, *, notify: bool) -> None:
        """Cancel everything in flight; with ``notify``, end with ``session.closed``."""
        for run in list(self.runs.values()):
            run.cancel()
        if notify:
            self._emit(SessionClosed(self.id))
        self.closed = True
        for run in list(self.runs.values()):
            if run.task is not None:
                run.task.cancel()

    # -- input audio -------------------------------------------------------------------------
    def append_audio(self, data: bytes) -> None:
        pcm = self.input.append(data)
        for signal in self.turns.on_audio(pcm):
            log.debug("turn signal %s ignored by manual session", signal)

    def commit_audio(self) -> MessageItem:
        audio = self.input.commit()
        item = MessageItem(self.new_id("item"), "user", [InputAudio(audio)])
        previous = self.conversation.insert(item)
        self._emit(InputAudioCommitted(item.id, previous))
        self._emit(ItemAdded(item, previous))
        self._emit(ItemDone(item, previous))
        return item

    def clear_audio(self) -> None:
        self.input.clear()
        self.turns.reset()
        self._emit(InputAudioCleared())

    # -- items -------------------------------------------------------------------------------
    def create_item(self, item: Item, previous_item_id: str | None = None) -> None:
        previous = self.conversation.insert(item, previous_item_id)
        self._emit(ItemAdded(item, previous))
        self._emit(ItemDone(item, previous))

    def retrieve_item(self, item_id: str) -> Item:
        item = self.conversation.get(item_id)
        self._emit(ItemRetrieved(item))
        return item

    def delete_item(self, item_id: str) -> None:
        self.conversation.delete(item_id)
        self._emit(ItemDeleted(item_id))

    def truncate_item(self, item_id: str, content_index: int, audio_end_ms: int) -> None:
        """Cut an assistant audio part to what the user heard: the audio after ``audio_end_ms``
        and the transcript not yet spoken by then. Allowed while the response still streams."""
        item = self.conversation.get(item_id)
        if not isinstance(item, MessageItem) or item.role != "assistant":
            raise SessionError(
                ErrorCode.INVALID_VALUE, "Only assistant messages can be truncated.", "item_id"
            )
        if not 0 <= content_index < len(item.content) or not isinstance(
            item.content[content_index], OutputAudio
        ):
            raise SessionError(
                ErrorCode.INVALID_VALUE,
                f"Item '{item_id}' has no audio content at content_index {content_index}.",
                "content_index",
            )
        part = item.content[content_index]
        assert isinstance(part, OutputAudio)
        if audio_end_ms > part.duration_ms:
            raise SessionError(
                ErrorCode.INVALID_VALUE,
                f"audio_end_ms {audio_end_ms} is past the end of the item's audio ({part.duration_ms} ms).",
                "audio_end_ms",
            )
        part.truncate(audio_end_ms)
        self._emit(ItemTruncated(item_id, content_index, audio_end_ms))

    # -- responses ---------------------------------------------------------------------------
    def create_response(self, options: ResponseOptions | None = None) -> Response:
        options = options or ResponseOptions()
        in_conversation = options.conversation == "auto"
        if in_conversation and self.active is not None:
            raise SessionError(
                ErrorCode.ACTIVE_RESPONSE,
                f"Conversation already has an active response in progress: {self.active.id}. "
                "Wait until the response is finished before creating a new one.",
            )
        if options.voice and self.limits.voices and options.voice not in self.limits.voices:
            raise SessionError(
                ErrorCode.INVALID_VALUE,
                f"Unknown voice '{options.voice}'; this model has: {', '.join(self.limits.voices)}.",
                "response.audio.output.voice",
            )
        context = self._context_items(options.input)
        cfg = self.config
        modalities = list(options.output_modalities or cfg.output_modalities)
        max_tokens = (
            options.max_output_tokens if options.max_output_tokens is not None else cfg.max_output_tokens
        )
        response = Response(
            id=self.new_id("resp"),
            conversation_id=self.conversation.id if in_conversation else None,
            output_modalities=modalities,
            max_output_tokens=max_tokens,
            voice=options.voice or cfg.voice,
            output_format=options.output_format or cfg.output_format,
            metadata=options.metadata,
        )
        instructions = options.instructions if options.instructions is not None else cfg.instructions
        cap = self.limits.max_output_tokens
        request = GenerationRequest(
            request_id=response.id,
            messages=build_messages(instructions, context),
            output_audio=response.wants_audio,
            max_output_tokens=cap if max_tokens == "inf" else min(int(max_tokens), cap),
            voice=response.voice,
        )
        run = ResponseRun(
            response,
            request,
            client=self.client,
            emit=self._emit,
            new_id=self.new_id,
            conversation=self.conversation if in_conversation else None,
            on_audio=self._on_audio,
            on_done=self._on_done,
        )
        self.runs[run.id] = run
        if in_conversation:
            self.active = run
        run.start()
        return response

    def cancel_response(self, response_id: str | None = None) -> None:
        if response_id:
            run = self.runs.get(response_id)
            if run is None:
                raise SessionError(
                    ErrorCode.CANCEL_NOT_ACTIVE,
                    f"Cancellation failed: no active response with id '{response_id}'.",
                    "response_id",
                )
        else:
            run = self.active or (next(reversed(self.runs.values())) if self.runs else None)
            if run is None:
                raise SessionError(
                    ErrorCode.CANCEL_NOT_ACTIVE, "Cancellation failed: no active response found."
                )
        run.cancel("client_cancelled")

    def _context_items(self, replacement: list[Item | str] | None) -> list[Item]:
        if replacement is None:
            return list(self.conversation)
        return [self.conversation.get(i) if isinstance(i, str) else i for i in replacement]

    def _on_audio(self) -> None:
        self.audio_produced = True

    def _on_done(self, run: ResponseRun) -> None:
        self.runs.pop(run.id, None)
        if self.active is run:
            self.active = None
