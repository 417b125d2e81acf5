"""response.create overrides, cancellation, the one active response, and terminal statuses."""

from __future__ import annotations

import asyncio

from omnirt.stages.types import TextPart

from .conftest import AUDIO_RESPONSE_TAIL, Server, connect, run, sdk_connect, text_item, wait_until

LONG = " ".join(f"w{i}" for i in range(150))  # echoed back one word per engine step


def test_cancel_mid_stream_sends_nothing_after_response_done(server: Server) -> None:
    async def main() -> tuple[list[dict], list[dict]]:
        async with sdk_connect(server) as c:
            await c.conn.conversation.item.create(item=text_item(LONG))
            await c.until("conversation.item.done")
            await c.conn.response.create()
            before = await c.until("response.output_audio.delta")
            await c.conn.response.cancel(event_id="evt_cancel")
            events = await c.until("response.done")
            # anything else would arrive within a few engine steps; a probe proves the link is alive
            await c.conn.conversation.item.retrieve(item_id=before[1]["item"]["id"])
            after = [await c.recv()]
            return before + events, after

    events, after = run(main())
    done = events[-1]["response"]
    assert done["status"] == "cancelled"
    assert done["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}
    kinds = [e["type"] for e in events]
    assert kinds[-6:] == AUDIO_RESPONSE_TAIL
    assert events[-3]["item"]["status"] == "incomplete"
    assert [e["type"] for e in after] == ["conversation.item.retrieved"]  # no stray deltas
    request_id = server.pipeline.requests[-1].request_id
    assert wait_until(lambda: request_id in server.pipeline.removed)  # the engine request was cancelled


def test_only_one_response_writes_to_the_conversation(server: Server) -> None:
    """A second in-band response.create gets conversation_already_has_active_response; an
    out-of-band one (conversation "none") runs beside it and writes nothing."""

    async def main() -> tuple[list[dict], dict]:
        async with connect(server) as c:
            await c.send({"type": "conversation.item.create", "item": text_item(LONG)})
            await c.until("conversation.item.done")
            await c.send({"type": "response.create"})
            first = (await c.until("response.created"))[-1]["response"]["id"]
            await c.send({"type": "response.create", "event_id": "evt_second"})
            await c.send(
                {
                    "type": "response.create",
                    "response": {
                        "conversation": "none",
                        "output_modalities": ["text"],
                        "metadata": {"purpose": "classify"},
                        "input": [text_item("side question")],
                    },
                }
            )
            events = await c.until("response.done")
            while events[-1]["response"]["id"] == first:  # pragma: no cover - the short one ends first
                events += await c.until("response.done")
            oob = events[-1]["response"]
            await c.send({"type": "response.cancel", "response_id": first})
            events += await c.until("response.done")
            return events, oob

    events, oob = run(main())
    errors = [e["error"] for e in events if e["type"] == "error"]
    assert [(e["code"], e["event_id"]) for e in errors] == [
        ("conversation_already_has_active_response", "evt_second")
    ]
    assert oob["conversation_id"] is None and oob["metadata"] == {"purpose": "classify"}
    assert (
        oob["status"] == "completed" and oob["output"][0]["content"][0]["text"] == "You said: side question."
    )
    oob_item = oob["output"][0]["id"]
    # the out-of-band item is never announced as a conversation item
    conv_ids = {e["item"]["id"] for e in events if e["type"].startswith("conversation.item.")}
    assert oob_item not in conv_ids
    # its context was the given input only
    oob_request = next(r for r in server.pipeline.requests if r.request_id == oob["id"])
    assert [m.parts for m in oob_request.messages] == [(TextPart("side question"),)]


def test_overrides_and_max_output_tokens_incomplete(server: Server) -> None:
    async def main() -> dict:
        async with connect(server) as c:
            await c.send({"type": "conversation.item.create", "item": text_item("one two three four")})
            await c.send(
                {
                    "type": "response.create",
                    "response": {"instructions": "Answer in French.", "max_output_tokens": 3},
                }
            )
            return (await c.until("response.done"))[-1]["response"]

    done = run(main())
    assert done["status"] == "incomplete"
    assert done["status_details"] == {"type": "incomplete", "reason": "max_output_tokens"}
    assert done["max_output_tokens"] == 3 and done["output"][0]["status"] == "incomplete"
    request = server.pipeline.requests[-1]
    assert request.max_output_tokens == 3
    assert request.messages[0].role == "system" and request.messages[0].parts == (
        TextPart("Answer in French."),
    )


def test_inf_tokens_means_the_server_cap_and_input_can_reference_items(server: Server) -> None:
    async def main() -> dict:
        async with connect(server) as c:
            await c.send({"type": "conversation.item.create", "item": text_item("first", "my_first_item")})
            await c.send({"type": "conversation.item.create", "item": text_item("second")})
            await c.until("conversation.item.done")
            await c.until("conversation.item.done")
            await c.send(
                {
                    "type": "response.create",
                    "response": {
                        "max_output_tokens": "inf",
                        "input": [{"type": "item_reference", "id": "my_first_item"}],
                    },
                }
            )
            return (await c.until("response.done"))[-1]["response"]

    done = run(main())
    assert done["status"] == "completed"
    assert done["output"][0]["content"][0]["transcript"] == "You said: first."
    assert server.pipeline.requests[-1].max_output_tokens == server.config.max_output_tokens


def test_engine_failure_ends_in_failed_response(server: Server) -> None:
    async def main() -> dict:
        async with connect(server) as c:
            await c.send({"type": "conversation.item.create", "item": text_item("reject me")})
            await c.send({"type": "response.create"})
            return (await c.until("response.done"))[-1]["response"]

    done = run(main())
    assert done["status"] == "failed" and done["output"] == []
    assert done["status_details"]["error"]["message"] == "the echo pipeline rejects this input"


def test_cancel_without_active_response(server: Server) -> None:
    async def main() -> list[dict]:
        async with connect(server) as c:
            await c.send({"type": "response.cancel", "event_id": "evt_1"})
            first = await c.error()
            await c.send({"type": "response.cancel", "response_id": "resp_unknown", "event_id": "evt_2"})
            return [first, await c.error()]

    errors = run(main())
    assert [(e["code"], e["event_id"]) for e in errors] == [
        ("response_cancel_not_active", "evt_1"),
        ("response_cancel_not_active", "evt_2"),
    ]


def test_events_keep_flowing_while_a_response_streams(server: Server) -> None:
    """The reader is never blocked by a streaming response: an item created mid-stream is
    acknowledged before the response ends."""

    async def main() -> list[str]:
        async with connect(server) as c:
            await c.send({"type": "conversation.item.create", "item": text_item(LONG)})
            await c.send({"type": "response.create"})
            await c.until("response.output_audio.delta")
            await c.send({"type": "input_audio_buffer.clear"})
            kinds = [e["type"] for e in await c.until("input_audio_buffer.cleared")]
            await c.send({"type": "response.cancel"})
            await asyncio.wait_for(c.until("response.done"), 5)
            return kinds

    kinds = run(main())
    assert "response.done" not in kinds


def test_a_session_runs_at_most_two_out_of_band_responses_at_once(server: Server) -> None:
    """A third out-of-band response.create while two run gets resource_exhausted and changes
    nothing; an in-band one still runs beside them, and once one ends another may start."""
    oob = {"conversation": "none", "output_modalities": ["text"], "input": [text_item(LONG)]}

    async def main() -> list[dict]:
        async with connect(server) as c:
            ids = []
            for _ in range(2):
                await c.send({"type": "response.create", "response": oob})
                ids.append((await c.until("response.created"))[-1]["response"]["id"])
            await c.send({"type": "response.create", "event_id": "evt_third", "response": oob})
            events = await c.until("error")
            await c.send({"type": "conversation.item.create", "item": text_item("hi")})
            events += await c.until("conversation.item.done")
            await c.send({"type": "response.create"})  # in band: not counted
            events += await c.until("response.created")
            await c.send({"type": "response.cancel", "response_id": ids[0]})
            while not (events[-1]["type"] == "response.done" and events[-1]["response"]["id"] == ids[0]):
                events += await c.until("response.done")
            await c.send({"type": "response.create", "event_id": "evt_again", "response": oob})
            events += await c.until("response.created")
            for rid in (ids[1], events[-1]["response"]["id"]):
                await c.send({"type": "response.cancel", "response_id": rid})
            return events

    events = run(main())
    errors = [e["error"] for e in events if e["type"] == "error"]
    assert [(e["code"], e["param"], e["event_id"]) for e in errors] == [
        ("resource_exhausted", "response.conversation", "evt_third")
    ]
    assert "max_out_of_band_responses" in errors[0]["message"]
    created = [e["response"] for e in events if e["type"] == "response.created"]
    assert [r["conversation_id"] is None for r in created] == [False, True]
