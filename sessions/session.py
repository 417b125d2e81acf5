"""One realtime session: configuration, input buffer, conversation, and its responses.

The session is driven by method calls (one per client event) and reports through ``emit``
(typed :mod:`~omnirt.sessions.events`). A refused request raises :class:`SessionError` and leaves
the session unchanged. Only one response that writes to the conversation runs at a time;
out-of-band responses (``conversation: "none"``) may run beside it, at most
``limits.max_out_of_band_responses`` at once.

The turn policy (:mod:`~omnirt.sessions.turns`) sees the input audio and the in-band responses
through its hooks; server VAD acts through the session's :class:`TurnHost` when speech starts
(barge-in: the in-band response is cancelled with ``turn_detected``), stops (the speech is
committed as a user item, and a response created) or the idle timeout fires. Playback
acknowledgements (``ack_playback``) and truncation keep the history to what the user heard
(:class:`~omnirt.sessions.playback.Playback`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from omnirt.stages.prompt_size import max_prompt_chars, prompt_chars, too_long_message
from omnirt.stages.truncation import split_head
from omnirt.stages.types import ContextMessage, GenerationRequest
from omnirt.vad.worker import VadWorker

from .config import SessionConfig, SessionLimits
from .context import build_context, stage_truncation
from .conversation import ROOT, Conversation
from .errors import ErrorCode, SessionError
from .events import (
    ErrorReported,
    InputAudioCleared,
    InputAudioCommitted,
    ItemAdded,
    ItemDeleted,
    ItemDone,
    ItemRetrieved,
    SessionClosed,
    SessionCreated,
    SessionEvent,
    SessionUpdated,
)
from .images import image_problem
from .input_buffer import InputAudioBuffer
from .items import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputAudio,
    InputImage,
    Item,
    MessageItem,
    OutputAudio,
    drop_media,
    item_bytes,
    item_text_chars,
    media_bytes,
)
from .playback import Playback
from .response import Response, ResponseOptions, StatusReason
from .server_vad import ServerVadTurns
from .streaming import ResponseRun, Submitter
from .tools import realtime_tools
from .transcription import TranscriptionRun, TranscriptionSettings, transcription_request
from .turns import TURN_PARAM, ManualTurns, TurnHost, TurnPolicy, effective_turn_detection, vad_settings
from .voices import DEFAULT_VOICE

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
        vad: VadWorker | None = None,
        push_to_talk: bool = False,
        check_sendable: Callable[[SessionEvent, str], None] | None = None,
    ) -> None:
        self.client = client
        #: Raises :class:`SessionError` (naming the param given) when an event could not be sent
        #: (over the server frame limit): the echo of a change is checked before it is applied.
        self._check_sendable = check_sendable
        self.limits = limits
        self.vad = vad
        #: Push-to-talk (extension): audio appended while a reply is in progress is dropped.
        self.push_to_talk = push_to_talk
        self._emit_to = emit
        self.new_id = new_id
        self.id = new_id("sess")
        self.config = SessionConfig(model=model, voice=DEFAULT_VOICE)
        self.conversation = Conversation(new_id("conv"))
        self.input = InputAudioBuffer(self.config.input_format, limits.max_input_buffer_bytes)
        self.turns: TurnPolicy = ManualTurns()
        #: The response writing to the conversation, if any.
        self.active: ResponseRun | None = None
        self.runs: dict[str, ResponseRun] = {}
        #: What the user heard of the in-conversation responses (acks and truncation).
        self.playback = Playback(self.conversation)
        #: Items a response's truncation left out of the model's context (``session.truncation``):
        #: they stay in the conversation, and later responses leave them out too.
        self.left_out: set[str] = set()
        #: Input audio transcriptions in flight, by user item id.
        self.transcriptions: dict[str, TranscriptionRun] = {}
        self.audio_produced = False
        #: Responses held while the client is behind (:meth:`hold`).
        self.held = False
        self.closed = False

    def _emit(self, event: SessionEvent) -> None:
        if not self.closed:
            self._emit_to(event)

    # -- session ---------------------------------------------------------------------------------
    def open(self) -> None:
        """Start with OpenAI's defaults (server VAD; none in a push-to-talk session) and send
        ``session.created``. When the VAD cannot start, the session starts with manual turns
        (``turn_detection`` null) and says why in an error right after ``session.created``."""
        failure: SessionError | None = None
        if not self.push_to_talk:
            default = effective_turn_detection({"type": "server_vad"})
            try:
                turns = self._policy(default)
            except SessionError as exc:
                failure = exc
                log.warning("session %s starts with manual turns: %s", self.id, exc.message)
            else:
                self.turns = turns
                self.config.turn_detection = default
        self._emit(SessionCreated(self.id, self.config))
        if failure is not None:
            self._emit(ErrorReported(failure.code, failure.message, failure.param, failure.type))

    def update(self, patch: dict[str, Any]) -> None:
        config = self.config.merged(patch, limits=self.limits, voice_locked=self.audio_produced)
        if self._check_sendable is not None:
            self._check_sendable(SessionUpdated(self.id, config), "session")
        turns: TurnPolicy | None = None
        if config.turn_detection != self.config.turn_detection:
            turns = self._policy(config.turn_detection)  # may raise: nothing has changed yet
        self.config = config
        if turns is not None:
            self.turns.close()
            self.turns = turns
        self.input.set_format(config.input_format)
        self._emit(SessionUpdated(self.id, self.config))

    def _policy(self, turn_detection: dict[str, Any] | None) -> TurnPolicy:
        if not turn_detection:
            return ManualTurns()
        if self.push_to_talk:
            raise SessionError(
                ErrorCode.INVALID_VALUE,
                "This is a push-to-talk session (?turn=push_to_talk): turn_detection must stay null.",
                TURN_PARAM,
            )
        host = TurnHost(
            input=self.input,
            new_id=self.new_id,
            emit=self._emit,
            responding=self._responding,
            interrupt=self._interrupt,
            add_turn=self._add_turn,
        )
        return ServerVadTurns(
            vad_settings(turn_detection), self.vad, host=host, max_backlog_ms=self.limits.max_vad_backlog_ms
        )

    async def close(self, *, notify: bool, reason: StatusReason | None = "client_cancelled") -> None:
        """Cancel everything in flight (responses end ``cancelled`` with ``reason``; ``None``: no
        reason, as on a server shutdown); with ``notify``, end with ``session.closed``."""
        for run in list(self.runs.values()):
            run.cancel(reason)
        for transcription in list(self.transcriptions.values()):
            transcription.cancel()
        self.turns.close()
        if notify:
            self._emit(SessionClosed(self.id))
        self.closed = True
        # The owner's callbacks hold the owner: dropped, so a closed session and its connection
        # are freed by reference counting alone, at once (no cycle left to the garbage collector).
        self._emit_to = _discard
        self._check_sendable = None

    # -- input audio -------------------------------------------------------------------------
    def append_audio(self, data: bytes) -> None:
        if self.push_to_talk and self.active is not None:
            # Between turns (a reply is in progress): the talk button is up, this is not the user's.
            return
        turns = self.turns
        turns.check_append()
        pcm = self.input.append(data)
        turns.on_audio(pcm)
        keep_ms = turns.keep_from_ms()
        if keep_ms is not None:
            self.input.drop_before(self.input.ms_to_sample(keep_ms))

    def commit_audio(self) -> MessageItem:
        # float32 as stored: twice the buffer's PCM16 bytes.
        release = self._check_room(1, 2 * self.input.held_bytes, None)
        audio = self.input.commit()
        self._release(release)
        item_id = self.turns.speech_item_id() or self.new_id("item")
        self.turns.reset()
        item = self._add_user_audio(item_id, audio)
        self._transcribe(item)
        return item

    def _add_user_audio(self, item_id: str, audio: Any) -> MessageItem:
        item = MessageItem(item_id, "user", [InputAudio(audio)])
        previous = self.conversation.insert(item)
        self._emit(InputAudioCommitted(item.id, previous))
        self._emit(ItemAdded(item, previous))
        self._emit(ItemDone(item, previous))
        return item

    def _transcribe(self, item: MessageItem) -> None:
        """With input transcription on, start transcribing a committed user audio item. Callers
        that also create a response create it first: the reply is never queued behind this."""
        config = self.config.transcription
        if config is None or self.closed or item.id not in self.conversation:
            return
        part = item.content[0]
        assert isinstance(part, InputAudio)
        settings = TranscriptionSettings.of(config)
        request = transcription_request(
            self.new_id("tr"), part.audio, settings, max_tokens=self.limits.max_output_tokens
        )
        run = TranscriptionRun(
            item.id, 0, part, request, client=self.client, emit=self._emit, on_done=self._on_transcribed
        )
        self.transcriptions[item.id] = run
        run.start()

    def _on_transcribed(self, run: TranscriptionRun) -> None:
        if self.transcriptions.get(run.item_id) is run:
            del self.transcriptions[run.item_id]

    def clear_audio(self) -> None:
        self.input.clear()
        self.turns.reset()
        self._emit(InputAudioCleared())

    # -- what a turn policy may do (TurnHost) --------------------------------------------------
    def _responding(self) -> bool:
        return self.active is not None

    def _interrupt(self) -> None:
        if self.active is not None:
            self.active.cancel("turn_detected")

    def _add_turn(self, item_id: str, audio: np.ndarray, respond: bool) -> bool:
        """The user's turn a policy detected: added as an audio item (and transcribed), with a
        response first when ``respond``; False when it had no room (the client was told)."""
        if not self._room_for_turn(audio):
            return False
        item = self._add_user_audio(item_id, audio)
        try:
            if respond:
                self._respond_to_turn()
        finally:
            self._transcribe(item)
        return True

    def _room_for_turn(self, audio: Any) -> bool:
        """Whether server VAD's turn fits the conversation caps; if not, the turn's audio is
        dropped and the client told (``conversation_limit_exceeded``), as a commit would be."""
        try:
            release = self._check_room(1, audio.nbytes, None)
        except SessionError as exc:
            self._emit(ErrorReported(exc.code, exc.message, exc.param, exc.type))
            return False
        self._release(release)  # the turn is taken next
        return True

    def _respond_to_turn(self) -> None:
        """The response server VAD creates; one the session's settings refuse (a ``tool_choice``
        its tools cannot satisfy) is reported as an ``error``, as a client's ``response.create``
        would be answered."""
        try:
            self.create_response()
        except SessionError as exc:
            self._emit(ErrorReported(exc.code, exc.message, exc.param, exc.type))

    # -- items -------------------------------------------------------------------------------
    def create_item(self, item: Item, previous_item_id: str | None = None) -> None:
        release = self._check_room(1, item_bytes(item), "item")
        self._check_text(item)
        through = self._check_images([item], "item")
        self._check_call_outputs([("item.call_id", item)])
        if self._check_sendable is not None:
            self.conversation.check_insert(item.id, previous_item_id)
            before = self.conversation.last_id if previous_item_id is None else previous_item_id
            self._check_sendable(ItemDone(item, None if before == ROOT else before), "item")
        previous = self.conversation.insert(item, previous_item_id)
        self._leave_out_through(through)
        self._release(release)
        if release.delete:  # the item it follows may be among the oldest, deleted
            previous = self.conversation.previous_id(item.id)
        self._emit(ItemAdded(item, previous))
        self._emit(ItemDone(item, previous))

    def retrieve_item(self, item_id: str) -> Item:
        item = self.conversation.get(item_id, ErrorCode.ITEM_RETRIEVE_INVALID_ID, "retrieving")
        self._emit(ItemRetrieved(item))
        return item

    def delete_item(self, item_id: str) -> None:
        self.conversation.delete(item_id)
        self.left_out.discard(item_id)
        transcription = self.transcriptions.get(item_id)
        if transcription is not None:
            transcription.cancel()
        self._emit(ItemDeleted(item_id))

    def truncate_item(self, item_id: str, content_index: int, audio_end_ms: int) -> None:
        """Cut an assistant audio part to what the user heard (see :class:`Playback`)."""
        self._emit(self.playback.truncate(item_id, content_index, audio_end_ms))

    def ack_playback(self, response_id: str, item_id: str, played_ms: int) -> None:
        """Extension ``playback.ack``: the user heard ``played_ms`` of the item's audio.

        After the response ended this cuts the item exactly as ``conversation.item.truncate`` at
        ``played_ms`` does. While it still streams the position is recorded, and the item is cut
        there if the response is then interrupted (barge-in or cancel)."""
        self._emit(self.playback.ack(response_id, item_id, played_ms, streaming=response_id in self.runs))

    def _check_call_outputs(self, items: list[tuple[str, Item]], context: Iterable[Item] = ()) -> None:
        """A ``function_call_output`` must answer a ``function_call`` of the conversation (or of the
        response's own ``input``), as OpenAI checks; ``items`` pairs each item with its param."""
        calls = {i.call_id for i in (*self.conversation, *context) if isinstance(i, FunctionCallItem)}
        for param, item in items:
            if isinstance(item, FunctionCallOutputItem) and item.call_id not in calls:
                raise SessionError(
                    ErrorCode.INVALID_VALUE,
                    f"Tool call ID '{item.call_id}' not found in conversation.",
                    param,
                )

    def _check_room(self, items: int, size: int, param: str | None) -> _Room:
        """The conversation caps (``max_items``, ``max_conversation_bytes``): raises
        ``conversation_limit_exceeded`` when adding ``items`` holding ``size`` would pass one.
        With truncation on, the caps are kept instead as a truncation would, from the oldest
        items (out of the model's context already, or left out with everything before them), so
        a long spoken session goes on: over ``max_items`` the oldest items are deleted (up to the
        next user message, so that the conversation still starts with one), over the bytes cap the
        audio and images of the oldest are dropped. What to do once the new items are taken
        (:meth:`_release`); the reply being made or played is never touched."""
        limits = self.limits
        truncating = self.config.truncation != "disabled"
        held = len(self.conversation)
        over_items = held + items - limits.max_items
        room = _Room()
        if over_items > 0:
            settled = list(self._settled()) if truncating else []
            if len(settled) < over_items:
                raise SessionError(
                    ErrorCode.CONVERSATION_LIMIT,
                    f"The conversation holds {held} items, this server's limit is {limits.max_items} "
                    "(delete some items first).",
                    param,
                )
            cut = next(
                (i for i in range(over_items, len(settled)) if _is_user_message(settled[i])), over_items
            )
            room.delete = settled[:cut]
        held_bytes = self.conversation.bytes_held - sum(item_bytes(i) for i in room.delete)
        over = held_bytes + size - limits.max_conversation_bytes
        if over <= 0:
            return room
        if truncating:
            deleted = {item.id for item in room.delete}
            for item in self._settled():
                freed = 0 if item.id in deleted else media_bytes(item)
                if freed:
                    room.media.append(item)
                    over -= freed
                    if over <= 0:
                        return room
        raise SessionError(
            ErrorCode.CONVERSATION_LIMIT,
            f"The conversation would hold {held_bytes + size} bytes of text, audio and images; "
            f"this server's limit is {limits.max_conversation_bytes} (delete some items first).",
            param,
        )

    def _settled(self) -> Iterator[Item]:
        """The conversation's items from the oldest, up to the first one being made or played (the
        latest response's output: its audio is still cut by acks): what the caps may take from."""
        latest = next(reversed(self.playback.responses.values()), None)
        playing = {item.id for item in latest.output} if latest is not None else set()
        for item in self.conversation:
            if item.status == "in_progress" or item.id in playing:
                return
            yield item

    def _release(self, room: _Room) -> None:
        """Does what :meth:`_check_room` found the caps ask: deletes the oldest items (each told to
        the client, ``conversation.item.deleted``, as a delete it asked for), and drops the audio
        and images of the next ones, which leaves them and every item before them out of the
        model's context."""
        for item in room.delete:
            self.delete_item(item.id)
        if room.delete:
            log.info(
                "session %s: deleted the %d oldest items (conversation items cap)", self.id, len(room.delete)
            )
        if not room.media:
            return
        self._leave_out_through(room.media[-1].id)
        for item in room.media:
            drop_media(item)
        log.info(
            "session %s: dropped the audio and images of %d old items (conversation bytes cap)",
            self.id,
            len(room.media),
        )

    def _check_text(self, item: Item) -> None:
        """An item whose text cannot fit the model's context alone, or (with ``truncation``
        disabled) beside the conversation's, gets ``context_length_exceeded`` (counted in
        characters: no tokenising). With truncation the conversation may outgrow the context: a
        response leaves its oldest messages out."""
        limit = max_prompt_chars(self.limits.max_context_tokens)
        size = item_text_chars(item)
        if size > limit:
            raise SessionError(
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"The item holds {size} characters of text; this model's context "
                f"({self.limits.max_context_tokens} tokens) holds at most {limit}.",
                "item",
            )
        if self.config.truncation != "disabled":
            return  # a conversation over the context is truncated when a response is made
        held = sum(item_text_chars(i) for i in self.conversation)
        if held + size > limit:
            raise SessionError(
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"The conversation would hold {held + size} characters of text; this model's context "
                f"({self.limits.max_context_tokens} tokens) holds at most {limit} (delete some items first).",
                "item",
            )

    def _leave_out_through(self, item_id: str | None) -> None:
        """Leaves the conversation's items up to ``item_id`` (included) out of the model's context,
        as a response's truncation leaves its oldest messages out."""
        if item_id is None:
            return
        for item in self.conversation:
            self.left_out.add(item.id)
            if item.id == item_id:
                return

    def _check_images(self, items: Iterable[Item], param: str) -> str | None:
        """Refuses an image over the size limit or unreadable, and images over ``max_images`` in
        the model's context. With truncation on, the oldest messages are left out of the context
        instead (up to the oldest holding images, enough of them for the new ones: a camera that
        sends a frame each turn goes on): the last item to leave out once the items are taken
        (:meth:`_leave_out_through`)."""
        new = _images(items)
        for image in new:
            if len(image.data) > self.limits.max_image_bytes:
                raise SessionError(
                    ErrorCode.IMAGE_LIMIT,
                    f"An image of {len(image.data)} bytes is over this server's limit of "
                    f"{self.limits.max_image_bytes} bytes.",
                    param,
                )
            problem = image_problem(image.data)
            if problem is not None:  # refused now, not in every later response that would hold it
                raise SessionError(ErrorCode.INVALID_VALUE, f"The image could not be read: {problem}", param)
        if not new:
            return None
        in_context = [item for item in self.conversation if item.id not in self.left_out]
        over = len(_images(in_context)) + len(new) - self.limits.max_images
        if over <= 0:
            return None
        if self.config.truncation != "disabled" and len(new) <= self.limits.max_images:
            for item in in_context:
                over -= len(_images([item]))
                if over <= 0:
                    return item.id
        raise SessionError(
            ErrorCode.IMAGE_LIMIT,
            f"The conversation would hold {len(_images(in_context)) + len(new)} images; this server "
            f"allows {self.limits.max_images} per session (delete some first).",
            param,
        )

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
        room = _Room()
        if in_conversation:  # its output items join the conversation
            room = self._check_room(1, 0, None)
        else:
            running = sum(run is not self.active for run in self.runs.values())
            if running >= self.limits.max_out_of_band_responses:
                raise SessionError(
                    ErrorCode.RESOURCE_EXHAUSTED,
                    f"This session already runs {running} out-of-band responses, the server's limit "
                    "(max_out_of_band_responses); wait for one to finish or cancel one.",
                    "response.conversation",
                )
        if options.voice:
            self.limits.voices.resolve(options.voice, "response.audio.output.voice")
        cfg = self.config
        overridden = options.tools is not None or options.tool_choice is not None
        tools, tool_choice = realtime_tools(
            cfg.tools if options.tools is None else options.tools,
            cfg.tool_choice if options.tool_choice is None else options.tool_choice,
            "response" if overridden else "session",
        )
        context = self._context_items(options.input)
        if options.input is not None:
            new = [
                (f"response.input.{i}", it) for i, it in enumerate(options.input) if not isinstance(it, str)
            ]
            self._check_images([it for _, it in new], "response.input")
            self._check_call_outputs([(f"{param}.call_id", it) for param, it in new], context)
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
        if room.delete or room.media:  # every check passed: the caps' room is made now
            self._release(room)
            context = self._context_items(options.input)
        messages, message_items = build_context(instructions, context)
        truncation = stage_truncation(cfg.truncation)
        if truncation is None:
            too_long = too_long_message(prompt_chars(messages, tools), self.limits.max_context_tokens)
            if too_long is not None:  # refused before the engine tokenises it
                raise SessionError(ErrorCode.CONTEXT_LENGTH_EXCEEDED, too_long, "response")
        request = GenerationRequest(
            request_id=response.id,
            messages=messages,
            output_audio=response.wants_audio,
            max_output_tokens=cap if max_tokens == "inf" else min(int(max_tokens), cap),
            voice=self.limits.voices.resolve(response.voice, "response.audio.output.voice"),
            tools=tools,
            tool_choice=tool_choice,
            truncation=truncation,
        )
        on_truncated = None
        if options.input is None:  # its context is the conversation: what it leaves out stays out
            on_truncated = functools.partial(self._left_out, messages, message_items)
        run = ResponseRun(
            response,
            request,
            client=self.client,
            emit=self._emit,
            new_id=self.new_id,
            conversation=self.conversation if in_conversation else None,
            on_audio=self._on_audio,
            on_done=self._on_done,
            on_truncated=on_truncated,
        )
        self.runs[run.id] = run
        if in_conversation:
            self.active = run
            self.playback.track(response)
            self.turns.on_response_started()
        run.start()
        if self.held:
            run.hold(True)
        return response

    def hold(self, held: bool) -> None:
        """Hold (or release) every response's generation: the client has fallen behind reading
        what they make (the connection's send queue), so they get no compute until it catches up.
        Responses created while held start held."""
        if held == self.held:
            return
        self.held = held
        for run in self.runs.values():
            run.hold(held)

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

    def _left_out(self, messages: list[ContextMessage], items: list[tuple[str, ...]], dropped: int) -> None:
        """A response's truncation left out the first ``dropped`` messages of its conversation
        (after the instructions): their items stay out of later responses' context."""
        head = len(split_head(messages)[0])
        for ids in items[head : head + dropped]:
            self.left_out.update(ids)

    def _context_items(self, replacement: list[Item | str] | None) -> list[Item]:
        if replacement is None:
            return [item for item in self.conversation if item.id not in self.left_out]
        out: list[Item] = []
        for i, entry in enumerate(replacement):
            if isinstance(entry, str):
                item = self.conversation.find(entry)
                if item is None:
                    raise SessionError(
                        ErrorCode.INVALID_VALUE,
                        f"Invalid value: no item with id '{entry}' in the conversation.",
                        f"response.input.{i}.id",
                    )
                entry = item
            out.append(entry)
        return out

    def _on_audio(self) -> None:
        self.audio_produced = True

    def _on_done(self, run: ResponseRun) -> None:
        self.runs.pop(run.id, None)
        response = run.response
        self.playback.settle(response)  # interrupted: history keeps what the last ack said was heard
        if self.active is run:
            self.active = None
            self.turns.on_response_done(
                sum(
                    c.duration_ms
                    for i in response.output
                    if isinstance(i, MessageItem)
                    for c in i.content
                    if isinstance(c, OutputAudio)
                )
            )


def _discard(event: SessionEvent) -> None:
    """Where a closed session's events go."""


def _images(items: Iterable[Item]) -> list[InputImage]:
    return [c for i in items if isinstance(i, MessageItem) for c in i.content if isinstance(c, InputImage)]


@dataclass
class _Room:
    """What the conversation caps ask before new items are taken (:meth:`RealtimeSession._check_room`)."""

    #: The oldest items, deleted (over ``max_items``).
    delete: list[Item] = field(default_factory=list)
    #: Items whose audio and images are dropped (over ``max_conversation_bytes``).
    media: list[Item] = field(default_factory=list)


def _is_user_message(item: Item) -> bool:
    return isinstance(item, MessageItem) and item.role == "user"
