"""The server VAD turn policy: a session's :class:`~omnirt.vad.stream.VadStream` plus endpointing.

Decisions arrive on the event loop (the VAD worker posts them) and become :class:`TurnSignal`
calls into the session. The idle timeout is armed by the session (after a response's audio has
played, or after speech stopped without a response) and fires once while no speech is heard.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from omnirt.codecs.audio import SAMPLE_RATE
from omnirt.vad.endpointing import Endpointer, SpeechStart, SpeechStop
from omnirt.vad.model import WINDOW_MS, VadInitError
from omnirt.vad.worker import VadWorker

from .errors import ErrorCode, SessionError
from .turns import TURN_PARAM, TurnSignal, VadSettings


class ServerVadTurns:
    def __init__(
        self,
        settings: VadSettings,
        worker: VadWorker | None,
        *,
        base_sample: int,
        on_signal: Callable[[TurnSignal], None],
    ) -> None:
        if worker is None:
            raise SessionError(
                ErrorCode.SERVER_VAD_INIT_FAILED,
                "Server VAD is not available on this server.",
                TURN_PARAM,
                type="server_error",
            )
        self.settings = settings
        self.endpointer = Endpointer(settings.threshold, settings.silence_duration_ms)
        #: Session audio time (ms) of the stream's first sample.
        self.base_ms = base_sample * 1000 // SAMPLE_RATE
        self._on_signal = on_signal
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

    def on_audio(self, pcm: np.ndarray) -> None:
        self.stream.push(pcm)

    def arm_idle(self, since_ms: int) -> None:
        if self.settings.idle_timeout_ms is not None:
            self.idle_since_ms = since_ms

    def disarm_idle(self) -> None:
        self.idle_since_ms = None

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

    def reset(self) -> None:
        self.endpointer.reset()

    def close(self) -> None:
        """Close the stream and drop the session's callback (no cycle outlives the session)."""
        self.stream.close()
        self._on_signal = _ignore


def _ignore(signal: TurnSignal) -> None:
    """The signal callback once the policy is closed."""
