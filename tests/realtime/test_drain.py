"""Draining one server (``RealtimeService.drain``), without Ray: what a replica that Ray Serve
removes does (realtime/replicas/drain.py calls it on the replica's event loop; here it runs on
the uvicorn server's loop the same way).

While draining, a new session is closed with 1012 before ``session.created`` (its client
reconnects, to another replica); live sessions go on for the grace period, a turn in it
completes as usual; once the grace is over, a response still streaming ends with
``response.done`` (``cancelled``) and its item's done events, then every session left closes with
1001 ``server draining`` (docs/replicas.md, "Draining").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Iterator
from contextlib import contextmanager

import websockets
from omnirt.realtime.app import create_app
from omnirt.realtime.config import ServerConfig
from omnirt.stages.engine import Engine, EngineClient

from tests.server import serve_server

from .conftest import MAX_FRAME, Client, RecordingPipeline, Server, connect, run, text_item

#: A reply of ~500 words: at 20 ms a step, ~10 s of streaming (far past the grace below).
LONG = " ".join(f"w{i}" for i in range(500))


@contextmanager
def draining_server(step_seconds: float = 0.005) -> Iterator[tuple[Server, asyncio.AbstractEventLoop]]:
    """A server (uvicorn in a thread, as ``omnirt serve`` runs) and the event loop it serves on."""
    pipeline = RecordingPipeline(step_seconds=step_seconds)
    app = create_app(EngineClient(Engine(pipeline)), ServerConfig(shutdown_grace_seconds=5.0))
    with serve_server(app) as (base_url, uvicorn_server):
        server = Server(base_url, app.state.client.engine, pipeline, app.state.realtime, app.state.config)
        yield server, uvicorn_server.servers[0].get_loop()


def start_drain(
    server: Server, loop: asyncio.AbstractEventLoop, grace: float
) -> concurrent.futures.Future[None]:
    """``drain(grace)`` on the server's loop, as the replica runs it; returns once it drains."""
    future = asyncio.run_coroutine_threadsafe(server.service.drain(grace), loop)
    deadline = time.monotonic() + 5
    while not server.service.draining:
        assert time.monotonic() < deadline, "drain did not start"
        time.sleep(0.01)
    return future


def test_draining_refuses_new_sessions_with_1012_and_closes_idle_ones_with_1001_after_the_grace() -> None:
    grace = 1.5
    with draining_server() as (server, loop):

        async def main() -> None:
            async with connect(server, manual=True) as idle:
                seen = len(idle.events)
                began = time.monotonic()
                drained = asyncio.wrap_future(start_drain(server, loop, grace))
                # A new session: accepted by the WebSocket, then closed with 1012 and nothing else.
                async with websockets.connect(server.ws_url, max_size=MAX_FRAME) as ws:
                    fresh = Client(ws)
                    assert await fresh.closed() == 1012
                    assert fresh.events == []
                assert server.service.active_sessions == 1
                # The live session goes on within the grace: it still answers.
                await idle.send(
                    {"type": "session.update", "session": {"type": "realtime", "instructions": "x"}}
                )
                assert (await idle.recv())["type"] == "session.updated"
                assert not drained.done()
                # Then it is closed: 1001 with the reason, no event before the close.
                assert await idle.closed(timeout=grace + 5) == 1001
                assert idle.ws.close_reason == "server draining"
                assert time.monotonic() - began >= grace
                assert [e["type"] for e in idle.events[seen:]] == ["session.updated"]
                await asyncio.wait_for(drained, 5)
                assert server.service.active_sessions == 0

        run(main())


def test_drain_lets_turns_complete_and_cancels_the_response_still_streaming_at_the_grace() -> None:
    grace = 2.0
    with draining_server(step_seconds=0.02) as (server, loop):

        async def main() -> None:
            async with connect(server, manual=True) as streaming, connect(server, manual=True) as short:
                await streaming.send({"type": "conversation.item.create", "item": text_item(LONG)})
                await streaming.send({"type": "response.create"})
                await streaming.until("response.output_audio.delta")
                began = time.monotonic()
                drained = asyncio.wrap_future(start_drain(server, loop, grace))
                # A turn started during the drain completes as usual.
                await short.send({"type": "conversation.item.create", "item": text_item("hello there")})
                await short.send({"type": "response.create"})
                done = (await short.until("response.done"))[-1]["response"]
                assert done["status"] == "completed", done
                assert time.monotonic() - began < grace, "the short turn should end within the grace"
                # The long response streams on until the grace is over, then is cut.
                seen = len(streaming.events)
                code = await streaming.closed(timeout=grace + 10)
                assert time.monotonic() - began >= grace
                assert code == 1001 and streaming.ws.close_reason == "server draining"
                tail = streaming.events[seen:]
                types = [e["type"] for e in tail]
                assert "response.output_audio.delta" in types, "it should have streamed during the grace"
                assert types[-1] == "response.done", types[-8:]
                cancelled = tail[-1]["response"]
                assert cancelled["status"] == "cancelled" and cancelled["status_details"] == {
                    "type": "cancelled"
                }
                # Its item ends too (the done events come before response.done).
                item_id = cancelled["output"][0]["id"]
                assert any(
                    e["type"] == "response.output_item.done" and e["item"]["id"] == item_id for e in tail
                )
                assert any(e["type"] == "conversation.item.done" and e["item"]["id"] == item_id for e in tail)
                # The session whose turn had completed closes at the same time, with the same code.
                assert await short.closed(timeout=5) == 1001
                assert short.ws.close_reason == "server draining"
                await asyncio.wait_for(drained, 5)

        run(main())


def test_drain_returns_once_the_sessions_have_left_before_the_grace() -> None:
    grace = 30.0
    with draining_server() as (server, loop):

        async def main() -> None:
            async with connect(server, manual=True):
                drained = asyncio.wrap_future(start_drain(server, loop, grace))
                await asyncio.sleep(0.3)
                assert not drained.done()
            # The client left: the drain ends long before its grace (it polls every 0.2 s).
            began = time.monotonic()
            await asyncio.wait_for(drained, 5)
            assert time.monotonic() - began < 2

        run(main())
