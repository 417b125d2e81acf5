"""Server limits added with issue 4, each with its own error code and the session unchanged.

The older limits are tested beside the features they guard: max sessions
(test_connection: resource_exhausted, close 1013), session lifetime (test_connection:
session_expired, close 1001), buffered input bytes and append size (test_errors:
input_backpressure / invalid_value), client frame size (test_errors: invalid_event).
"""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
from omnirt.realtime.config import ServerConfig

from .conftest import Server, connect, pcm_b64, png, run, running, text_item
from .vad_helpers import vad_update


@pytest.fixture(scope="module")
def limited() -> Iterator[Server]:
    config = ServerConfig(
        max_images_per_session=2, max_image_bytes=1000, max_idle_seconds=0.6, max_vad_backlog_ms=500
    )
    with running(config) as s:
        yield s


def image_item(size: int) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(png(size)).decode()
    return {"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": url}]}


def test_images_per_session_and_image_bytes(limited: Server) -> None:
    """With ``truncation: disabled``: two images fit; a third gets image_limit_exceeded (param
    item); an image over 1000 bytes gets image_limit_exceeded, in an item or in response.input;
    deleting an image frees its place. The conversation is unchanged by each refusal."""

    async def main() -> tuple[list[dict], list[str]]:
        async with connect(limited) as c:
            await c.send(
                {"type": "session.update", "session": {"type": "realtime", "truncation": "disabled"}}
            )
            await c.until("session.updated")
            errors = []
            for i in range(2):
                await c.send(
                    {"type": "conversation.item.create", "item": {**image_item(500), "id": f"img{i}"}}
                )
                await c.until("conversation.item.done")
            await c.send(
                {"type": "conversation.item.create", "item": image_item(500), "event_id": "evt_third"}
            )
            errors.append(await c.error())
            await c.send({"type": "conversation.item.delete", "item_id": "img0"})
            await c.until("conversation.item.deleted")
            await c.send(
                {"type": "conversation.item.create", "item": image_item(1001), "event_id": "evt_big"}
            )
            errors.append(await c.error())
            await c.send(
                {
                    "type": "response.create",
                    "response": {"input": [image_item(1001)]},
                    "event_id": "evt_input",
                }
            )
            errors.append(await c.error())
            await c.send({"type": "conversation.item.create", "item": {**image_item(1000), "id": "img2"}})
            await c.until("conversation.item.done")
            ids = []
            for item_id in ("img0", "img1", "img2"):
                await c.send({"type": "conversation.item.retrieve", "item_id": item_id})
                event = await c.recv()
                ids.append(event["item"]["id"] if event["type"] != "error" else event["error"]["code"])
            return errors, ids

    errors, ids = run(main())
    assert [(e["code"], e["event_id"]) for e in errors] == [
        ("image_limit_exceeded", "evt_third"),
        ("image_limit_exceeded", "evt_big"),
        ("image_limit_exceeded", "evt_input"),
    ]
    assert "2" in errors[0]["message"] and "1000" in errors[1]["message"]
    assert ids == ["item_retrieve_invalid_item_id", "img1", "img2"]


def test_with_truncation_a_new_image_leaves_the_oldest_out_of_the_context(limited: Server) -> None:
    """With truncation (``auto``, the default) a camera can send a frame every turn: past
    ``max_images`` (2 here) each new image leaves the oldest messages, up to the oldest image, out
    of the model's context, as a truncation would, instead of being refused; they stay in the
    conversation. An image over the size limit is still refused."""

    async def main() -> tuple[list[str], dict, dict]:
        async with connect(limited, manual=True) as c:
            types = []
            for i in range(5):
                await c.send(
                    {"type": "conversation.item.create", "item": {**image_item(500), "id": f"cam{i}"}}
                )
                types.append((await c.recv())["type"])
                await c.until("conversation.item.done")
                await c.send(
                    {"type": "conversation.item.create", "item": text_item(f"what now {i}?", f"ask{i}")}
                )
                await c.until("conversation.item.done")
            await c.send({"type": "response.create", "response": {"output_modalities": ["text"]}})
            await c.until("response.done")
            await c.send({"type": "conversation.item.retrieve", "item_id": "cam0"})
            oldest = (await c.until("conversation.item.retrieved"))[-1]
            await c.send({"type": "conversation.item.create", "item": image_item(1001)})
            return types, oldest, await c.error()

    before = len(limited.pipeline.requests)
    types, oldest, error = run(main())
    assert types == ["conversation.item.added"] * 5
    request = limited.pipeline.requests[before]
    parts = [type(p).__name__ for m in request.messages for p in m.parts]
    assert parts.count("ImagePart") == 2  # cam3 and cam4
    texts = [p.text for m in request.messages for p in m.parts if type(p).__name__ == "TextPart"]
    assert texts[0] == "what now 2?"  # everything up to cam2 left out, the rest kept
    assert oldest["item"]["id"] == "cam0"
    assert error["code"] == "image_limit_exceeded"


def test_idle_connection_is_closed(limited: Server) -> None:
    """No client event for max_idle_seconds (0.6 s): session_idle_timeout, then close 1001. Events
    keep a session alive past that."""

    async def main() -> tuple[float, dict, int | None]:
        async with connect(limited) as c:
            for _ in range(4):  # 1.2 s of activity, 0.3 s apart
                await asyncio.sleep(0.3)
                await c.send({"type": "input_audio_buffer.clear"})
                await c.until("input_audio_buffer.cleared")
            t0 = time.perf_counter()
            error = await c.error()
            waited = time.perf_counter() - t0
            return waited, error, await c.closed()

    waited, error, code = run(main())
    assert error["code"] == "session_idle_timeout" and code == 1001
    assert 0.2 < waited < 2.0


def test_vad_falling_behind_gets_input_backpressure(limited: Server) -> None:
    """With the VAD process stalled (SIGSTOP), 1 s of audio leaves it over 500 ms behind: the next
    append gets input_backpressure; once it runs again and has caught up, appends are accepted."""

    async def main() -> tuple[dict, list[str]]:
        async with connect(limited) as c:
            await c.send(vad_update())
            await c.until("session.updated")
            pid = limited.service.vad._proc.pid  # type: ignore[union-attr]
            os.kill(pid, signal.SIGSTOP)
            try:
                await c.send({"type": "input_audio_buffer.append", "audio": pcm_b64(1000)})
                await c.send(
                    {"type": "input_audio_buffer.append", "audio": pcm_b64(100), "event_id": "evt_late"}
                )
                error = await c.error()
            finally:
                os.kill(pid, signal.SIGCONT)
            await asyncio.sleep(0.3)  # the VAD catches up (and the session stays under the idle limit)
            await c.send({"type": "input_audio_buffer.append", "audio": pcm_b64(100)})
            await c.send({"type": "input_audio_buffer.clear"})
            return error, [e["type"] for e in await c.until("input_audio_buffer.cleared")]

    error, after = run(main())
    assert (error["code"], error["param"], error["event_id"]) == ("input_backpressure", "audio", "evt_late")
    assert "behind" in error["message"]
    assert after == ["input_audio_buffer.cleared"]
