"""Barge-in and playback accounting over a real WebSocket.

Speech that starts while a reply streams cancels it (turn_detected) in the PROTOCOL.md order and
stops the engine's request; nothing of it follows its response.done. ``playback.ack`` and
``conversation.item.truncate`` both cut the history to what was heard, identically.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Iterator
from typing import Any

import pytest
from omnirt.stages.types import TextPart

from tests.vad.speech import SENTENCES, place, spoken

from .conftest import AUDIO_RESPONSE_TAIL, Client, Server, connect, run, running, text_item
from .vad_helpers import kinds, stream_audio, vad_update

LONG = " ".join(f"w{i}" for i in range(120))


@pytest.fixture(scope="module")
def slow() -> Iterator[Server]:
    """Replies stream one 80 ms word per 30 ms engine step: a long reply takes seconds."""
    with running(step_seconds=0.03) as s:
        yield s


def audio_ms(events: list[dict[str, Any]], response_id: str) -> float:
    return sum(
        len(base64.b64decode(e["delta"])) / 48
        for e in events
        if e["type"] == "response.output_audio.delta" and e["response_id"] == response_id
    )


async def start_long_reply(c: Client, min_audio_ms: float) -> tuple[str, str]:
    """A long reply streaming, with at least ``min_audio_ms`` of its audio received."""
    await c.send({"type": "conversation.item.create", "item": text_item(LONG)})
    await c.send({"type": "response.create"})
    events = await c.until("response.output_item.added")
    response_id = events[-1]["response_id"]
    item_id = events[-1]["item"]["id"]
    while audio_ms(c.events, response_id) < min_audio_ms:
        await c.recv()
    return response_id, item_id


def test_barge_in_cancels_the_reply_in_order_and_fast(slow: Server) -> None:
    """Real speech streamed in real time while a reply plays: speech_started, the item closes
    incomplete, response.done cancelled/turn_detected; the engine request is removed; no audio of
    it after its response.done; the delay from the true speech onset to response.done is
    measured (under 500 ms). The speech then becomes a turn with its own response; the history
    holds the reply only up to the last playback.ack (160 ms: two words)."""
    placed = place(spoken(SENTENCES[1]), lead_ms=300, tail_ms=900)

    async def main() -> tuple[list[dict], float, str]:
        async with connect(slow) as c:
            await c.send(vad_update(silence_duration_ms=400))
            await c.until("session.updated")
            response_id, item_id = await start_long_reply(c, 240)
            await c.send(
                {"type": "playback.ack", "response_id": response_id, "item_id": item_id, "played_ms": 160}
            )
            mark = len(c.events)
            sender = asyncio.create_task(stream_audio(c, placed.pcm16(), chunk_ms=40, speed=1.0))
            done_at = 0.0
            while True:
                event = await c.recv()
                if event["type"] == "response.done" and not done_at:
                    done_at = time.perf_counter()
                if event["type"] == "response.done" and event["response"]["id"] != response_id:
                    break
            sent = await sender
            onset_chunk = int(placed.start_ms // 40)  # the chunk holding the true onset
            return c.events[mark:], done_at - sent[onset_chunk], response_id

    events, delay, response_id = run(main())
    print(f"barge-in delay, speech onset to response.done: {delay * 1000:.0f} ms")
    assert 0 < delay < 0.5
    k = kinds(events)
    acked = events[k.index("playback.acknowledged")]
    assert acked["played_ms"] == 160 and acked["committed_ms"] >= 240  # recorded, not yet cut
    started = k.index("input_audio_buffer.speech_started")
    done = k.index("response.done")
    assert started < done
    assert k[done - len(AUDIO_RESPONSE_TAIL) + 1 : done + 1] == AUDIO_RESPONSE_TAIL
    cancelled = events[done]["response"]
    assert cancelled["id"] == response_id
    assert cancelled["status"] == "cancelled"
    assert cancelled["status_details"] == {"type": "cancelled", "reason": "turn_detected"}
    assert events[done - 2]["item"]["status"] == "incomplete"  # output_item.done
    assert not [e for e in events[done + 1 :] if e.get("response_id") == response_id]
    assert response_id in slow.pipeline.removed  # the engine stopped generating it
    # The speech turn: stopped, committed, a new response whose context is cut to the ack.
    assert k[done + 1 :].index("input_audio_buffer.speech_stopped") < k[done + 1 :].index("response.created")
    history = slow.pipeline.requests[-1].messages
    assistant = [m for m in history if m.role == "assistant"]
    assert assistant[-1].parts == (TextPart("You said:"),)


def test_interrupt_response_false_lets_the_reply_finish(slow: Server) -> None:
    """interrupt_response false and create_response false: speech during a reply gives VAD events
    and a committed item, but the reply completes and no new response starts."""
    placed = place(spoken(SENTENCES[1]), lead_ms=200, tail_ms=700)

    async def main() -> list[dict]:
        async with connect(slow) as c:
            await c.send(vad_update(interrupt_response=False, create_response=False, silence_duration_ms=400))
            await c.until("session.updated")
            await start_long_reply(c, 80)
            await stream_audio(c, placed.pcm16(), speed=20)
            events = await c.until("response.done")
            if "input_audio_buffer.committed" not in kinds(events):
                events += await c.until("input_audio_buffer.committed")
            return events

    events = run(main())
    k = kinds(events)
    assert "input_audio_buffer.speech_started" in k and "input_audio_buffer.committed" in k
    done = next(e for e in events if e["type"] == "response.done")
    assert done["response"]["status"] == "completed"
    assert k.count("response.created") == 0


def cut_history(server: Server, how: str, cut_ms: int) -> tuple[dict, list[dict], Any]:
    """Cancel a streaming reply, then cut it with ``truncate`` or ``playback.ack`` at ``cut_ms``;
    returns the answer, the retrieved item and the next request's history."""

    async def main() -> tuple[dict, list[dict]]:
        async with connect(server) as c:
            response_id, item_id = await start_long_reply(c, cut_ms + 200)
            await c.send({"type": "response.cancel"})
            await c.until("response.done")
            if how == "truncate":
                await c.send(
                    {
                        "type": "conversation.item.truncate",
                        "item_id": item_id,
                        "content_index": 0,
                        "audio_end_ms": cut_ms,
                    }
                )
                answer = (await c.until("conversation.item.truncated"))[-1]
            else:
                await c.send(
                    {
                        "type": "playback.ack",
                        "response_id": response_id,
                        "item_id": item_id,
                        "played_ms": cut_ms,
                    }
                )
                answer = (await c.until("playback.acknowledged"))[-1]
            await c.send({"type": "conversation.item.retrieve", "item_id": item_id})
            retrieved = (await c.until("conversation.item.retrieved"))[-1]
            await c.send({"type": "conversation.item.create", "item": text_item("next")})
            await c.send({"type": "response.create"})
            await c.until("response.done")
            return answer, retrieved

    answer, retrieved = run(main())
    return answer, retrieved, server.pipeline.requests[-1].messages


def test_ack_and_truncate_cut_history_identically(slow: Server) -> None:
    """The same cut (400 ms: five 80 ms words) by conversation.item.truncate and by playback.ack
    leaves the same stored audio, the same transcript, and the same next-turn context."""
    t_answer, t_item, t_history = cut_history(slow, "truncate", 400)
    a_answer, a_item, a_history = cut_history(slow, "ack", 400)
    assert t_answer["audio_end_ms"] == 400
    assert (a_answer["played_ms"], a_answer["committed_ms"]) == (400, 400)
    for item in (t_item, a_item):
        part = item["item"]["content"][0]
        assert len(base64.b64decode(part["audio"])) == 400 * 48
        assert part["transcript"] == "You said: w0 w1 w2"
    assert [(m.role, m.parts) for m in t_history] == [(m.role, m.parts) for m in a_history]
    assert t_history[1].role == "assistant" and t_history[1].parts == (TextPart("You said: w0 w1 w2"),)


def test_bad_acks_get_clear_errors_and_change_nothing(slow: Server) -> None:
    """Unknown response_id: invalid_value (param response_id); an item not in that response:
    item_truncate_invalid_item_id (item_id, as the truncate the ack stands for); negative
    played_ms: integer_below_min_value (played_ms); played_ms past the produced audio:
    invalid_value (played_ms); a missing field: missing_required_parameter. The item keeps its
    audio and transcript; a good ack afterwards still works."""

    async def main() -> tuple[list[dict], dict, dict, int]:
        async with connect(slow) as c:
            response_id, item_id = await start_long_reply(c, 400)
            await c.send({"type": "response.cancel"})
            await c.until("response.done")
            produced = int(audio_ms(c.events, response_id))
            await c.send({"type": "conversation.item.retrieve", "item_id": item_id})
            before = (await c.until("conversation.item.retrieved"))[-1]["item"]
            ack = {"type": "playback.ack", "response_id": response_id, "item_id": item_id}
            bad = [
                {**ack, "response_id": "resp_unknown", "played_ms": 100},
                {**ack, "item_id": "item_unknown", "played_ms": 100},
                {**ack, "played_ms": -1},
                {**ack, "played_ms": produced + 1000},
                {"type": "playback.ack", "response_id": response_id, "played_ms": 10},
            ]
            errors = []
            for i, event in enumerate(bad):
                await c.send({**event, "event_id": f"evt_{i}"})
                errors.append(await c.error())
            await c.send({"type": "conversation.item.retrieve", "item_id": item_id})
            after = (await c.until("conversation.item.retrieved"))[-1]["item"]
            await c.send({**ack, "played_ms": 160})
            good = (await c.until("playback.acknowledged"))[-1]
            return errors, before, after | {"good": good}, produced

    errors, before, after, produced = run(main())
    assert [(e["code"], e["param"], e["event_id"]) for e in errors] == [
        ("invalid_value", "response_id", "evt_0"),
        ("item_truncate_invalid_item_id", "item_id", "evt_1"),
        ("integer_below_min_value", "played_ms", "evt_2"),
        ("invalid_value", "played_ms", "evt_3"),
        ("missing_required_parameter", "item_id", "evt_4"),
    ]
    assert after["content"] == before["content"]
    assert len(base64.b64decode(after["content"][0]["audio"])) >= 400 * 48
    assert after["good"]["played_ms"] == after["good"]["committed_ms"] == 160 < produced


def test_ack_progress_then_cancel_cuts_at_the_last_ack(slow: Server) -> None:
    """Acks while the reply streams record progress (nothing cut while it plays on); a
    response.cancel then cuts the history at the last acked position (240 ms: three words)."""

    async def main() -> tuple[list[dict], dict]:
        async with connect(slow) as c:
            response_id, item_id = await start_long_reply(c, 320)
            answers = []
            for played in (80, 240):
                await c.send(
                    {
                        "type": "playback.ack",
                        "response_id": response_id,
                        "item_id": item_id,
                        "played_ms": played,
                    }
                )
                answers.append((await c.until("playback.acknowledged"))[-1])
            await c.send({"type": "response.cancel"})
            await c.until("response.done")
            await c.send({"type": "conversation.item.retrieve", "item_id": item_id})
            return answers, (await c.until("conversation.item.retrieved"))[-1]["item"]

    answers, item = run(main())
    assert [a["played_ms"] for a in answers] == [80, 240]
    assert all(a["committed_ms"] >= 320 for a in answers)
    assert item["content"][0]["transcript"] == "You said: w0"
    assert len(base64.b64decode(item["content"][0]["audio"])) == 240 * 48


@pytest.mark.parametrize("how", ["truncate", "ack"])
def test_what_was_heard_after_an_interruption_replaces_the_last_progress_ack(slow: Server, how: str) -> None:
    """The push-to-talk press (and barge-in) flow with progress acks: an ack at 80 ms while the
    reply streams, then response.cancel and, for what the user heard by then (400 ms: five
    words), a truncate or an ack. The cancel cuts the history at the last ack (80 ms) only for
    now: the client's own word on what was heard, up to the audio it was sent, replaces that cut."""

    async def main() -> tuple[dict, dict]:
        async with connect(slow) as c:
            response_id, item_id = await start_long_reply(c, 480)
            ack = {"type": "playback.ack", "response_id": response_id, "item_id": item_id}
            await c.send({**ack, "played_ms": 80})
            await c.until("playback.acknowledged")
            await c.send({"type": "response.cancel"})
            if how == "truncate":
                cut = {"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0}
                await c.send({**cut, "audio_end_ms": 400})
                answer = (await c.until("conversation.item.truncated"))[-1]
            else:
                await c.send({**ack, "played_ms": 400})
                answer = (await c.until("playback.acknowledged"))[-1]
            await c.send({"type": "conversation.item.retrieve", "item_id": item_id})
            return answer, (await c.until("conversation.item.retrieved"))[-1]["item"]

    answer, item = run(main())
    assert answer.get("audio_end_ms", answer.get("committed_ms")) == 400
    assert len(base64.b64decode(item["content"][0]["audio"])) == 400 * 48
    assert item["content"][0]["transcript"] == "You said: w0 w1 w2"
