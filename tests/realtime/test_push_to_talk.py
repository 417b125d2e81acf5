"""Push-to-talk sessions (extension ``?turn=push_to_talk``): manual turns in which audio appended
while a reply is in progress is dropped; server VAD cannot be turned on."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from omnirt.stages.types import AudioPart

from .conftest import Server, connect, pcm_b64, run, running
from .vad_helpers import vad_update


@pytest.fixture(scope="module")
def slow() -> Iterator[Server]:
    # A 6-word reply takes 0.6 s: appends sent once it has started surely arrive while it plays.
    with running(step_seconds=0.1) as s:
        yield s


def test_ptt_turns_drop_audio_appended_while_a_reply_plays(slow: Server) -> None:
    """Press/release turn 1 (500 ms); while its reply streams, 700 ms more arrive (the talk button
    is up: dropped, so a commit right after the reply is refused as empty); then turn 2 (300 ms)
    is answered with exactly its own audio. A press while a reply plays (response.cancel first)
    lets the new audio in."""

    async def main() -> tuple[dict, list[dict], dict, list[dict], list[dict]]:
        async with connect(slow, query="&turn=push_to_talk") as c:
            created = c.events[0]
            await c.send({"type": "input_audio_buffer.append", "audio": pcm_b64(500)})
            await c.send({"type": "input_audio_buffer.commit"})
            await c.send({"type": "response.create"})
            await c.until("response.output_audio.delta")
            for _ in range(7):
                await c.send({"type": "input_audio_buffer.append", "audio": pcm_b64(100)})
            first = await c.until("response.done")
            await c.send({"type": "input_audio_buffer.commit", "event_id": "evt_empty"})
            empty = await c.error()
            await c.send({"type": "input_audio_buffer.append", "audio": pcm_b64(300)})
            await c.send({"type": "input_audio_buffer.commit"})
            await c.send({"type": "response.create"})
            await c.until("response.output_audio.delta")
            # Pressing while the reply plays: cancel first, then the new audio counts.
            await c.send({"type": "response.cancel"})
            second = await c.until("response.done")
            await c.send({"type": "input_audio_buffer.append", "audio": pcm_b64(200)})
            await c.send({"type": "input_audio_buffer.commit"})
            await c.send({"type": "response.create"})
            third = await c.until("response.done")
            return created, first, empty, second, third

    created, first, empty, second, third = run(main())
    assert created["session"]["audio"]["input"]["turn_detection"] is None  # stock shape
    assert first[-1]["response"]["status"] == "completed"
    assert (empty["code"], empty["event_id"]) == ("input_audio_buffer_commit_empty", "evt_empty")
    transcripts = [
        e["transcript"] for e in second + third if e["type"] == "response.output_audio_transcript.done"
    ]
    assert transcripts[-1] == "You said: 200 ms of audio."
    requests = slow.pipeline.requests[-3:]
    audio_ms = [
        len(p.pcm) * 1000 // 24_000
        for r in requests
        for p in r.messages[-1].parts
        if isinstance(p, AudioPart)
    ]
    assert audio_ms == [500, 300, 200]


def test_ptt_refuses_server_vad_and_unknown_turn_modes(slow: Server) -> None:
    """session.update with server_vad in a push-to-talk session: invalid_value naming
    turn_detection (the session stays push-to-talk); ?turn=other: invalid_value, close 1008."""

    async def main() -> tuple[dict, int | None, dict]:
        async with connect(slow, query="&turn=push_to_talk") as c:
            await c.send(vad_update())
            error = await c.error()
        async with connect(slow, query="&turn=walkie", expect_session=False) as c:
            refused = await c.error()
            code = await c.closed()
        return error, code, refused

    error, code, refused = run(main())
    assert (error["code"], error["param"]) == ("invalid_value", "session.audio.input.turn_detection")
    assert "push-to-talk" in error["message"]
    assert refused["code"] == "invalid_value" and "walkie" in refused["message"]
    assert code == 1008
