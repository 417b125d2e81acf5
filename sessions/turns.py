"""Turn policies: who decides when the user's turn ends and a response starts.

- Manual turns (``turn_detection: null``): the client commits and asks for responses itself.
- Server VAD (``server_vad``; ``semantic_vad`` is mapped onto it, see :func:`effective_turn_detection`):
  :class:`~omnirt.sessions.server_vad.ServerVadTurns` scores the input with Silero and signals
  speech start/stop and idle timeouts back to the session asynchronously.
- Push-to-talk is manual turns plus a connection flag (``?turn=push_to_talk``) that makes the
  session drop audio appended while a reply is in progress (``RealtimeSession.push_to_talk``).

A policy sees every appended chunk (``on_audio``); its decisions arrive as :class:`TurnSignal`
through the callback it was built with.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol

import numpy as np

TURN_PARAM = "session.audio.input.turn_detection"

#: ``semantic_vad`` has no semantic model here: its eagerness picks a silence duration.
SEMANTIC_SILENCE_MS = {"low": 1200, "medium": 700, "auto": 700, "high": 350}

@dataclass(frozen=True)
class TurnSignal:
    """What a policy asks the session to do. ``audio_ms`` is session audio time:
    the speech onset (``speech_started``, before prefix padding), the speech end
    (``speech_stopped``), or the time the idle timeout fired (``timeout``)."""

    kind: Literal["speech_started", "speech_stopped", "timeout"]
    audio_ms: int = 0
    #: ``timeout``: where the idle period began.
    start_ms: int = 0


@dataclass(frozen=True)
class VadSettings:
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True
    idle_timeout_ms: int | None = None


#: The ``server_vad`` fields a ``turn_detection`` may leave out, and their values (in field order).
SERVER_VAD_DEFAULTS: dict[str, Any] = asdict(VadSettings())


class TurnPolicy(Protocol):
    def on_audio(self, pcm: np.ndarray) -> None:
        """Called with each appended chunk (float32, 24 kHz)."""
        ...

    def reset(self) -> None: ...

    def close(self) -> None: ...


class ManualTurns:
    """The client commits and asks for responses itself."""

    def on_audio(self, pcm: np.ndarray) -> None:
        pass

    def reset(self) -> None:
        pass

    def close(self) -> None:
        pass


def effective_turn_detection(td: dict[str, Any] | None) -> dict[str, Any] | None:
    """The full ``turn_detection`` the session reports, defaults filled in (the shape was
    validated against the GA types in ``realtime/protocol``)."""
    if not td:
        return None
    if td.get("type") == "semantic_vad":
        return {
            "type": "semantic_vad",
            "eagerness": td.get("eagerness") or "auto",
            "create_response": True if td.get("create_response") is None else td["create_response"],
            "interrupt_response": True if td.get("interrupt_response") is None else td["interrupt_response"],
        }
    out: dict[str, Any] = {"type": "server_vad"}
    for name, default in SERVER_VAD_DEFAULTS.items():
        value = td.get(name)
        out[name] = default if value is None else value
    return out


def vad_settings(td: dict[str, Any]) -> VadSettings:
    """Endpointing settings of an effective ``turn_detection`` (server or semantic VAD)."""
    if td["type"] == "semantic_vad":
        return VadSettings(
            silence_duration_ms=SEMANTIC_SILENCE_MS[td["eagerness"]],
            create_response=td["create_response"],
            interrupt_response=td["interrupt_response"],
        )
    return VadSettings(
        threshold=float(td["threshold"]),
        prefix_padding_ms=int(td["prefix_padding_ms"]),
        silence_duration_ms=int(td["silence_duration_ms"]),
        create_response=bool(td["create_response"]),
        interrupt_response=bool(td["interrupt_response"]),
        idle_timeout_ms=td["idle_timeout_ms"],
    )
