"""Turn policies: who decides when the user's turn ends and a response starts.

Manual turns (``turn_detection: null``) leave it to the client: ``input_audio_buffer.commit`` and
``response.create``. Server VAD, push-to-talk and duplex plug in here as other policies: a policy
sees every chunk of appended audio and answers with what the session should do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np

from .errors import ErrorCode, SessionError


@dataclass(frozen=True)
class TurnSignal:
    """What a policy asks the session to do after some input audio."""

    kind: Literal["speech_started", "speech_stopped", "commit", "create_response", "interrupt"]
    audio_ms: int = 0


class TurnPolicy(Protocol):
    name: str

    def on_audio(self, pcm: np.ndarray) -> list[TurnSignal]:
        """Called with each appended chunk (float32, 24 kHz)."""
        ...

    def reset(self) -> None: ...


class ManualTurns:
    """The client commits and asks for responses itself."""

    name = "manual"

    def on_audio(self, pcm: np.ndarray) -> list[TurnSignal]:
        return []

    def reset(self) -> None:
        pass


def policy_for(turn_detection: dict[str, Any] | None) -> TurnPolicy:
    if not turn_detection:
        return ManualTurns()
    raise SessionError(
        ErrorCode.INVALID_VALUE,
        f"turn_detection type '{turn_detection.get('type')}' is not available yet; use null (manual turns).",
        "session.audio.input.turn_detection",
    )
