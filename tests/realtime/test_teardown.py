"""Session teardown frees memory at once (issue 16): nothing of a closed session is left in a
reference cycle for the garbage collector.

With the collector off, sessions of every ending run through a real server: a completed text
turn, a barge-in by real speech during a long reply, refused events and a client that drops its
socket mid-reply, a client closed for falling behind, and one closed for idling. Then a collection
with ``DEBUG_SAVEALL`` lists everything that only the collector could free: none of it may be the
server's (omnirt's, starlette's or uvicorn's objects). Before the fix every session, its
connection, conversation, audio buffers and VAD stream stayed until the next full collection.
"""

from __future__ import annotations

import asyncio
import collections
import gc
from collections.abc import Iterator

import pytest
from omnirt.realtime.config import ServerConfig

from tests.vad.speech import SENTENCES, place, spoken

from .conftest import Server, connect, run, running, text_item
from .test_backpressure import BOUND, THREE_SIDE, slow_client, start_long_responses, wait_for
from .test_barge_in import LONG, start_long_reply
from .vad_helpers import stream_audio, vad_update

#: Modules whose objects must never wait for the collector (the server side of a session).
SERVER_MODULES = ("omnirt.", "starlette.", "uvicorn.")
IDLE_SECONDS = 2.0


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    # (the socket's hold off: the slow client here falls past the bound of the queue and is closed)
    config = ServerConfig(
        max_send_queue_bytes=BOUND, max_idle_seconds=IDLE_SECONDS, hold_socket_bytes=0, **THREE_SIDE
    )
    with running(config, step_seconds=0.01) as s:
        yield s


@pytest.fixture
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
        gc.collect()


def left_to_the_collector() -> collections.Counter[str]:
    """What a collection finds unreachable (only cycles: everything else was freed already),
    counted by type, for the server's modules."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.collect()
    found: collections.Counter[str] = collections.Counter()
    for obj in gc.garbage:
        kind = type(obj)
        if kind.__module__.startswith(SERVER_MODULES):
            found[f"{kind.__module__}.{kind.__qualname__}"] += 1
    return found


async def completed_turn(server: Server) -> None:
    async with connect(server, manual=True) as c:
        await c.send({"type": "conversation.item.create", "item": text_item("hello there")})
        await c.send({"type": "response.create"})
        await c.until("response.done")


async def barge_in(server: Server) -> None:
    placed = place(spoken(SENTENCES[1]), lead_ms=200, tail_ms=700)
    async with connect(server) as c:
        await c.send(vad_update(silence_duration_ms=400))
        await c.until("session.updated")
        await start_long_reply(c, 160)
        await stream_audio(c, placed.pcm16(), speed=20)
        await c.until("input_audio_buffer.committed")


async def refused_then_dropped(server: Server) -> None:
    async with connect(server, manual=True) as c:
        await c.send("{not json")
        await c.send({"type": "no.such.event"})
        await c.send({"type": "session.update", "session": {"type": "realtime", "voice": 7}})
        await c.send({"type": "conversation.item.delete", "item_id": "item_missing"})
        for _ in range(4):
            await c.error()
        await c.send({"type": "conversation.item.create", "item": text_item(LONG)})
        await c.send({"type": "response.create"})
        await c.until("response.output_audio.delta")
        c.ws.transport.abort()  # gone without a close frame, mid-reply


async def fell_behind(server: Server) -> None:
    before = server.service.slow_clients_closed
    async with slow_client(server) as slow:
        await start_long_responses(slow)  # then reads nothing until the server gave up on it
        await wait_for(lambda: server.service.slow_clients_closed > before, IDLE_SECONDS)
        assert await slow.closed(timeout=10) == 1008


async def idled(server: Server) -> None:
    async with connect(server) as c:
        assert await c.closed(timeout=IDLE_SECONDS + 5) == 1001


def test_closed_sessions_leave_nothing_to_the_collector(server: Server, collector_off: None) -> None:
    async def main() -> None:
        await completed_turn(server)  # warm-up: first-use caches are not garbage
        gc.collect()
        await asyncio.gather(
            completed_turn(server),
            barge_in(server),
            refused_then_dropped(server),
            fell_behind(server),
            idled(server),
        )
        await wait_for(lambda: server.service.active_sessions == 0, 15)
        await wait_for(lambda: not server.pipeline.active, 5)

    run(main())
    found = left_to_the_collector()
    assert not found, f"left in reference cycles: {dict(found)}"


def test_a_failed_writer_leaves_no_cycle(collector_off: None) -> None:
    """The writer fails when the client vanishes mid-send; awaiting it put the awaiting frames,
    which hold the task, into its exception's traceback: without ``drop_traceback`` the task (and
    all that its frames hold: the connection) waited for the collector. Deterministic, where the
    test above meets the race only sometimes."""
    import weakref

    from omnirt.realtime.ws import drop_traceback

    async def fails() -> None:
        raise ConnectionResetError("the client is gone")

    async def owner(drop: bool) -> weakref.ref[asyncio.Task[None]]:
        writer = asyncio.create_task(fails())
        await asyncio.sleep(0)
        try:
            await writer
        except ConnectionResetError:
            pass
        if drop:
            drop_traceback(writer)
        return weakref.ref(writer)

    kept = asyncio.run(owner(drop=False))
    assert kept() is not None  # the cycle: only the collector frees it
    gc.collect()
    freed = asyncio.run(owner(drop=True))
    assert freed() is None
