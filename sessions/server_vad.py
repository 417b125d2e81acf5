"""The server VAD turn policy: a session's :class:`~omnirt.vad.stream.VadStream` plus endpointing.

Decisions arrive on the event loop (the VAD worker posts them) as :class:`TurnSignal` and are
carried out here through the session's :class:`TurnHost`: speech start announces the user item
(and interrupts the reply), speech stop commits the speech as that item and creates a response,
and the idle timeout commits what was heard since and responds. The idle timeout is armed when
the policy starts, after a response's audio has played, or after speech stopped without a
response, and fires once while no speech is heard.
"""

from __future__ import annotations

import numpy as np
from omnirt.codecs.audio import SAMPLE_RATE
from omnirt.vad.endpointing import Endpointer, SpeechStart, SpeechStop
from omnirt.vad.model import WINDOW_MS, VadInitError
from omnirt.vad.worker import VadWorker

from .errors import ErrorCode, SessionError
from .events import SpeechStarted, SpeechStopped, TimeoutTriggered
from .turns import TURN_PARAM, TurnHost, TurnSignal, VadSettings

#: Silence kept before the prefix padding (ms) when the input buffer is trimmed.
TRIM_SLACK_MS = 64


class ServerVadTurns:
    def __init__(
        self,
        settings: VadSettings,
        worker: VadWorker | None,
        *,
        host: TurnHost,
        max_backlog_ms: int,
    ) -> None:
        if worker is None:
            raise SessionError(
                ErrorCode.SERVER_VAD_INIT_FAILED,
                "Server VAD is not available on this server.",
                TURN_PARAM,
                type="server_error",
            )
        self.settings = settings
        self.max_backlog_ms = max_backlog_ms
        self.endpointer = Endpointer(settings.threshold, settings.silence_duration_ms)
        self._host: TurnHost | None = host
        #: Session audio time (ms) of the stream's first sample.
        self.base_ms = host.input.end * 1000 // SAMPLE_RATE
        #: The user item the speech in progress will be committed as, and its first sample.
        self.speech: tuple[str, int] | None = None
        self.idle_since_ms: int | None = None
        try:
            self.stream = worker.open_stream(self._on_result)
        except VadInitError as exc:
            raise SessionError(
                ErrorCode.SERVER_VAD_INIT_FAILED,
                f"Server VAD could not be initialized: {exc}",
                TURN_PARAM,
                type="server_error",
            ) from None
        self.arm_idle(host.input.end_ms)

    @property
    def speaking(self) -> bool:
        return self.endpointer.speaking

    @property
    def decided_ms(self) -> int:
        """Session audio time up to which the VAD has decided."""
        return self.base_ms + self.stream.windows_decided * WINDOW_MS

    @property
    def backlog_ms(self) -> int:
        """Audio appended but not yet scored (how far the VAD is behind the input)."""
        return self.stream.backlog_ms

    # -- TurnPolicy ---------------------------------------------------------------------------
    def check_append(self) -> None:
        if self.backlog_ms > self.max_backlog_ms:
            raise SessionError(
                ErrorCode.INPUT_BACKPRESSURE,
                f"Server VAD is {self.backlog_ms} ms behind the input (limit "
                f"{self.max_backlog_ms} ms); send audio no faster than real time.",
                "audio",
            )

    def on_audio(self, pcm: np.ndarray) -> None:
        self.stream.push(pcm)

    def keep_from_ms(self) -> int | None:
        if self.speech is not None:
            return None
        # Silence is not kept: only what prefix padding may still need.
        return self.decided_ms - self.settings.prefix_padding_ms - TRIM_SLACK_MS

    def speech_item_id(self) -> str | None:
        return self.speech[0] if self.speech is not None else None

    def on_response_started(self) -> None:
        self.idle_since_ms = None

    def on_response_done(self, audio_ms: int) -> None:
        if self._host is not None:
            # Idle time counts from when the reply's audio has finished playing.
            self.arm_idle(self._host.input.end_ms + audio_ms)

    def reset(self) -> None:
        self.endpointer.reset()
        self.speech = None

    def close(self) -> None:
        """Close the stream and drop the session's callbacks (no cycle outlives the session)."""
        self.stream.close()
        self._host = None

    # -- idle timeout -------------------------------------------------------------------------
    def arm_idle(self, since_ms: int) -> None:
        if self.settings.idle_timeout_ms is not None:
            self.idle_since_ms = since_ms

    # -- decisions ----------------------------------------------------------------------------
    def _on_result(self, index: int, prob: float) -> None:
        decision = self.endpointer.step(index, prob)
        if isinstance(decision, SpeechStart):
            self.idle_since_ms = None
            self._on_signal(TurnSignal("speech_started", self.base_ms + decision.onset_ms))
        elif isinstance(decision, SpeechStop):
            self._on_signal(TurnSignal("speech_stopped", self.base_ms + decision.end_ms))
        elif not self.speaking and self.idle_since_ms is not None:
            now = self.base_ms + self.endpointer.position_ms
            assert self.settings.idle_timeout_ms is not None
            since = self.idle_since_ms
            if now - since >= self.settings.idle_timeout_ms:
                self.idle_since_ms = None
                self._on_signal(TurnSignal("timeout", now, start_ms=since))

    def _on_signal(self, signal: TurnSignal) -> None:
        host = self._host
        if host is None:  # closed
            return
        settings = self.settings
        buffer = host.input
        if signal.kind == "speech_started":
            start_ms = max(signal.audio_ms - settings.prefix_padding_ms, buffer.start_ms)
            item_id = host.new_id("item")
            self.speech = (item_id, buffer.ms_to_sample(start_ms))
            host.emit(SpeechStarted(start_ms, item_id))
            if settings.interrupt_response and host.responding():
                host.interrupt()
        elif signal.kind == "speech_stopped":
            if self.speech is None:  # committed or cleared by the client meanwhile
                return
            item_id, start = self.speech
            self.speech = None
            host.emit(SpeechStopped(signal.audio_ms, item_id))
            audio = buffer.take(start, buffer.ms_to_sample(signal.audio_ms))
            respond = settings.create_response and not host.responding()
            if host.add_turn(item_id, audio, respond) and not respond:
                self.arm_idle(signal.audio_ms)
        elif signal.kind == "timeout":
            if host.responding():
                return
            item_id = host.new_id("item")
            start_ms = min(signal.start_ms, signal.audio_ms)
            host.emit(TimeoutTriggered(start_ms, signal.audio_ms, item_id))
            # What is still held of the silent segment (silence is trimmed to the prefix padding).
            audio = buffer.take(buffer.ms_to_sample(start_ms), buffer.ms_to_sample(signal.audio_ms))
            host.add_turn(item_id, audio, True)
