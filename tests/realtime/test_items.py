"""Conversation items: create (placement, ids, content types), retrieve, delete, truncate."""

from __future__ import annotations

import base64

from omnirt.stages.types import ImagePart, TextPart, ToolCallPart, ToolResultPart

from .conftest import Server, b64, connect, pcm_b64, png, run, tone

PNG = base64.b64encode(png()).decode()


def text_item(text: str, item_id: str | None = None, role: str = "user") -> dict:
    kind = "output_text" if role == "assistant" else "input_text"
    item = {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}
    if item_id:
        item["id"] = item_id
    return item


def test_create_places_items_and_accepts_32_char_ids(server: Server) -> None:
    long_id = "x" * 32

    async def main() -> list[dict]:
        async with connect(server) as c:
            await c.send({"type": "conversation.item.create", "item": text_item("a", "item_a")})
            await c.send({"type": "conversation.item.create", "item": text_item("c", long_id)})
            await c.send(
                {
                    "type": "conversation.item.create",
                    "item": text_item("b", "item_b"),
                    "previous_item_id": "item_a",
                }
            )
            await c.send(
                {
                    "type": "conversation.item.create",
                    "item": text_item("z", "item_z"),
                    "previous_item_id": "root",
                }
            )
            await c.send(
                {
                    "type": "conversation.item.create",
                    "item": {
                        "type": "message",
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "what is this?"},
                            {"type": "input_image", "image_url": f"data:image/png;base64,{PNG}"},
                        ],
                    },
                }
            )
            await c.send(
                {
                    "type": "conversation.item.create",
                    "item": {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
                }
            )
            await c.send(
                {
                    "type": "conversation.item.create",
                    "item": {"type": "function_call_output", "call_id": "call_1", "output": '{"ok":true}'},
                }
            )
            await c.send(
                {"type": "conversation.item.create", "item": text_item("earlier reply", role="assistant")}
            )
            await c.send({"type": "response.create", "response": {"output_modalities": ["text"]}})
            return await c.until("response.done")

    events = run(main())
    added = [e for e in events if e["type"] == "conversation.item.added"]
    assert [(e["item"]["id"], e["previous_item_id"]) for e in added[:4]] == [
        ("item_a", None),
        ("x" * 32, "item_a"),
        ("item_b", "item_a"),
        ("item_z", None),
    ]
    image = added[4]["item"]["content"][1]
    assert image["type"] == "input_image" and image["image_url"].startswith("data:image/png")
    assert [e["item"]["type"] for e in added[5:7]] == ["function_call", "function_call_output"]
    messages = server.pipeline.requests[-1].messages
    roles = [m.role for m in messages]
    assert roles == ["user", "user", "user", "user", "user", "assistant", "tool", "assistant"]
    assert [m.parts[0].text for m in messages[:4]] == ["z", "a", "b", "c"]  # type: ignore[union-attr]
    assert isinstance(messages[4].parts[1], ImagePart) and messages[4].parts[1].data.startswith(b"\x89PNG")
    assert messages[5].parts == (ToolCallPart("call_1", "f", "{}"),)
    assert messages[6].parts == (ToolResultPart("call_1", '{"ok":true}'),)
    assert messages[7].parts == (TextPart("earlier reply"),)


def test_item_errors_leave_the_conversation_unchanged(server: Server) -> None:
    """OpenAI's codes: an unknown id gets item_retrieve_invalid_item_id /
    item_delete_invalid_item_id / item_truncate_invalid_item_id, an unknown previous_item_id
    item_create_invalid_previous_item_id, a duplicate id item_create_duplicate_item_id; a 33-char id
    string_above_max_length; a remote image URL, a role/content mismatch and an unknown
    item_reference invalid_value; truncating a user message unsupported_content_type. Each error
    echoes the client's event_id."""

    async def main() -> list[dict]:
        async with connect(server) as c:
            await c.send({"type": "conversation.item.create", "item": text_item("a", "item_a")})
            await c.until("conversation.item.done")
            bad = [
                {"type": "conversation.item.retrieve", "item_id": "nope"},
                {"type": "conversation.item.delete", "item_id": "nope"},
                {
                    "type": "conversation.item.truncate",
                    "item_id": "nope",
                    "content_index": 0,
                    "audio_end_ms": 0,
                },
                {"type": "conversation.item.create", "item": text_item("b"), "previous_item_id": "nope"},
                {"type": "conversation.item.create", "item": text_item("b", "y" * 33)},
                {"type": "conversation.item.create", "item": text_item("b", "item_a")},
                {
                    "type": "conversation.item.create",
                    "item": {
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_image", "image_url": "https://example.com/cat.png"}],
                    },
                },
                {
                    "type": "conversation.item.create",
                    "item": {
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "output_text", "text": "x"}],
                    },
                },
                {
                    "type": "response.create",
                    "response": {"input": [{"type": "item_reference", "id": "nope"}]},
                },
                {
                    "type": "conversation.item.truncate",
                    "item_id": "item_a",
                    "content_index": 0,
                    "audio_end_ms": 0,
                },
            ]
            errors = []
            for i, event in enumerate(bad):
                await c.send({**event, "event_id": f"evt_{i}"})
                errors.append(await c.error())
            await c.send({"type": "conversation.item.retrieve", "item_id": "item_a"})
            errors.append(await c.recv())
            return errors

    *errors, retrieved = run(main())
    assert [(e["code"], e["event_id"]) for e in errors] == [
        ("item_retrieve_invalid_item_id", "evt_0"),
        ("item_delete_invalid_item_id", "evt_1"),
        ("item_truncate_invalid_item_id", "evt_2"),
        ("item_create_invalid_previous_item_id", "evt_3"),
        ("string_above_max_length", "evt_4"),
        ("item_create_duplicate_item_id", "evt_5"),
        ("invalid_value", "evt_6"),
        ("invalid_value", "evt_7"),
        ("invalid_value", "evt_8"),
        ("unsupported_content_type", "evt_9"),
    ]
    assert errors[4]["param"] == "item.id" and errors[6]["param"] == "item.content.0.image_url"
    assert errors[5]["param"] == "item.id" and errors[8]["param"] == "response.input.0.id"
    assert errors[0]["message"] == "Error retrieving item: the item with id 'nope' does not exist."
    assert retrieved["type"] == "conversation.item.retrieved" and retrieved["item"]["id"] == "item_a"


def test_retrieve_and_delete(server: Server) -> None:
    async def main() -> list[dict]:
        async with connect(server, manual=True) as c:
            await c.send({"type": "input_audio_buffer.append", "audio": pcm_b64(300)})
            await c.send({"type": "input_audio_buffer.commit"})
            item_id = (await c.until("conversation.item.done"))[0]["item_id"]
            await c.send({"type": "conversation.item.retrieve", "item_id": item_id})
            retrieved = await c.recv()
            await c.send({"type": "conversation.item.delete", "item_id": item_id})
            deleted = await c.recv()
            await c.send({"type": "conversation.item.retrieve", "item_id": item_id})
            return [retrieved, deleted, await c.error()]

    retrieved, deleted, error = run(main())
    content = retrieved["item"]["content"][0]
    assert content["type"] == "input_audio" and base64.b64decode(content["audio"]) == tone(300).tobytes()
    assert deleted == {**deleted, "type": "conversation.item.deleted", "item_id": retrieved["item"]["id"]}
    assert error["code"] == "item_retrieve_invalid_item_id"


def test_truncate_while_streaming_cuts_audio_and_transcript(server: Server) -> None:
    """Truncation mid-stream is accepted and echoed; history keeps only what was heard;
    truncating past the end of the audio is an error."""
    long = " ".join(f"w{i}" for i in range(100))

    async def main() -> list[dict]:
        async with connect(server) as c:
            await c.send({"type": "conversation.item.create", "item": text_item(long)})
            await c.send({"type": "response.create"})
            events = await c.until("response.output_audio.delta")
            item_id = next(e for e in events if e["type"] == "response.output_item.added")["item"]["id"]
            while (
                sum(len(base64.b64decode(e["delta"])) for e in c.events if "audio.delta" in e["type"])
                < 48 * 400
            ):
                await c.recv()
            await c.send(
                {
                    "type": "conversation.item.truncate",
                    "item_id": item_id,
                    "content_index": 0,
                    "audio_end_ms": 200,
                }
            )
            events = await c.until("conversation.item.truncated")
            await c.send({"type": "response.cancel"})
            events += await c.until("response.done")
            await c.send(
                {
                    "type": "conversation.item.truncate",
                    "item_id": item_id,
                    "content_index": 0,
                    "audio_end_ms": 201,
                    "event_id": "evt_past",
                }
            )
            events.append(await c.recv())
            await c.send({"type": "conversation.item.retrieve", "item_id": item_id})
            events.append(await c.recv())
            await c.send({"type": "conversation.item.create", "item": text_item("next")})
            await c.send({"type": "response.create"})
            events += await c.until("response.done")
            return events

    events = run(main())
    truncated = next(e for e in events if e["type"] == "conversation.item.truncated")
    assert truncated["audio_end_ms"] == 200 and truncated["content_index"] == 0
    past = next(e for e in events if e["type"] == "error")["error"]
    assert (past["code"], past["param"], past["event_id"]) == ("invalid_value", "audio_end_ms", "evt_past")
    retrieved = next(e for e in events if e["type"] == "conversation.item.retrieved")["item"]["content"][0]
    assert len(base64.b64decode(retrieved["audio"])) == 200 * 48
    # 200 ms of 80 ms words: two whole words were heard by then ("You said:")
    assert retrieved["transcript"] == "You said:"
    history = server.pipeline.requests[-1].messages
    assert history[1].role == "assistant" and history[1].parts == (TextPart("You said:"),)


def test_odd_audio_in_item_create(server: Server) -> None:
    async def main() -> dict:
        async with connect(server) as c:
            item = {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_audio", "audio": b64(b"\x00" * 3)}],
            }
            await c.send({"type": "conversation.item.create", "item": item})
            return await c.error()

    error = run(main())
    assert error["code"] == "invalid_value" and error["param"] == "item.content.0.audio"


def test_retrieving_long_audio_keeps_the_frame_under_1_mib(server: Server) -> None:
    """30 s of audio is 1.9 MB as base64: the retrieved item then leaves the audio out (with its
    transcript field kept) instead of sending a frame older SDKs would close on."""

    async def main() -> tuple[dict, dict]:
        async with connect(server, manual=True) as c:
            await c.send({"type": "input_audio_buffer.append", "audio": pcm_b64(15_000)})
            await c.send({"type": "input_audio_buffer.append", "audio": pcm_b64(15_000)})
            await c.send({"type": "input_audio_buffer.commit"})
            item_id = (await c.until("conversation.item.done"))[0]["item_id"]
            await c.send({"type": "conversation.item.retrieve", "item_id": item_id})
            big = await c.recv()  # validate() asserts the frame is under 1 MiB
            await c.send({"type": "response.create", "response": {"audio": {"output": {"voice": "nobody"}}}})
            return big, await c.error()

    big, error = run(main())
    assert big["type"] == "conversation.item.retrieved"
    assert big["item"]["content"] == [{"type": "input_audio", "transcript": None}]
    assert (error["code"], error["param"]) == ("invalid_value", "response.audio.output.voice")


def test_the_status_a_client_gives_an_item_does_not_hide_it_from_the_model(server: Server) -> None:
    """``status`` on ``conversation.item.create`` "has no effect on the conversation" (OpenAI's
    GA types). Items copied from ``conversation.item.added`` (an assistant item there is
    ``in_progress``), e.g. to restore a conversation, used to be stored as in progress and left
    out of every request the model got, silently (alone, the response failed: no messages)."""
    restored = [
        {**text_item("what is the weather?", "item_u1"), "status": "in_progress"},
        {**text_item("Sunny.", "item_a1", role="assistant"), "status": "in_progress"},
        {
            "type": "function_call",
            "id": "item_c1",
            "call_id": "call_1",
            "name": "f",
            "arguments": "{}",
            "status": "in_progress",
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "ok", "status": "in_progress"},
        {**text_item("and tomorrow?", "item_u2"), "status": "incomplete"},
    ]

    async def main() -> tuple[list[dict], dict]:
        async with connect(server, manual=True) as c:
            done = []
            for item in restored:
                await c.send({"type": "conversation.item.create", "item": item})
                done.append((await c.until("conversation.item.done"))[-1]["item"])
            await c.send({"type": "response.create", "response": {"output_modalities": ["text"]}})
            return done, (await c.until("response.done"))[-1]["response"]

    done, response = run(main())
    assert response["status"] == "completed", response
    assert [i["status"] for i in done] == ["completed", "completed", "completed", "completed", "incomplete"]
    messages = server.pipeline.requests[-1].messages
    assert [m.role for m in messages] == ["user", "assistant", "tool", "user"]
    assert messages[0].parts == (TextPart("what is the weather?"),)
    assert messages[1].parts == (TextPart("Sunny."), ToolCallPart("call_1", "f", "{}"))
    assert messages[2].parts == (ToolResultPart("call_1", "ok"),)
    assert messages[3].parts == (TextPart("and tomorrow?"),)
