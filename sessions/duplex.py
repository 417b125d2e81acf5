"""A native full-duplex session (``/v1/realtime?duplex=1``): audio streams both ways at once.

The session holds one live engine request (``EngineClient.open`` of a
:class:`~omnirt.stages.duplex.types.DuplexRequest`) for its whole life. Every
``input_audio_buffer.append`` is decoded (any input format, resampled to 24 kHz) and pushed into
it; the model answers every 80 ms frame of input with one frame of audio and maybe some text, and
decides itself when to talk. There are no turns: commits, ``clear``, ``response.create`` and
``conversation.item.create`` are refused (``unsupported``), and ``turn_detection`` stays null.

Each stretch of model speech (:mod:`.stretches`) is one response, streamed with the turn
session's own machinery (:class:`~.streaming.ResponseRun`): ``response.created``, the assistant
item (``response.output_item.added``, ``conversation.item.added``,
``response.content_part.added``), ``response.output_audio.delta`` and
``response.output_audio_transcript.delta``, then the closing events and ``response.done``. Frames
outside stretches are not sent. ``response.cancel`` during a stretch ends it (``cancelled``);
the model keeps listening, and what it still says of that stretch is not sent (until the stretch
would have ended). ``playback.ack`` and ``conversation.item.truncate`` cut the stored audio and
transcript to what was heard, as in turn sessions (:class:`~.playback.Playback`). The
conversation holds the model's stretches only (the user's audio is not stored); past the
conversation caps the oldest items are dropped (``conversation.item.deleted``).

Input more than ``max_ahead_ms`` ahead of what the model has consumed is refused with
``input_backpressure`` and dropped. A held session (its client is behind reading) takes no steps,
so its input backs up to that bound too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from omnirt.codecs.audio import SAMPLE_RATE, AudioDecoder, bytes_per_ms
from omnirt.stages.duplex.types import DuplexRequest
from omnirt.stages.live import InputBackpressure, LiveInput
from omnirt.stages.types import AudioDelta, Finished, GenerationRequest, Output, TextDelta, Usage

from .config import SessionConfig, SessionLimits
from .conversation import Conversation
from .errors import ErrorCode, SessionError
from .events import (
    ErrorReported,
    ItemDeleted,
    ItemRetrieved,
    ResponseCreated,
    SessionClosed,
    SessionCreated,
    SessionEvent,
    SessionUpdated,
)
from .input_buffer import check_audio_bytes
from .items import Item
from .playback import Playback
from .response import Response, ResponseOptions, StatusReason
from .streaming import ResponseRun
from .stretches import Stretches, StretchRule
from .turns import TURN_PARAM
from .voices import DEFAULT_VOICE

log = logging.getLogger(__name__)


class LiveOpener(Protocol):
    """What a duplex session needs of the engine (``EngineClient``)."""

    def open(self, request: DuplexRequest) -> Any: ...


@dataclass(frozen=True)
class DuplexSettings:
    """Server-owned settings of duplex sessions."""

    #: Input the client may send ahead of what the model has consumed.
    max_ahead_ms: int = 2_000
    stretch: StretchRule = field(default_factory=StretchRule)


class StretchRun(ResponseRun):
    """One stretch of model speech as a response: fed frame by frame by the session (no engine
    request of its own), its events emitted as it is fed."""

    def start(self) -> None:
        self._emit(ResponseCreated(self.response))

    def feed(self, output: Output) -> None:
        if not self.finished:
            self._handle(output)


def _unsupported(what: str) -> SessionError:
    return SessionError(
        ErrorCode.UNSUPPORTED,
        f"{what} is not supported in a full-duplex session (duplex=1): the model listens all the "
        "time and decides itself when to speak; just keep appending audio.",
    )


class DuplexSession:
    def __init__(
        self,
        client: LiveOpener,
        *,
        model: str,
        limits: SessionLimits,
        emit: Callable[[SessionEvent], None],
        new_id: Callable[[str], str],
        settings: DuplexSettings = DuplexSettings(),
        check_sendable: Callable[[SessionEvent, str], None] | None = None,
    ) -> None:
        self.client = client
        self.limits = limits
        self.settings = settings
        self._emit_to = emit
        self._check_sendable = check_sendable
        self.new_id = new_id
        self.id = new_id("sess")
        self.config = SessionConfig(model=model, voice=DEFAULT_VOICE)
        self.conversation = Conversation(new_id("conv"))
        self._decoder = AudioDecoder(self.config.input_format)
        self._stream: Any = None
        self._pump: asyncio.Task[None] | None = None
        self._stretches = Stretches(settings.stretch)
        #: The stretch being streamed, and whether the current one was cancelled (not sent).
        self.active: StretchRun | None = None
        self._muted = False
        self._frame_text = ""
        self._base_chars = 0
        self._usage = Usage()
        #: What the user heard of the stretches (acks and truncation).
        self.playback = Playback(self.conversation)
        self.ended: Finished | None = None
        self.held = False
        self.closed = False

    def _emit(self, event: SessionEvent) -> None:
        if not self.closed:
            self._emit_to(event)

    # -- session ---------------------------------------------------------------------------------
    def open(self) -> None:
        """Send ``session.created`` and open the conversation's live engine request."""
        self._emit(SessionCreated(self.id, self.config))
        live = LiveInput(max(1, self.settings.max_ahead_ms * SAMPLE_RATE // 1000))
        self._stream = self.client.open(DuplexRequest(self.new_id("dup"), live))
        self._pump = asyncio.get_running_loop().create_task(self._read(), name=f"duplex {self.id}")

    def update(self, patch: dict[str, Any]) -> None:
        config = self.config.merged(patch, limits=self.limits, voice_locked=bool(self.playback.responses))
        if config.turn_detection is not None:
            raise SessionError(
                ErrorCode.INVALID_VALUE,
                "A full-duplex session has no turn detection: turn_detection must stay null.",
                TURN_PARAM,
            )
        if config.transcription is not None:
            raise SessionError(
                ErrorCode.UNSUPPORTED,
                "Input audio transcription is not available in a full-duplex session.",
                "session.audio.input.transcription",
            )
        # Echoed but not followed, these would misstate the session: the model always speaks.
        if config.output_modalities != ["audio"]:
            raise SessionError(
                ErrorCode.UNSUPPORTED,
                "A full-duplex session always answers with audio: output_modalities must be ['audio'].",
                "session.output_modalities",
            )
        if config.tools:
            raise SessionError(
                ErrorCode.UNSUPPORTED,
                "Function calling is not available in a full-duplex session: the model calls no tools.",
                "session.tools",
            )
        if config.max_output_tokens != "inf":
            raise SessionError(
                ErrorCode.UNSUPPORTED,
                "A full-duplex session's model decides when it speaks and for how long: "
                "max_output_tokens must stay 'inf'.",
                "session.max_output_tokens",
            )
        if config.truncation != "auto":
            raise SessionError(
                ErrorCode.UNSUPPORTED,
                "A full-duplex session's model attends to a window of its latest audio, the oldest "
                "falling out as the conversation goes on: truncation is always 'auto'.",
                "session.truncation",
            )
        if self._check_sendable is not None:
            self._check_sendable(SessionUpdated(self.id, config), "session")
        if config.input_format != self.config.input_format:
            self._push(self._decoder.flush())
            self._decoder = AudioDecoder(config.input_format)
        self.config = config
        self._emit(SessionUpdated(self.id, self.config))

    async def close(self, *, notify: bool, reason: StatusReason | None = "client_cancelled") -> None:
        """End the stretch in flight (``cancelled`` with ``reason``) and the engine request; with
        ``notify``, end with ``session.closed``."""
        if self.active is not None:
            self.active.cancel(reason)
        if self._stream is not None:
            self._stream.cancel()
        if self._pump is not None:
            self._pump.cancel()
        if notify:
            self._emit(SessionClosed(self.id))
        self.closed = True
        self._emit_to = _discard
        self._check_sendable = None

    def hold(self, held: bool) -> None:
        """Hold (or release) the conversation: while held the model takes no steps (the client is
        behind reading), so its input backs up to ``max_ahead_ms`` and is refused beyond."""
        if held != self.held:
            self.held = held
            if self._stream is not None:
                self._stream.hold(held)

    # -- input -------------------------------------------------------------------------------
    def append_audio(self, data: bytes) -> None:
        fmt = self.config.input_format
        check_audio_bytes(data, fmt)
        if self.ended is not None:
            raise SessionError(
                ErrorCode.SESSION_EXPIRED, "The duplex conversation has ended; open a new session.", "audio"
            )
        # Checked before decoding (so the resampler's state does not move for dropped audio);
        # a few samples of margin for the resampler's rounding.
        samples = len(data) * SAMPLE_RATE // (1000 * bytes_per_ms(fmt)) + 64
        room = self._stream.input.room()
        if samples > room:
            raise SessionError(
                ErrorCode.INPUT_BACKPRESSURE,
                f"Input is {self.settings.max_ahead_ms} ms ahead of the model (it takes 80 ms per 80 ms "
                "of audio); this audio was dropped. Send audio no faster than real time.",
                "audio",
            )
        self._push(self._decoder.decode(data))

    def _push(self, pcm: Any) -> None:
        try:
            self._stream.push(pcm)
        except InputBackpressure as exc:
            raise SessionError(ErrorCode.INPUT_BACKPRESSURE, f"Input dropped: {exc}.", "audio") from None

    def commit_audio(self) -> None:
        raise _unsupported("input_audio_buffer.commit")

    def clear_audio(self) -> None:
        raise _unsupported("input_audio_buffer.clear")

    def create_response(self, options: ResponseOptions | None = None) -> None:
        raise _unsupported("response.create")

    def create_item(self, item: Item, previous_item_id: str | None = None) -> None:
        raise _unsupported("conversation.item.create")

    # -- items -------------------------------------------------------------------------------
    def retrieve_item(self, item_id: str) -> Item:
        item = self.conversation.get(item_id, ErrorCode.ITEM_RETRIEVE_INVALID_ID, "retrieving")
        self._emit(ItemRetrieved(item))
        return item

    def delete_item(self, item_id: str) -> None:
        self.conversation.get(item_id, ErrorCode.ITEM_DELETE_INVALID_ID, "deleting")
        self.conversation.delete(item_id)
        self._emit(ItemDeleted(item_id))

    def truncate_item(self, item_id: str, content_index: int, audio_end_ms: int) -> None:
        """Cut a stretch's item to what the user heard (allowed while it still streams)."""
        self._emit(self.playback.truncate(item_id, content_index, audio_end_ms))

    def ack_playback(self, response_id: str, item_id: str, played_ms: int) -> None:
        """``playback.ack``: as in a turn session, a finished stretch is cut at ``played_ms`` at
        once; one still streaming is cut there if it is then cancelled."""
        streaming = self.active is not None and self.active.id == response_id
        self._emit(self.playback.ack(response_id, item_id, played_ms, streaming=streaming))

    # -- responses ---------------------------------------------------------------------------
    def cancel_response(self, response_id: str | None = None) -> None:
        run = self.active
        if run is None or (response_id and response_id != run.id):
            which = f" with id '{response_id}'" if response_id else ""
            raise SessionError(
                ErrorCode.CANCEL_NOT_ACTIVE,
                f"Cancellation failed: no active response{which}.",
                "response_id" if response_id else None,
            )
        self._muted = True  # the rest of what the model says in this stretch is not sent
        run.cancel("client_cancelled")

    # -- the model's output ------------------------------------------------------------------
    async def _read(self) -> None:
        stream = self._stream
        try:
            async for output in stream:
                if self.closed:
                    return
                if isinstance(output, TextDelta):
                    self._frame_text += output.text
                elif isinstance(output, AudioDelta):
                    self._frame(output)
                elif isinstance(output, Finished):
                    self._end(output)
        except Exception:  # a bug here must not leave the client waiting in silence
            log.exception("duplex session %s: output failed", self.id)
            stream.cancel()
            self._end(Finished("error", Usage(), "internal error"))

    def _frame(self, audio: AudioDelta) -> None:
        text, self._frame_text = self._frame_text, ""
        decision = self._stretches.frame(text, audio.pcm)
        if self._muted:
            if decision == "end":
                self._muted = False
            return
        if decision == "idle":
            return
        if decision == "start":
            self._start(audio.text_chars - len(text))
        run = self.active
        assert run is not None
        if text:
            run.feed(TextDelta(text))
        run.feed(AudioDelta(audio.pcm, audio.text_chars - self._base_chars))
        self._usage.output_audio_tokens += 1
        self._usage.output_text_tokens += 1 if text else 0
        if decision == "end":
            run.feed(Finished("stop", self._usage))

    def _start(self, base_chars: int) -> None:
        self._make_room()
        cfg = self.config
        response = Response(
            id=self.new_id("resp"),
            conversation_id=self.conversation.id,
            output_modalities=["audio"],
            max_output_tokens="inf",
            voice=cfg.voice,
            output_format=cfg.output_format,
        )
        run = StretchRun(
            response,
            GenerationRequest(response.id, []),
            client=self.client,  # type: ignore[arg-type]  # never submitted to
            emit=self._emit,
            new_id=self.new_id,
            conversation=self.conversation,
            on_audio=_nothing,
            on_done=self._on_done,
        )
        self.active = run
        self._base_chars = base_chars
        self._usage = Usage()
        self.playback.track(response)
        run.start()

    def _make_room(self) -> None:
        """Drops the oldest items while a new stretch would pass the conversation caps."""
        limits = self.limits
        while len(self.conversation) and (
            len(self.conversation) + 1 > limits.max_items
            or self.conversation.bytes_held > limits.max_conversation_bytes
        ):
            oldest = next(iter(self.conversation))
            self.conversation.delete(oldest.id)
            self._emit(ItemDeleted(oldest.id))

    def _on_done(self, run: ResponseRun) -> None:
        self.playback.settle(run.response)  # cancelled: history keeps what the last ack said was heard
        if self.active is run:
            self.active = None

    def _end(self, finished: Finished) -> None:
        """The engine request ended (its input ended, a server limit, an error)."""
        self.ended = finished
        if self.active is not None:
            self.active.feed(Finished(finished.reason, self._usage, finished.error, finished.code))
        if finished.reason == "error":
            overloaded = finished.code == "overloaded"
            self._emit(
                ErrorReported(
                    ErrorCode.RESOURCE_EXHAUSTED if overloaded else ErrorCode.SERVER_ERROR,
                    f"The duplex conversation stopped: {finished.error or 'server error'}.",
                    None,
                    "server_error",
                )
            )


def _nothing() -> None:
    """Duplex voices never change (nothing to lock when audio is produced)."""


def _discard(event: SessionEvent) -> None:
    """Where a closed session's events go."""



