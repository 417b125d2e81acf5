"""Server VAD over a real WebSocket: endpoints on real speech, no turns on noise, settings,
initialization failure, idle timeout. Every frame is validated strictly (conftest)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator

import numpy as np
import pytest
from omnirt.codecs.audio import float_to_int16, mulaw_encode, resample
from omnirt.realtime.config import ServerConfig
from omnirt.stages.types import AudioPart

from tests.vad.speech import RATE, SENTENCES, full_windows, hum, non_speech, place, spoken, to_pcm16

from .conftest import Server, b64, connect, run, running, wait_until
from .vad_helpers import kinds, stream_audio, vad_update

SERVER_VAD_TURN = [
    "input_audio_buffer.speech_started",
    "input_audio_buffer.speech_stopped",
    "input_audio_buffer.committed",
    "conversation.item.added",
    "conversation.item.done",
    "response.created",
]


@pytest.fixture(scope="module")
def broken_vad(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    bad = tmp_path_factory.mktemp("vad") / "silero_vad.onnx"
    bad.write_bytes(b"\x08\x07garbage, not a model")
    with running(ServerConfig(vad_model_path=str(bad))) as s:
        yield s


def test_speech_turn_endpoints_within_200_ms_and_a_response(server: Server) -> None:
    """Real speech (espeak-ng) placed 1 s into noisy silence: speech_started / speech_stopped /
    committed share one item_id; audio_start_ms (which includes the 300 ms prefix padding) and
    audio_end_ms are within 200 ms of the true boundaries; create_response starts a reply whose
    request holds exactly the committed audio."""
    placed = place(spoken(SENTENCES[0]), lead_ms=1000, tail_ms=1200, noise_db=-45)

    async def main() -> tuple[dict, list[dict]]:
        async with connect(server) as c:
            await c.send(vad_update())
            updated = (await c.until("session.updated"))[-1]
            await stream_audio(c, placed.pcm16())
            return updated, await c.until("response.done")

    updated, events = run(main())
    assert updated["session"]["audio"]["input"]["turn_detection"] == {
        "type": "server_vad",
        "threshold": 0.5,
        "prefix_padding_ms": 300,
        "silence_duration_ms": 500,
        "create_response": True,
        "interrupt_response": True,
        "idle_timeout_ms": None,
    }
    assert kinds(events)[: len(SERVER_VAD_TURN)] == SERVER_VAD_TURN
    started, stopped, committed, added = events[:4]
    item_id = started["item_id"]
    assert stopped["item_id"] == committed["item_id"] == added["item"]["id"] == item_id
    assert abs(started["audio_start_ms"] + 300 - placed.start_ms) <= 200, (started, placed)
    assert abs(stopped["audio_end_ms"] - placed.end_ms) <= 200, (stopped, placed)
    assert events[-1]["response"]["status"] == "completed"
    request = server.pipeline.requests[-1]
    (audio,) = [p for m in request.messages for p in m.parts if isinstance(p, AudioPart)]
    expected = (stopped["audio_end_ms"] - started["audio_start_ms"]) * RATE // 1000
    assert abs(len(audio.pcm) - expected) <= RATE // 100


def test_two_turns_count_time_from_the_first_sample(server: Server) -> None:
    """Times are session audio time: the second utterance's boundaries are offset by all audio sent
    before it (including audio sent before server VAD was turned on)."""
    first = place(spoken(SENTENCES[1]), lead_ms=500, tail_ms=900)
    second = place(spoken(SENTENCES[1]), lead_ms=700, tail_ms=900, seed=3)
    before_ms = 400

    async def main() -> list[dict]:
        async with connect(server) as c:
            await stream_audio(c, to_pcm16(np.zeros(RATE * before_ms // 1000, np.float32)))
            await c.send(vad_update(create_response=False, silence_duration_ms=400))
            await c.until("session.updated")
            await stream_audio(c, first.pcm16())
            await stream_audio(c, second.pcm16())
            events = await c.until("input_audio_buffer.committed")
            return events + await c.until("input_audio_buffer.committed")

    events = run(main())
    started = [e for e in events if e["type"] == "input_audio_buffer.speech_started"]
    stopped = [e for e in events if e["type"] == "input_audio_buffer.speech_stopped"]
    assert len(started) == len(stopped) == 2
    assert "response.created" not in kinds(events)  # create_response false
    offset = before_ms + len(first.audio) * 1000 / RATE
    assert abs(started[0]["audio_start_ms"] + 300 - (before_ms + first.start_ms)) <= 200
    assert abs(stopped[0]["audio_end_ms"] - (before_ms + first.end_ms)) <= 200
    assert abs(started[1]["audio_start_ms"] + 300 - (offset + second.start_ms)) <= 200
    assert abs(stopped[1]["audio_end_ms"] - (offset + second.end_ms)) <= 200
    assert started[0]["item_id"] != started[1]["item_id"]


@pytest.mark.parametrize("signal", non_speech(2000))
def test_no_turn_on_hum_noise_or_silence(server: Server, signal: np.ndarray) -> None:
    """2 s of each is scored (all its windows decided), and no speech event or response follows."""
    vad = server.service.vad

    async def main() -> list[dict]:
        async with connect(server) as c:
            await c.send(vad_update())
            await c.until("session.updated")
            before = vad.stats.windows
            await stream_audio(c, to_pcm16(signal))
            expected = full_windows(len(signal)) - 2
            assert await asyncio.to_thread(wait_until, lambda: vad.stats.windows - before >= expected)
            await asyncio.sleep(0.05)
            await c.send({"type": "input_audio_buffer.clear"})
            return await c.until("input_audio_buffer.cleared")

    assert kinds(run(main())) == ["input_audio_buffer.cleared"]


def test_semantic_vad_is_accepted_and_runs_as_server_vad(server: Server) -> None:
    """semantic_vad is echoed as the client set it (defaults filled) and detects speech with the
    eagerness' silence duration (high: 350 ms)."""
    placed = place(spoken(SENTENCES[1]), lead_ms=600, tail_ms=800)

    async def main() -> tuple[dict, list[dict]]:
        async with connect(server) as c:
            await c.send(
                {
                    "type": "session.update",
                    "session": {
                        "type": "realtime",
                        "audio": {"input": {"turn_detection": {"type": "semantic_vad", "eagerness": "high"}}},
                    },
                }
            )
            updated = (await c.until("session.updated"))[-1]
            await stream_audio(c, placed.pcm16())
            return updated, await c.until("response.done")

    updated, events = run(main())
    assert updated["session"]["audio"]["input"]["turn_detection"] == {
        "type": "semantic_vad",
        "eagerness": "high",
        "create_response": True,
        "interrupt_response": True,
    }
    assert kinds(events)[: len(SERVER_VAD_TURN)] == SERVER_VAD_TURN


def test_turn_detection_shapes_are_validated(server: Server) -> None:
    """Each bad shape gets an error naming the field (OpenAI's codes); the session keeps the
    turn detection it had (the default server VAD)."""
    bad = [
        ({"type": "push_to_talk"}, "invalid_value", "session.audio.input.turn_detection"),
        ({"threshold": 0.5}, "invalid_value", "session.audio.input.turn_detection"),
        (
            {"type": "server_vad", "threshold": -0.1},
            "decimal_below_min_value",
            "session.audio.input.turn_detection.threshold",
        ),
        (
            {"type": "server_vad", "idle_timeout_ms": 50},
            "integer_below_min_value",
            "session.audio.input.turn_detection.idle_timeout_ms",
        ),
        (
            {"type": "server_vad", "silence_duration_ms": "long"},
            "invalid_type",
            "session.audio.input.turn_detection.silence_duration_ms",
        ),
        (
            {"type": "server_vad", "eagerness": "low"},
            "unknown_parameter",
            "session.audio.input.turn_detection.eagerness",
        ),
        (
            {"type": "semantic_vad", "eagerness": "eager"},
            "invalid_value",
            "session.audio.input.turn_detection.eagerness",
        ),
        (
            {"type": "semantic_vad", "threshold": 0.5},
            "unknown_parameter",
            "session.audio.input.turn_detection.threshold",
        ),
    ]

    async def main() -> tuple[list[dict], dict]:
        async with connect(server) as c:
            errors = []
            for td, _, _ in bad:
                await c.send(
                    {"type": "session.update", "session": {"audio": {"input": {"turn_detection": td}}}}
                )
                errors.append(await c.error())
            await c.send({"type": "session.update", "session": {"type": "realtime"}})
            return errors, (await c.until("session.updated"))[-1]

    errors, updated = run(main())
    assert [(e["code"], e["param"]) for e in errors] == [(code, param) for _, code, param in bad]
    assert updated["session"]["audio"]["input"]["turn_detection"]["type"] == "server_vad"
    assert updated["session"]["audio"]["input"]["turn_detection"]["silence_duration_ms"] == 500


def test_broken_vad_model_is_an_error_not_a_crash(broken_vad: Server) -> None:
    """With the VAD model file broken, a new session cannot have its default server VAD: it starts
    with manual turns (session.created says turn_detection null) and an error
    server_vad_initialization_failed follows session.created. Turning server VAD on gets the same
    error; the session stays in manual turns and still serves a manual turn."""

    async def main() -> tuple[dict, dict, dict, dict, list[dict]]:
        async with connect(broken_vad) as c:
            created = c.events[0]
            at_open = await c.error()
            await c.send({**vad_update(), "event_id": "evt_vad"})
            error = await c.error()
            await c.send({"type": "session.update", "session": {"type": "realtime"}})
            updated = (await c.until("session.updated"))[-1]
            await stream_audio(c, to_pcm16(hum(300, 200)))
            await c.send({"type": "input_audio_buffer.commit"})
            await c.send({"type": "response.create"})
            return created, at_open, error, updated, await c.until("response.done")

    created, at_open, error, updated, events = run(main())
    assert created["session"]["audio"]["input"]["turn_detection"] is None
    assert (at_open["code"], at_open["type"], at_open["event_id"]) == (
        "server_vad_initialization_failed",
        "server_error",
        None,
    )
    assert (error["code"], error["param"], error["event_id"]) == (
        "server_vad_initialization_failed",
        "session.audio.input.turn_detection",
        "evt_vad",
    )
    # The cause, without the model file's path (kept in the log: issue 16, exposure).
    assert "cannot load the VAD model <path>" in error["message"] and "/tmp/" not in error["message"]
    assert updated["session"]["audio"]["input"]["turn_detection"] is None
    assert events[0]["type"] == "input_audio_buffer.committed"
    assert events[-1]["response"]["status"] == "completed"


def test_idle_timeout_commits_the_silence_and_responds(server: Server) -> None:
    """idle_timeout_ms 600 and only silence: input_audio_buffer.timeout_triggered (a segment of
    about 600 ms of audio time), committed with its item_id, then a response."""

    async def main() -> list[dict]:
        async with connect(server) as c:
            await c.send(vad_update(idle_timeout_ms=600))
            await c.until("session.updated")
            await stream_audio(c, to_pcm16(np.zeros(RATE * 2, np.float32)))
            return await c.until("response.done")

    events = run(main())
    assert kinds(events)[:5] == [
        "input_audio_buffer.timeout_triggered",
        "input_audio_buffer.committed",
        "conversation.item.added",
        "conversation.item.done",
        "response.created",
    ]
    timeout, committed = events[:2]
    assert timeout["item_id"] == committed["item_id"]
    assert 600 <= timeout["audio_end_ms"] - timeout["audio_start_ms"] <= 700
    assert timeout["audio_start_ms"] == 0
    assert kinds(events).count("input_audio_buffer.timeout_triggered") == 1


def test_g711_input_is_detected_too(server: Server) -> None:
    """audio/pcmu input (8 kHz G.711) goes through the same path (decoded to 24 kHz, then
    resampled to 16 kHz for the VAD): endpoints within 200 ms, in session audio time."""
    placed = place(spoken(SENTENCES[1]), lead_ms=800, tail_ms=900)
    wire = mulaw_encode(float_to_int16(resample(placed.audio, RATE, 8_000)))

    async def main() -> list[dict]:
        async with connect(server) as c:
            update = vad_update(create_response=False)
            update["session"]["audio"]["input"]["format"] = {"type": "audio/pcmu"}
            await c.send(update)
            await c.until("session.updated")
            for start in range(0, len(wire), 800):  # 100 ms of 8 kHz bytes
                await c.send({"type": "input_audio_buffer.append", "audio": b64(wire[start : start + 800])})
                await asyncio.sleep(0.01)
            return await c.until("input_audio_buffer.committed")

    events = run(main())
    started, stopped = events[-3], events[-2]
    assert kinds(events)[-3:] == SERVER_VAD_TURN[:3]
    assert abs(started["audio_start_ms"] + 300 - placed.start_ms) <= 200
    assert abs(stopped["audio_end_ms"] - placed.end_ms) <= 200


def test_a_session_keeps_its_vad_when_the_vad_process_dies() -> None:
    """The VAD process killed in the middle of a session: the server starts a new one, the
    session's stream goes on in it, and a later utterance is endpointed at its true times (session
    audio time, counting the audio sent before and while the process was being replaced)."""
    placed = place(spoken(SENTENCES[1]), lead_ms=800, tail_ms=1200, noise_db=-45)
    before_ms = 1000

    with running(ServerConfig()) as server:
        vad = server.service.vad
        assert vad is not None

        async def main() -> list[dict]:
            async with connect(server) as c:
                await c.send(vad_update(create_response=False))
                await c.until("session.updated")
                await stream_audio(c, to_pcm16(np.zeros(RATE * before_ms // 1000, np.float32)))
                os.kill(vad._proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
                for _ in range(2000):
                    if vad.stats.restarts:
                        break
                    await asyncio.sleep(0.01)
                assert vad.stats.restarts == 1
                await stream_audio(c, placed.pcm16())
                return await c.until("input_audio_buffer.speech_stopped")

        events = run(main())
    started, stopped = (e for e in events if e["type"].startswith("input_audio_buffer.speech_"))
    assert abs(started["audio_start_ms"] + 300 - (before_ms + placed.start_ms)) <= 200, started
    assert abs(stopped["audio_end_ms"] - (before_ms + placed.end_ms)) <= 200, stopped


def test_a_turn_whose_response_the_settings_refuse_reports_an_error_and_the_session_goes_on(
    server: Server,
) -> None:
    """Server VAD commits the turn, but the response it would create is refused (``tool_choice``
    ``required`` with no tools): an ``error`` names the setting, no response starts, and once the
    setting is fixed the next turn is answered."""
    placed = place(spoken(SENTENCES[0]), lead_ms=600, tail_ms=1200, noise_db=-45)

    async def main() -> tuple[list[dict], list[dict]]:
        async with connect(server) as c:
            await c.send(
                {"type": "session.update", "session": {"type": "realtime", "tool_choice": "required"}}
            )
            await c.until("session.updated")
            await stream_audio(c, placed.pcm16())
            refused = await c.until("error")
            await c.send({"type": "session.update", "session": {"type": "realtime", "tool_choice": "auto"}})
            await c.until("session.updated")
            await stream_audio(c, placed.pcm16())
            return refused, await c.until("response.done")

    refused, answered = run(main())
    assert "input_audio_buffer.committed" in kinds(refused) and "response.created" not in kinds(refused)
    assert (refused[-1]["error"]["code"], refused[-1]["error"]["param"]) == (
        "invalid_value",
        "session.tool_choice",
    )
    assert answered[-1]["response"]["status"] == "completed"
