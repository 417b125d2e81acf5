"""Slow clients, conversation caps and shutdown (issue 16): one session can never hurt another.

A client that stops reading while its response streams is closed (1008) once its send queue
passes ``max_send_queue_bytes``, its response cancelled, while a second session on the same server
completes its turn; a conversation over ``max_conversation_items`` / ``max_conversation_bytes``
refuses more items with ``conversation_limit_exceeded`` and is unchanged; a server stopping (as on
SIGTERM) ends a streaming response with ``response.done`` before closing with 1012.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import time
from collections.abc import Iterator

import pytest
import websockets
from omnirt.realtime.app import create_app
from omnirt.realtime.config import ServerConfig
from omnirt.stages.engine import Engine, EngineClient

from tests.server import serve_server

from .conftest import (
    MAX_FRAME,
    Client,
    RecordingPipeline,
    Server,
    connect,
    pcm_b64,
    run,
    running,
    text_item,
)

#: A reply of ~500 words: with audio, ~40 s of it (~2.6 MB of deltas), in ~2.5 s of engine time.
LONG = " ".join(f"w{i}" for i in range(500))
BOUND = 128 * 1024


@pytest.fixture(scope="module")
def bounded() -> Iterator[Server]:
    # the socket's hold off: these tests are about the bound of our own queue
    config = ServerConfig(max_send_queue_bytes=BOUND, hold_socket_bytes=0, max_sessions=4, **THREE_SIDE)
    with running(config) as s:
        yield s


@contextlib.asynccontextmanager
async def slow_client(server: Server):  # type: ignore[no-untyped-def]
    """A raw client that reads nothing it is not asked to: a 4 KiB socket receive buffer and room
    for one frame in the library, so the server's socket backs up as soon as it stops reading."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    port = int(server.base_url.rsplit(":", 1)[1])
    sock.connect(("127.0.0.1", port))
    async with websockets.connect(server.ws_url, sock=sock, max_queue=1, max_size=MAX_FRAME) as ws:
        client = Client(ws)
        assert (await client.recv())["type"] == "session.created"
        await client.send(
            {
                "type": "session.update",
                "session": {"type": "realtime", "audio": {"input": {"turn_detection": None}}},
            }
        )
        assert (await client.recv())["type"] == "session.updated"
        yield client


#: ``start_long_responses`` runs three out-of-band responses at once (the server's default: two).
THREE_SIDE = {"max_out_of_band_responses": 3}


async def start_long_responses(client: Client) -> list[str]:
    """The long reply, in band and three times out of band at once: ~10 MB of events, more than
    loopback's socket buffers absorb (the kernel grows a send buffer up to 4 MiB)."""
    await client.send({"type": "conversation.item.create", "item": text_item(LONG)})
    await client.send({"type": "response.create"})
    for _ in range(3):
        await client.send({"type": "response.create", "response": {"conversation": "none"}})
    ids: list[str] = []
    while len(ids) < 4:
        event = await client.recv()
        if event["type"] == "response.created":
            ids.append(event["response"]["id"])
    return ids


async def text_turn(server: Server) -> dict:
    async with connect(server, manual=True) as c:
        await c.send({"type": "conversation.item.create", "item": text_item("hello there")})
        await c.send({"type": "response.create", "response": {"output_modalities": ["text"]}})
        return (await c.until("response.done"))[-1]["response"]


async def wait_for(predicate, timeout: float) -> float:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, "timed out"
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


def test_a_client_that_stops_reading_is_closed_with_1008(bounded: Server) -> None:
    """The slow client reads up to response.created, then nothing: within seconds the server has
    cancelled its response (the engine drops it) and counted it closed, while a second session's
    turn completes. Reading again, the client gets what was already in the socket and then the
    close: 1008, reason naming the limit."""
    service, pipeline = bounded.service, bounded.pipeline
    before = service.slow_clients_closed

    async def main() -> tuple[float, dict, int | None, str]:
        async with slow_client(bounded) as slow:
            response_ids = await start_long_responses(slow)
            other = asyncio.create_task(text_turn(bounded))
            waited = await wait_for(lambda: service.slow_clients_closed > before, 10)
            done = await other
            # Cancelled, not left generating (the engine removes a request only when cancelled;
            # it does so on its own thread, at its next step boundary).
            await wait_for(lambda: set(response_ids) <= set(pipeline.removed), 5)
            assert set(response_ids) <= set(pipeline.removed)
            code = await slow.closed(timeout=10)
            return waited, done, code, slow.ws.close_reason

    waited, done, code, reason = run(main())
    assert waited < 5
    assert done["status"] == "completed"
    assert code == 1008 and str(BOUND) in reason and "behind" in reason


def test_a_client_that_never_reads_again_is_dropped(bounded: Server) -> None:
    """Not reading at all after response.created: the server ends the session in bounded time
    (close wait included) and the engine holds nothing for it."""
    service = bounded.service

    async def main() -> float:
        async with slow_client(bounded) as slow:
            base = service.active_sessions
            await start_long_responses(slow)
            t = await wait_for(lambda: service.active_sessions < base, 10)
            assert not bounded.pipeline.active
            slow.ws.transport.abort()
            return t

    assert run(main()) < 8


def test_well_behaved_long_response_is_not_cut(bounded: Server) -> None:
    """A client reading as it goes gets the whole long reply under the same small bound."""

    async def main() -> dict:
        async with connect(bounded, manual=True) as c:
            await c.send({"type": "conversation.item.create", "item": text_item(LONG)})
            await c.send({"type": "response.create"})
            return (await c.until("response.done", timeout=30))[-1]["response"]

    response = run(main())
    assert response["status"] in ("completed", "incomplete")


# -- held responses -------------------------------------------------------------------------
HOLD = 64 * 1024
HELD_SECONDS = 3.0


@pytest.fixture(scope="module")
def holding() -> Iterator[Server]:
    config = ServerConfig(
        hold_send_queue_bytes=HOLD, max_held_seconds=HELD_SECONDS, max_sessions=4, **THREE_SIDE
    )
    with running(config) as s:
        yield s


def words_made(server: Server, response_ids: list[str]) -> int:
    """Words the engine has made for these responses so far (the echo pipeline's progress)."""
    active = dict(server.pipeline.active)
    return sum(active[rid].sent for rid in response_ids if rid in active)


def test_a_client_behind_gets_no_compute_until_it_reads(holding: Server) -> None:
    """Once the slow client's queue passes the hold mark its responses are held: the engine makes
    nothing more for them (while another session's turn completes). Reading again, the client
    gets everything, the responses are released and complete, nothing cancelled, no close."""
    service = holding.service
    held_before = service.clients_held

    async def main() -> tuple[int, int, list[dict], dict]:
        async with slow_client(holding) as slow:
            response_ids = await start_long_responses(slow)
            await wait_for(lambda: service.clients_held > held_before, 10)
            await asyncio.sleep(0.2)  # the hold reaches the engine thread
            made = words_made(holding, response_ids)
            done = await text_turn(holding)  # the engine keeps serving others meanwhile
            await asyncio.sleep(1.0)
            made_later = words_made(holding, response_ids)
            finished = []
            while len(finished) < len(response_ids):  # read again: released, all of it comes
                event = await slow.recv(timeout=10)
                if event["type"] == "response.done":
                    finished.append(event["response"])
            return made, made_later, finished, done

    made, made_later, finished, done = run(main())
    assert made > 0 and made_later == made
    assert done["status"] == "completed"
    assert {r["status"] for r in finished} == {"completed"}
    assert service.slow_clients_closed == 0


@pytest.fixture(scope="module")
def socket_holding() -> Iterator[Server]:
    # a hold mark in our own queue that this test never reaches: only the socket's can hold
    config = ServerConfig(
        hold_send_queue_bytes=4 << 20,
        hold_socket_bytes=32 * 1024,
        max_held_seconds=10,
        max_sessions=4,
        **THREE_SIDE,
    )
    with running(config) as s:
        yield s


def test_a_client_whose_window_closed_is_held_before_our_queue_grows(socket_holding: Server) -> None:
    """A client that stops reading fills its receive buffer and the server's kernel send queue
    (``SIOCOUTQ``): held once 32 KiB sit there untaken, long before the server's own queue
    reaches its mark, so the engine makes a small part of the replies ahead of the client. Reading
    again releases it (the held connection's socket is polled) and everything completes."""
    service = socket_holding.service
    held_before = service.clients_held
    total = 4 * len(LONG.split())

    async def main() -> tuple[int, int, list[dict]]:
        async with slow_client(socket_holding) as slow:
            response_ids = await start_long_responses(slow)
            await wait_for(lambda: service.clients_held > held_before, 10)
            await asyncio.sleep(0.5)  # the hold reaches the engine thread
            made = words_made(socket_holding, response_ids)
            await asyncio.sleep(1.0)
            made_later = words_made(socket_holding, response_ids)
            finished = []
            while len(finished) < len(response_ids):
                event = await slow.recv(timeout=10)
                if event["type"] == "response.done":
                    finished.append(event["response"])
            return made, made_later, finished

    made, made_later, finished = run(main())
    assert 0 < made == made_later < total // 5, (made, total)
    assert {r["status"] for r in finished} == {"completed"}
    assert service.slow_clients_closed == 0


def test_a_client_held_too_long_is_closed_with_1008(holding: Server) -> None:
    """Held and still not reading for ``max_held_seconds``: closed with 1008 (reason naming the
    hold), its responses cancelled in the engine."""
    service = holding.service
    closed_before = service.slow_clients_closed
    held_before = service.clients_held

    async def main() -> tuple[float, int | None, str, list[str]]:
        async with slow_client(holding) as slow:
            response_ids = await start_long_responses(slow)
            await wait_for(lambda: service.clients_held > held_before, 10)
            waited = await wait_for(lambda: service.slow_clients_closed > closed_before, HELD_SECONDS + 5)
            await wait_for(lambda: set(response_ids) <= set(holding.pipeline.removed), 5)
            code = await slow.closed(timeout=10)
            return waited, code, slow.ws.close_reason, response_ids

    waited, code, reason, response_ids = run(main())
    assert HELD_SECONDS - 0.5 < waited < HELD_SECONDS + 2
    assert code == 1008 and f"{HELD_SECONDS:g} s" in reason and str(HOLD) in reason


# -- conversation caps ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def capped() -> Iterator[Server]:
    with running(ServerConfig(max_conversation_items=3, max_conversation_bytes=48_000)) as s:
        yield s


def test_conversation_caps(capped: Server) -> None:
    """With ``truncation: disabled``: three items fit; a fourth (create or commit) gets
    conversation_limit_exceeded; an item that would pass 48 000 bytes too; in-band response.create
    at the cap too. Nothing changes: the conversation still lists its three items, the input buffer
    still commits once room is made."""

    async def main() -> tuple[list[dict], list[str]]:
        async with connect(capped, manual=True) as c:
            disabled = {"type": "realtime", "truncation": "disabled"}
            await c.send({"type": "session.update", "session": disabled})
            await c.until("session.updated")
            for i in range(2):
                await c.send({"type": "conversation.item.create", "item": text_item("hi", f"it{i}")})
                await c.until("conversation.item.done")
            await c.send(
                {"type": "conversation.item.create", "item": text_item("x" * 50_000), "event_id": "evt_big"}
            )
            errors = [await c.error()]
            await c.send({"type": "conversation.item.create", "item": text_item("hi", "it2")})
            await c.until("conversation.item.done")
            await c.send(
                {"type": "conversation.item.create", "item": text_item("more"), "event_id": "evt_item"}
            )
            errors.append(await c.error())
            await c.send({"type": "input_audio_buffer.append", "audio": pcm_b64(200)})
            await c.send({"type": "input_audio_buffer.commit", "event_id": "evt_commit"})
            errors.append(await c.error())
            await c.send({"type": "response.create", "event_id": "evt_resp"})
            errors.append(await c.error())
            await c.send({"type": "conversation.item.delete", "item_id": "it0"})
            await c.until("conversation.item.deleted")
            await c.send({"type": "input_audio_buffer.commit"})  # the buffer was kept
            committed = await c.until("conversation.item.done")
            ids = [e["item"]["id"] for e in committed if e["type"] == "conversation.item.done"]
            return errors, ["it1", "it2", *ids]

    errors, ids = run(main())
    assert [(e["code"], e["event_id"]) for e in errors] == [
        ("conversation_limit_exceeded", "evt_big"),
        ("conversation_limit_exceeded", "evt_item"),
        ("conversation_limit_exceeded", "evt_commit"),
        ("conversation_limit_exceeded", "evt_resp"),
    ]
    assert "48000" in errors[0]["message"] and errors[0]["param"] == "item"
    assert "3" in errors[1]["message"]
    assert len(ids) == 3


def test_with_truncation_the_oldest_items_make_room(capped: Server) -> None:
    """Three items fit; with truncation (``auto``, the default) a fourth deletes the oldest items,
    up to the next user message (a conversation never starts with a reply), each told to the client
    (``conversation.item.deleted``) before the new item is added; a response.create at the cap
    deletes the oldest one too, never the reply before it, and the engine reads what is left."""

    def message(role: str, text: str, item_id: str) -> dict:
        kind = "output_text" if role == "assistant" else "input_text"
        return {"type": "message", "role": role, "content": [{"type": kind, "text": text}], "id": item_id}

    async def main() -> tuple[list[str], list[str], list[str], dict]:
        async with connect(capped, manual=True) as c:
            first_three = (("user", "hi", "u0"), ("assistant", "hello", "a0"), ("user", "again", "u1"))
            for role, text, item_id in first_three:
                await c.send({"type": "conversation.item.create", "item": message(role, text, item_id)})
                await c.until("conversation.item.done")
            start = len(c.events)
            await c.send({"type": "conversation.item.create", "item": message("user", "more", "u2")})
            await c.until("conversation.item.done")
            first = [e["type"] + ":" + (e.get("item_id") or e["item"]["id"]) for e in c.events[start:]]
            await c.send({"type": "response.create", "response": {"output_modalities": ["text"]}})
            await c.until("response.done")
            start = len(c.events)
            await c.send({"type": "response.create", "response": {"output_modalities": ["text"]}})
            done = (await c.until("response.done"))[-1]
            second = [e["item_id"] for e in c.events[start:] if e["type"] == "conversation.item.deleted"]
            await c.send({"type": "conversation.item.retrieve", "item_id": "u1", "event_id": "evt_gone"})
            gone = await c.error()
            return first, second, [gone["code"], gone["event_id"]], done

    before = len(capped.pipeline.requests)
    first, second, gone, done = run(main())
    assert first == [
        "conversation.item.deleted:u0",
        "conversation.item.deleted:a0",
        "conversation.item.added:u2",
        "conversation.item.done:u2",
    ]
    assert second == ["u1"]  # the first reply stays: it follows u2, the oldest user message left
    assert gone == ["item_retrieve_invalid_item_id", "evt_gone"]
    assert done["response"]["status"] == "completed"
    texts = [p.text for m in capped.pipeline.requests[-1].messages for p in m.parts if hasattr(p, "text")]
    assert "more" in texts and "again" not in texts and "hi" not in texts
    assert len(capped.pipeline.requests) == before + 2


def test_an_item_placed_after_a_deleted_one_names_what_it_follows_now(capped: Server) -> None:
    """An item created after one that the items cap then deletes: its ``conversation.item.added``
    names the item it follows once the oldest are gone (here none: it is the first)."""

    async def main() -> list[dict]:
        async with connect(capped, manual=True) as c:
            for i in range(3):
                await c.send({"type": "conversation.item.create", "item": text_item("hi", f"m{i}")})
                await c.until("conversation.item.done")
            start = len(c.events)
            await c.send(
                {"type": "conversation.item.create", "previous_item_id": "m0", "item": text_item("x", "m3")}
            )
            await c.until("conversation.item.done")
            return c.events[start:]

    events = run(main())
    assert [(e["type"], e.get("item_id")) for e in events[:1]] == [("conversation.item.deleted", "m0")]
    added = next(e for e in events if e["type"] == "conversation.item.added")
    assert added["item"]["id"] == "m3" and added["previous_item_id"] is None


@pytest.fixture(scope="module")
def byte_capped() -> Iterator[Server]:
    with running(ServerConfig(max_conversation_bytes=100_000)) as s:
        yield s


def test_with_truncation_old_audio_makes_room_for_a_long_spoken_session(byte_capped: Server) -> None:
    """A bytes cap of 100 000 (two turns of 400 ms: float32 at 24 kHz, 38 400 bytes each): with
    truncation (``auto``, the default) every further turn is taken, the oldest turns' audio
    dropped and left out of the model's context (their items stay, retrievable); with
    ``truncation: disabled`` the turn is refused as before, nothing dropped."""

    async def main() -> tuple[list[str], dict, dict, dict]:
        async with connect(byte_capped, manual=True) as c:
            ids = []
            for _ in range(4):
                await c.send({"type": "input_audio_buffer.append", "audio": pcm_b64(400)})
                await c.send({"type": "input_audio_buffer.commit"})
                event = await c.recv()
                assert event["type"] == "input_audio_buffer.committed", event
                ids.append(event["item_id"])
                await c.until("conversation.item.done")
            await c.send({"type": "response.create", "response": {"output_modalities": ["text"]}})
            await c.until("response.done")
            await c.send({"type": "conversation.item.retrieve", "item_id": ids[0]})
            oldest = (await c.until("conversation.item.retrieved"))[-1]
            await c.send(
                {"type": "session.update", "session": {"type": "realtime", "truncation": "disabled"}}
            )
            await c.until("session.updated")
            await c.send({"type": "input_audio_buffer.append", "audio": pcm_b64(400)})
            await c.send({"type": "input_audio_buffer.commit", "event_id": "evt_full"})
            refused = await c.error()
            await c.send({"type": "conversation.item.retrieve", "item_id": ids[-1]})
            newest = (await c.until("conversation.item.retrieved"))[-1]
            return ids, oldest, refused, newest

    before = len(byte_capped.pipeline.requests)
    ids, oldest, refused, newest = run(main())
    assert len(ids) == 4
    request = byte_capped.pipeline.requests[before]
    audios = [p for m in request.messages for p in m.parts if type(p).__name__ == "AudioPart"]
    assert len(audios) == 2  # two turns fit the cap: the two oldest were dropped
    assert oldest["item"]["id"] == ids[0] and not oldest["item"]["content"][0].get("audio")
    assert refused["code"] == "conversation_limit_exceeded" and refused["event_id"] == "evt_full"
    assert newest["item"]["content"][0]["audio"]  # the kept turns keep their audio


# -- graceful shutdown -----------------------------------------------------------------------
def test_shutdown_ends_the_streaming_response_before_closing_with_1012() -> None:
    """The server stopped as SIGTERM stops it, mid-response: the client gets response.done
    (cancelled, no reason) and its item's done events, then the close frame with 1012; an idle
    session on the same server is closed with 1012 too."""
    pipeline = RecordingPipeline(step_seconds=0.02)
    app = create_app(EngineClient(Engine(pipeline)), ServerConfig())
    with serve_server(app) as (base_url, uvicorn_server):
        server = Server(base_url, app.state.client.engine, pipeline, app.state.realtime, app.state.config)

        async def main() -> tuple[list[dict], int | None, int | None]:
            async with connect(server, manual=True) as c, connect(server) as idle:
                await c.send({"type": "conversation.item.create", "item": text_item(LONG)})
                await c.send({"type": "response.create"})
                await c.until("response.output_audio.delta")
                uvicorn_server.handle_exit(signal.SIGTERM, None)
                start = len(c.events)
                code = await c.closed(timeout=10)
                return c.events[start:], code, await idle.closed(timeout=10)

        events, code, idle_code = run(main())
    types = [e["type"] for e in events]
    assert "response.done" in types
    done = events[types.index("response.done")]["response"]
    assert done["status"] == "cancelled" and done["status_details"] == {"type": "cancelled"}
    assert types[-1] == "response.done"
    assert code == 1012 and idle_code == 1012


def test_realtime_connections_get_a_fixed_kernel_send_buffer() -> None:
    """``ws_send_buffer_bytes``: the upgraded connection's socket gets that SO_SNDBUF (Linux
    doubles it), so a client that reads nothing is seen behind after kilobytes, not after the
    megabytes an automatically grown buffer absorbs; 0 leaves the kernel's sizing."""
    from unittest import mock

    import uvicorn
    from omnirt.realtime.ws_protocol import websocket_protocol
    from uvicorn.server import ServerState

    for asked in (64 * 1024, 0):
        a, b = socket.socketpair()
        with a, b:
            before = a.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
            transport = mock.Mock()
            transport.get_extra_info.side_effect = lambda name, default=None, s=a: {
                "socket": s,
                "peername": ("127.0.0.1", 5000),
                "sockname": ("127.0.0.1", 8000),
            }.get(name, default)

            async def made(transport=transport, asked=asked) -> None:  # the protocol needs a loop
                protocol = websocket_protocol(asked)(
                    config=uvicorn.Config(app=None), server_state=ServerState(), app_state={}
                )
                protocol.connection_made(transport)

            run(made())
            after = a.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
            assert after == (2 * asked if asked else before)
