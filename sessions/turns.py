"""Turn policies: who decides when the user's turn ends and a response starts.

- Manual turns (``turn_detection: null``): the client commits and asks for responses itself.
- Server VAD (``server_vad``; ``semantic_vad`` is mapped onto it, see :func:`effective_turn_detection`):
  :class:`~omnirt.sessions.server_vad.ServerVadTurns` scores the input with Silero and signals
  speech start/stop and idle timeouts back to the session asynchronously.
- Push-to-talk is manual turns plus a connection flag (``?turn=push_to_talk``) that makes the
  session drop audio appended while a reply is in progress (``RealtimeSession.push_to_talk``).

A policy sees every appended chunk (``on_audio``) and is told when an in-conversation response
starts and ends; the session asks it what input audio it must keep and whether it takes more. The
session never looks inside a policy: what a policy decides on its own (server VAD's speech and idle
signals) it carries out through the :class:`TurnHost` it was built with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

if TYPE_CHECKING:
    from .events import SessionEvent
    from .input_buffer import InputAudioBuffer

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


@dataclass(frozen=True)
class TurnHost:
    """What a policy that decides turns itself may do to its session (callbacks into it)."""

    #: The session's input audio buffer (session audio time is its sample count).
    input: InputAudioBuffer
    new_id: Callable[[str], str]
    emit: Callable[[SessionEvent], None]
    #: Whether an in-conversation response is in progress.
    responding: Callable[[], bool]
    #: Barge-in: cancel the in-conversation response (reason ``turn_detected``).
    interrupt: Callable[[], None]
    #: ``(item_id, audio, respond)``: add the user's turn as an audio item (and create a response
    #: when ``respond``); False when the conversation had no room (the client was told).
    add_turn: Callable[[str, np.ndarray, bool], bool]


class TurnPolicy(Protocol):
    def check_append(self) -> None:
        """Before a chunk is appended: raises :class:`SessionError` when the policy cannot take
        more audio now (nothing has changed)."""
        ...

    def on_audio(self, pcm: np.ndarray) -> None:
        """Called with each appended chunk (float32, 24 kHz)."""
        ...

    def keep_from_ms(self) -> int | None:
        """After a chunk: the session audio time before which the input buffer may be dropped
        (None: keep everything)."""
        ...

    def speech_item_id(self) -> str | None:
        """The id already announced (``speech_started``) for the speech in progress, which a
        commit of the buffer takes; None when there is none."""
        ...

    def on_response_started(self) -> None:
        """An in-conversation response was created."""
        ...

    def on_response_done(self, audio_ms: int) -> None:
        """The in-conversation response ended, having produced ``audio_ms`` of audio."""
        ...

    def reset(self) -> None:
        """The buffer was committed or cleared: forget the speech in progress."""
        ...

    def close(self) -> None: ...


class ManualTurns:
    """The client commits and asks for responses itself: every hook is a no-op."""

    def check_append(self) -> None:
        pass

    def on_audio(self, pcm: np.ndarray) -> None:
        pass

    def keep_from_ms(self) -> int | None:
        return None

    def speech_item_id(self) -> str | None:
        return None

    def on_response_started(self) -> None:
        pass

    def on_response_done(self, audio_ms: int) -> None:
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
