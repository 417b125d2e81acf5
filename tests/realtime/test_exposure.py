"""Exposure on the realtime WebSocket (issue 16): the Origin allow-list (same-origin by default:
a foreign page's handshake is refused with 403 before the upgrade) and error events that carry
no filesystem path or heap address. Real servers on loopback; every frame validated strictly."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import time
from collections.abc import Iterator

import numpy as np
import pytest
import websockets
from omnirt.realtime.app import create_app
from omnirt.realtime.config import ServerConfig
from omnirt.stages.engine import Engine, EngineClient
from PIL import Image

from tests.leaky import LeakyPipeline, assert_nothing_internal
from tests.server import serve

from .conftest import Server, connect, running, text_item


def _refused_status(server: Server, origin: str) -> int:
    async def go() -> int:
        with pytest.raises(websockets.InvalidStatus) as info:
            async with websockets.connect(server.ws_url, origin=origin):  # type: ignore[arg-type]
                pass
        return info.value.response.status_code

    return asyncio.run(go())


def _session_opens(server: Server, origin: str | None) -> None:
    async def go() -> None:
        headers = {"Origin": origin} if origin else None
        async with connect(server, headers=headers) as client:  # waits for a valid session.created
            update = {"type": "realtime", "instructions": "x"}
            await client.send({"type": "session.update", "session": update})
            assert (await client.recv())["type"] == "session.updated"

    asyncio.run(go())


def test_a_foreign_page_cannot_open_a_session_but_its_own_page_and_sdks_can(server: Server) -> None:
    for origin in ("https://evil.example", "null", "http://127.0.0.1:1", "http://localhost.evil.example"):
        assert _refused_status(server, origin) == 403
    _session_opens(server, server.base_url)  # the served UI's own origin: http://127.0.0.1:PORT
    _session_opens(server, None)  # SDKs and servers send no Origin
    deadline = time.monotonic() + 5  # the server ends a closed session on its own loop: wait for it
    while server.service.active_sessions and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.service.active_sessions == 0


@pytest.mark.parametrize("allowed", [["https://app.example"], ["*"]])
def test_allowed_origins_open_sessions(allowed: list[str]) -> None:
    with running(ServerConfig(allowed_origins=allowed)) as server:
        _session_opens(server, "https://app.example")
        if allowed == ["*"]:
            _session_opens(server, "https://other.example")
        else:
            assert _refused_status(server, "https://other.example") == 403


@contextlib.contextmanager
def leaky_server() -> Iterator[Server]:
    config = ServerConfig(vad_preload=False)
    pipeline = LeakyPipeline()
    engine = Engine(pipeline)
    app = create_app(EngineClient(engine), config)
    with serve(app) as base_url:
        yield Server(base_url, engine, pipeline, app.state.realtime, config)  # type: ignore[arg-type]


def _image_item(data: bytes, mime: str) -> dict:
    url = f"data:{mime};base64," + base64.b64encode(data).decode()
    content = [{"type": "input_text", "text": "look"}, {"type": "input_image", "image_url": url}]
    return {"type": "message", "role": "user", "content": content}


def test_an_unreadable_image_is_refused_when_added_and_the_session_goes_on() -> None:
    """An image no decoder identifies is refused at ``conversation.item.create`` (it would fail every
    later response), with PIL's message and no heap address; nothing is added."""

    async def go() -> tuple[list[dict], list[dict]]:
        with leaky_server() as server:
            async with connect(server, manual=True) as client:
                await client.send(
                    {"type": "conversation.item.create", "item": _image_item(b"not an image", "image/png")}
                )
                refused = await client.until("error")
                await client.send({"type": "conversation.item.create", "item": text_item("hi")})
                await client.until("conversation.item.done")
                await client.send({"type": "response.create"})
                return refused, await client.until("response.done")

    refused, answered = asyncio.run(go())
    error = refused[-1]["error"]
    assert (error["code"], error["param"]) == ("invalid_value", "item"), error
    assert "The image could not be read: cannot identify image file <object>" in error["message"]
    assert_nothing_internal(error["message"])
    assert not [e for e in refused if e["type"] == "conversation.item.added"]
    response = answered[-1]["response"]
    assert response["status"] == "completed", response  # the refused image is not in its context


def test_an_image_that_fails_to_decode_fails_the_response_without_paths_or_addresses() -> None:
    """A JPEG cut in its scan data is identified and passes the check when added; decoding it for
    the response fails, and the failure shows no path of the model folder or heap address."""
    whole = io.BytesIO()
    pixels = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(whole, "JPEG")
    cut = whole.getvalue()[: len(whole.getvalue()) * 3 // 4]

    async def go() -> list[dict]:
        with leaky_server() as server:
            async with connect(server, manual=True) as client:
                await client.send(
                    {"type": "conversation.item.create", "item": _image_item(cut, "image/jpeg")}
                )
                await client.until("conversation.item.done")
                await client.send({"type": "response.create"})
                return await client.until("response.done")

    events = asyncio.run(go())
    done = events[-1]["response"]
    assert done["status"] == "failed", done
    failures = [e["error"]["message"] for e in events if e["type"] == "error"]
    failures.append(done["status_details"]["error"]["message"])
    assert any("could not be decoded: image file is truncated" in m for m in failures), failures
    for message in failures:
        assert_nothing_internal(message)
