"""Input audio transcription end to end on the embedded default: the real server on loopback, the
real Qwen3-Omni pipeline (random weights: the transcript is babble, but the model writes it) in
the real engine, real speech from espeak-ng, every frame validated strictly with the SDK's models.
Turn detection is set explicitly in every test (the session default is not assumed)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from omnirt.codecs.audio import b64encode

from tests.realtime.conftest import Client, connect
from tests.realtime.test_transcription import TRANSCRIBED, transcription_update, until_all
from tests.realtime.vad_helpers import kinds, stream_audio
from tests.vad.speech import SENTENCES, place, spoken, to_pcm16

from .test_demo_server import DemoServer, running_demo

ENGLISH = {"model": "gpt-4o-transcribe", "language": "en"}


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoServer]:
    with running_demo(tmp_path_factory, max_output_tokens=48) as server:
        yield server


def speech(sentence: int = 0) -> bytes:
    return place(spoken(SENTENCES[sentence]), lead_ms=300, tail_ms=900).pcm16()


async def append(c: Client, pcm16: bytes) -> None:
    for i in range(0, len(pcm16), 4800):  # 100 ms appends, as a live client sends them
        await c.send({"type": "input_audio_buffer.append", "audio": b64encode(pcm16[i : i + 4800])})


def transcription_of(events: list[dict[str, Any]], item_id: str) -> tuple[list[dict], list[dict]]:
    mine = [e for e in events if e["type"].startswith(TRANSCRIBED) and e["item_id"] == item_id]
    return [e for e in mine if e["type"] == f"{TRANSCRIBED}.delta"], [
        e for e in mine if e["type"] != f"{TRANSCRIBED}.delta"
    ]


def test_manual_commit_is_transcribed_by_the_model_beside_the_reply(demo: DemoServer) -> None:
    async def main() -> tuple[list[dict], dict]:
        async with connect(demo) as c:  # type: ignore[arg-type]
            await c.send(transcription_update(ENGLISH, None))
            await c.until("session.updated")
            await append(c, speech())
            await c.send({"type": "input_audio_buffer.commit"})
            await c.send({"type": "response.create", "response": {"max_output_tokens": 4}})
            events = await until_all(c, {"response.done", f"{TRANSCRIBED}.completed"}, timeout=60)
            await c.send({"type": "conversation.item.retrieve", "item_id": events[0]["item_id"]})
            return events, (await c.until("conversation.item.retrieved"))[-1]

    events, retrieved = asyncio.run(main())
    types = kinds(events)
    assert types[:3] == ["input_audio_buffer.committed", "conversation.item.added", "conversation.item.done"]
    item_id = events[0]["item_id"]
    deltas, (completed,) = transcription_of(events, item_id)
    assert completed["type"] == f"{TRANSCRIBED}.completed"
    # the reply is created at once, whatever the transcription is doing
    assert types.index("response.created") < types.index(f"{TRANSCRIBED}.completed")
    assert deltas and completed["transcript"] == "".join(e["delta"] for e in deltas)
    assert completed["transcript"].strip()
    usage = completed["usage"]
    assert usage["type"] == "tokens" and usage["output_tokens"] > 0
    assert usage["input_token_details"]["audio_tokens"] > 0
    assert events[types.index("response.done")]["response"]["status"] == "incomplete"  # its 4 tokens
    part = retrieved["item"]["content"][0]
    assert part["type"] == "input_audio" and part["transcript"] == completed["transcript"]


def test_server_vad_turn_is_transcribed(demo: DemoServer) -> None:
    async def main() -> list[dict]:
        async with connect(demo) as c:  # type: ignore[arg-type]
            update = transcription_update(ENGLISH, {"type": "server_vad", "create_response": True})
            await c.send(update)
            await c.until("session.updated")
            await stream_audio(c, speech(1))
            return await until_all(c, {"response.done", f"{TRANSCRIBED}.completed"}, timeout=60)

    events = asyncio.run(main())
    types = kinds(events)
    assert types[:6] == [
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "conversation.item.added",
        "conversation.item.done",
        "response.created",
    ]
    deltas, (completed,) = transcription_of(events, events[0]["item_id"])
    assert deltas and completed["transcript"].strip()
    assert completed["transcript"] == "".join(e["delta"] for e in deltas)


def test_item_deleted_mid_transcription_gets_no_more_events(demo: DemoServer) -> None:
    stats = demo.engine.stats

    async def main() -> tuple[list[dict], list[dict], int]:
        async with connect(demo) as c:  # type: ignore[arg-type]
            await c.send(transcription_update(ENGLISH, None))
            await c.until("session.updated")
            await append(c, speech())
            cancelled = stats.requests_cancelled
            await c.send({"type": "input_audio_buffer.commit"})
            before = await c.until(f"{TRANSCRIBED}.delta", timeout=60)
            await c.send({"type": "conversation.item.delete", "item_id": before[0]["item_id"]})
            before += await c.until("conversation.item.deleted")
            after: list[dict] = []
            with pytest.raises(TimeoutError):
                while True:
                    after.append(await c.recv(timeout=1.0))
            return before, after, stats.requests_cancelled - cancelled

    before, after, cancelled = asyncio.run(main())
    item_id = before[0]["item_id"]
    assert not transcription_of(before, item_id)[1]  # neither completed nor failed
    assert after == [] and cancelled == 1


def test_a_failed_transcription_says_so_and_the_reply_goes_on(demo: DemoServer) -> None:
    """A prompt hint longer than the model's context makes the engine refuse the transcription
    request: ``.failed`` with the reason; the reply (which does not carry the hint) completes."""
    hint = "remember these words " * 4000

    async def main() -> list[dict]:
        async with connect(demo) as c:  # type: ignore[arg-type]
            await c.send(transcription_update({**ENGLISH, "prompt": hint}, None))
            await c.until("session.updated")
            await append(c, to_pcm16(spoken(SENTENCES[1])))
            await c.send({"type": "input_audio_buffer.commit"})
            await c.send({"type": "response.create", "response": {"max_output_tokens": 3}})
            return await until_all(c, {"response.done", f"{TRANSCRIBED}.failed"}, timeout=60)

    events = asyncio.run(main())
    deltas, (failed,) = transcription_of(events, events[0]["item_id"])
    assert not deltas and failed["content_index"] == 0
    error = failed["error"]
    assert error["type"] == "transcription_error" and error["code"] == "invalid_value"
    assert "context" in error["message"]
    done = next(e for e in events if e["type"] == "response.done")
    assert done["response"]["status"] == "incomplete"  # the reply ran to its token budget
