"""The TurnPolicy hooks the session calls, for both policies: ManualTurns does nothing in each,
ServerVadTurns acts on its own stream's decisions through the session's TurnHost. The VAD stream is
a stand-in that delivers the probabilities a test chooses (the endpointer and policy are real)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from omnirt.sessions import events as ev
from omnirt.sessions.errors import ErrorCode, SessionError
from omnirt.sessions.input_buffer import InputAudioBuffer
from omnirt.sessions.server_vad import TRIM_SLACK_MS, ServerVadTurns
from omnirt.sessions.turns import ManualTurns, TurnHost, VadSettings
from omnirt.vad.model import WINDOW_MS

SPEECH, SILENCE = 0.9, 0.0


class FakeStream:
    def __init__(self, on_result: Callable[[int, float], None]) -> None:
        self.on_result = on_result
        self.samples_pushed = 0
        self.windows_decided = 0
        self.closed = False

    @property
    def backlog_ms(self) -> int:
        return max(0, self.samples_pushed * 1000 // 24_000 - self.windows_decided * WINDOW_MS)

    def push(self, pcm: np.ndarray) -> None:
        self.samples_pushed += len(pcm)

    def deliver(self, probs: list[float]) -> None:
        for prob in probs:
            self.windows_decided += 1
            if not self.closed:
                self.on_result(self.windows_decided - 1, prob)

    def close(self) -> None:
        self.closed = True


class FakeWorker:
    def open_stream(self, on_result: Callable[[int, float], None]) -> FakeStream:
        self.stream = FakeStream(on_result)
        return self.stream


class Host:
    """Records what a policy does to its session."""

    def __init__(self) -> None:
        self.input = InputAudioBuffer("audio/pcm", max_bytes=10**9)
        self.events: list[Any] = []
        self.turns: list[tuple[str, int, bool]] = []
        self.interrupts = 0
        self.replying = False
        counter = itertools.count()
        self.host = TurnHost(
            input=self.input,
            new_id=lambda prefix: f"{prefix}_{next(counter)}",
            emit=self.events.append,
            responding=lambda: self.replying,
            interrupt=self._interrupt,
            add_turn=self._add_turn,
        )

    def _interrupt(self) -> None:
        self.interrupts += 1

    def _add_turn(self, item_id: str, audio: np.ndarray, respond: bool) -> bool:
        self.turns.append((item_id, len(audio), respond))
        return True

    def append_ms(self, ms: int) -> np.ndarray:
        return self.input.append(bytes(2 * 24 * ms))


def vad(host: Host, **settings: Any) -> tuple[ServerVadTurns, FakeStream]:
    worker = FakeWorker()
    policy = ServerVadTurns(VadSettings(**settings), worker, host=host.host, max_backlog_ms=100)  # type: ignore[arg-type]
    return policy, worker.stream


def test_check_append_refuses_while_the_vad_is_behind() -> None:
    ManualTurns().check_append()
    host = Host()
    policy, stream = vad(host)
    policy.on_audio(host.append_ms(200))
    with pytest.raises(SessionError) as exc:
        policy.check_append()
    assert (exc.value.code, exc.value.param) == (ErrorCode.INPUT_BACKPRESSURE, "audio")
    assert "200 ms behind" in exc.value.message and stream.samples_pushed == 200 * 24
    stream.deliver([SILENCE] * 4)  # 128 ms decided: 72 ms behind
    policy.check_append()


def test_keep_from_ms_trims_silence_to_the_prefix_padding_but_not_speech() -> None:
    assert ManualTurns().keep_from_ms() is None
    host = Host()
    policy, stream = vad(host, prefix_padding_ms=300)
    policy.on_audio(host.append_ms(800))
    stream.deliver([SILENCE] * 20)
    assert policy.keep_from_ms() == 20 * WINDOW_MS - 300 - TRIM_SLACK_MS
    stream.deliver([SPEECH])
    assert policy.keep_from_ms() is None


def test_speech_item_id_is_the_announced_item_until_reset() -> None:
    assert ManualTurns().speech_item_id() is None
    host = Host()
    policy, stream = vad(host, silence_duration_ms=96)
    policy.on_audio(host.append_ms(1000))
    assert policy.speech_item_id() is None
    stream.deliver([SILENCE] * 10 + [SPEECH] * 3)
    started = host.events[-1]
    assert isinstance(started, ev.SpeechStarted) and started.audio_start_ms == 320 - 300
    assert policy.speech_item_id() == started.item_id
    policy.reset()  # a commit took the buffer
    assert policy.speech_item_id() is None
    stream.deliver([SILENCE] * 5)
    assert host.turns == [] and len(host.events) == 1


def test_speech_stop_adds_the_turn_and_responds_unless_replying() -> None:
    host = Host()
    policy, stream = vad(host, prefix_padding_ms=64, silence_duration_ms=96)
    policy.on_audio(host.append_ms(1000))
    host.replying = True
    stream.deliver([SILENCE] * 4 + [SPEECH] * 6 + [SILENCE] * 3)
    started, stopped = host.events
    assert host.interrupts == 1  # barge-in
    assert isinstance(stopped, ev.SpeechStopped) and stopped.audio_end_ms == 320
    assert stopped.item_id == started.item_id
    # From the onset less the prefix padding to the speech end; no response while replying.
    assert host.turns == [(started.item_id, (320 - (128 - 64)) * 24, False)]
    host.replying = False
    stream.deliver([SPEECH] * 2 + [SILENCE] * 3)
    assert host.turns[-1][2] is True and host.interrupts == 1


def idle_policy(host: Host) -> tuple[ServerVadTurns, FakeStream]:
    policy, stream = vad(host, idle_timeout_ms=320)
    policy.on_audio(host.append_ms(400))
    return policy, stream


def test_idle_timeout_is_armed_from_the_start() -> None:
    host = Host()
    policy, stream = idle_policy(host)
    stream.deliver([SILENCE] * 9)
    assert host.events == []
    stream.deliver([SILENCE])
    (timeout,) = host.events
    assert isinstance(timeout, ev.TimeoutTriggered)
    assert (timeout.audio_start_ms, timeout.audio_end_ms) == (0, 320)
    assert host.turns == [(timeout.item_id, 320 * 24, True)]


def test_on_response_started_disarms_the_idle_timeout() -> None:
    ManualTurns().on_response_started()
    host = Host()
    policy, stream = idle_policy(host)
    policy.on_response_started()
    stream.deliver([SILENCE] * 20)
    assert host.events == [] and host.turns == []


def test_on_response_done_arms_the_idle_timeout_after_the_reply_played() -> None:
    ManualTurns().on_response_done(200)
    host = Host()
    policy, stream = idle_policy(host)
    policy.on_response_started()
    policy.on_response_done(200)  # input ends at 400 ms: idle from 600 ms
    policy.on_audio(host.append_ms(600))
    stream.deliver([SILENCE] * 28)  # to 896 ms
    assert host.events == []
    stream.deliver([SILENCE])
    (timeout,) = host.events
    assert (timeout.audio_start_ms, timeout.audio_end_ms) == (600, 928)
    assert host.turns == [(timeout.item_id, (928 - 600) * 24, True)]


def test_a_closed_policy_does_nothing() -> None:
    host = Host()
    policy, stream = vad(host)
    policy.on_audio(host.append_ms(400))
    policy.close()
    policy.on_response_done(0)
    assert stream.closed
    stream.on_result(0, SPEECH)  # a result already on its way
    assert host.events == [] and host.interrupts == 0
