"""A replica handing a request to another (realtime/replicas/relay.py, ingress.py), between two real
servers on loopback: a front replica whose session slots are all taken (or that does not hold a
video job) and a peer, a small app recording what reaches it. No Ray: the peer table is given."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import websockets
from omnirt.realtime.http.body import read_body
from omnirt.realtime.http.errors import EXCEPTION_HANDLERS
from omnirt.realtime.replicas.fleet import ReplicaReport
from omnirt.realtime.replicas.ingress import FleetIngress, IngressMiddleware, Peers
from omnirt.realtime.replicas.load import ReplicaLoad
from omnirt.realtime.replicas.relay import FORWARDED_HEADER
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from tests.server import serve

HEADER = "x-omnirt-replica"
JOB = "video_peer_abcdefghijklmnopqrst"
#: The front replica's limit on a request body (``max_http_body_bytes``).
LIMIT = 1000


class Realtime:
    draining = False
    shutting_down = False


def peer_app(seen: list[Any]) -> Starlette:
    """The other replica: echoes a session's frames, refuses one when asked, answers job requests."""

    async def realtime(ws: WebSocket) -> None:
        seen.append(("headers", dict(ws.headers), dict(ws.query_params)))
        offered = [p.strip() for p in ws.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
        await ws.accept(subprotocol=offered[0] if offered else None, headers=[(HEADER.encode(), b"peer")])
        if ws.query_params.get("refuse"):
            await ws.send_text(json.dumps({"type": "error", "code": "resource_exhausted"}))
            await ws.close(1013, "full")
            return
        try:
            while True:
                message = await ws.receive()
                if message["type"] == "websocket.disconnect":
                    seen.append(("closed", message.get("code")))
                    return
                if message.get("text") is not None:
                    await ws.send_text("echo " + message["text"])
                else:
                    await ws.send_bytes(message["bytes"][::-1])
        except WebSocketDisconnect as exc:
            seen.append(("closed", exc.code))

    async def job(request: Request) -> Any:
        body = await request.body()
        forwarded = request.headers.get(FORWARDED_HEADER)
        seen.append(("job", request.method, request.url.query, body, forwarded, request.headers["host"]))

        async def chunks() -> Any:
            for i in range(3):
                yield f"part {i};".encode()
                await asyncio.sleep(0.01)

        if request.url.path.endswith("/content"):
            return StreamingResponse(chunks(), media_type="video/mp4", headers={HEADER: "peer"})
        return JSONResponse({"id": JOB, "method": request.method}, headers={HEADER: "peer"})

    async def chat(request: Request) -> JSONResponse:
        body = await request.body()
        seen.append(("chat", len(body)))
        return JSONResponse({"bytes": len(body)}, headers={HEADER: "peer"})

    return Starlette(
        routes=[
            WebSocketRoute("/v1/realtime", realtime),
            Route(f"/v1/videos/{JOB}", job, methods=["GET", "DELETE"]),
            Route(f"/v1/videos/{JOB}/content", job, methods=["GET"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
        ]
    )


def front_app(peer_address: str, capacity: int) -> tuple[Starlette, FleetIngress]:
    """This replica: its own sessions refused at once (as ``resource_exhausted`` would)."""

    async def realtime(ws: WebSocket) -> None:
        await ws.accept(headers=[(HEADER.encode(), b"front")])
        await ws.send_text(json.dumps({"type": "error", "code": "here"}))
        await ws.close(1013)

    async def job(request: Request) -> JSONResponse:
        return JSONResponse({"error": "not here"}, status_code=404, headers={HEADER: "front"})

    async def chat(request: Request) -> JSONResponse:
        body = await read_body(request, LIMIT)  # the server's own reader: 413 past the limit
        return JSONResponse({"bytes": len(body)}, headers={HEADER: "front"})

    async def drain(request: Request) -> JSONResponse:
        await ingress.drain(0.3)
        return JSONResponse({})

    app = Starlette(
        routes=[
            WebSocketRoute("/v1/realtime", realtime),
            Route("/v1/videos/{id}", job, methods=["GET"]),
            Route("/drain", drain, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
        ],
        exception_handlers=EXCEPTION_HANDLERS,  # type: ignore[arg-type]
    )
    peers = Peers("front")
    peers.update([ReplicaReport("peer", ReplicaLoad(4, 0, 0), address=peer_address)])
    ingress = FleetIngress(
        replica="front",
        capacity=capacity,
        realtime=Realtime(),
        engine_queue=lambda: 3,  # busier than the peer (0): engine requests go there
        peers=peers,
        replica_header=HEADER,
        max_body_bytes=LIMIT,
    )
    app.add_middleware(IngressMiddleware, ingress=ingress)
    return app, ingress


#: The front replica's URL, what reached the peer, and the front replica's routing.
Replicas = tuple[str, list[Any], FleetIngress]


@pytest.fixture
def replicas() -> Iterator[Replicas]:
    seen: list[Any] = []
    with serve(peer_app(seen)) as peer_url:
        app, ingress = front_app(peer_url.removeprefix("http://"), capacity=0)
        with serve(app) as front_url:
            yield front_url, seen, ingress


async def until(done: Any, seconds: float = 5.0) -> None:
    """Until ``done()`` holds (what a server thread does after the client has seen the end)."""
    for _ in range(int(seconds / 0.02)):
        if done():
            return
        await asyncio.sleep(0.02)
    assert done()


def handed(ingress: FleetIngress, kind: str) -> float:
    """The replica's ``omnirt_replica_handoffs_total{kind}``."""
    samples = [s for family in ingress.handoffs.collect() for s in family.samples]
    return next(s.value for s in samples if s.name.endswith("_total") and s.labels["kind"] == kind)


def ws_url(base: str, query: str = "") -> str:
    return base.replace("http://", "ws://") + "/v1/realtime?model=m" + query


def test_a_session_on_a_full_replica_is_relayed_both_ways(
    replicas: tuple[str, list[Any], FleetIngress],
) -> None:
    front, seen, ingress = replicas

    async def go() -> None:
        async with websockets.connect(
            ws_url(front),
            subprotocols=["realtime", "openai-insecure-api-key.k"],  # type: ignore[list-item]
            additional_headers={"Authorization": "Bearer k", "OpenAI-Beta": "realtime=v1"},
            max_size=None,
        ) as ws:
            assert ws.response.headers[HEADER] == "peer" and ws.subprotocol == "realtime"
            await ws.send("hello")
            assert await ws.recv() == "echo hello"
            await ws.send(b"\x01\x02\x03")
            assert await ws.recv() == b"\x03\x02\x01"
            big = "x" * (4 << 20)  # a 4 MiB frame crosses whole
            await ws.send(big)
            assert await ws.recv() == "echo " + big
        await until(lambda: ("closed", 1000) in seen and not ingress.relays)

    asyncio.run(go())
    kind, headers, query = seen[0]
    assert headers["authorization"] == "Bearer k" and headers["openai-beta"] == "realtime=v1"
    assert headers[FORWARDED_HEADER] == "1" and query == {"model": "m"}
    assert headers["host"] == front.removeprefix("http://")  # the client's, for the origin check
    assert ("closed", 1000) in seen, seen  # the client's close reached the peer
    assert not ingress.relays and ingress.open_sessions == 0
    assert handed(ingress, "session") == 1


def test_a_client_gone_without_a_close_is_going_away_for_the_peer(replicas: Replicas) -> None:
    front, seen, ingress = replicas

    async def go() -> None:
        ws = await websockets.connect(ws_url(front))
        await ws.send("hi")
        assert await ws.recv() == "echo hi"
        ws.transport.abort()  # the TCP connection cut, no close frame (the relay reads 1006)
        await until(lambda: ("closed", 1001) in seen and not ingress.relays)

    asyncio.run(go())


def test_the_peers_close_code_and_reason_reach_the_client(
    replicas: tuple[str, list[Any], FleetIngress],
) -> None:
    front, _, _ = replicas

    async def go() -> None:
        async with websockets.connect(ws_url(front, "&refuse=1")) as ws:
            assert json.loads(await ws.recv())["code"] == "resource_exhausted"
            with pytest.raises(websockets.ConnectionClosed):
                await ws.recv()
            assert (ws.close_code, ws.close_reason) == (1013, "full")

    asyncio.run(go())


def test_a_draining_replica_closes_its_relays_with_1001(
    replicas: tuple[str, list[Any], FleetIngress],
) -> None:
    front, _, ingress = replicas

    async def go() -> None:
        async with websockets.connect(ws_url(front)) as ws, httpx.AsyncClient(base_url=front) as http:
            await ws.send("hi")
            assert await ws.recv() == "echo hi"
            drained = asyncio.create_task(http.post("/drain"))  # the replica's drain, 0.3 s of grace
            await ws.send("still")
            assert await ws.recv() == "echo still"  # relays go on within the grace
            with pytest.raises(websockets.ConnectionClosed):
                await ws.recv()
            assert (ws.close_code, ws.close_reason) == (1001, "server draining")
            assert (await drained).status_code == 200
        await until(lambda: not ingress.relays)  # its end runs on the server's thread, after the close

    asyncio.run(go())


def test_a_video_jobs_request_is_forwarded_to_its_replica(
    replicas: tuple[str, list[Any], FleetIngress],
) -> None:
    front, seen, _ = replicas
    with httpx.Client(base_url=front, timeout=10) as http:
        got = http.get(f"/v1/videos/{JOB}", params={"a": "1"})
        assert got.status_code == 200 and got.json() == {"id": JOB, "method": "GET"}
        assert got.headers[HEADER] == "peer"
        deleted = http.delete(f"/v1/videos/{JOB}")
        assert deleted.json()["method"] == "DELETE"
        content = http.get(f"/v1/videos/{JOB}/content")
        assert content.content == b"part 0;part 1;part 2;" and content.headers["content-type"] == "video/mp4"
        # A job that names no replica known here: this replica answers.
        assert http.get("/v1/videos/video_gone_abcdefghijklmnopqrst").headers[HEADER] == "front"
    jobs = [s for s in seen if s[0] == "job"]
    host = front.removeprefix("http://")
    assert jobs[0] == ("job", "GET", "a=1", b"", "1", host) and jobs[1][1] == "DELETE" and len(jobs) == 3


def test_an_engine_request_goes_to_a_shorter_queue_under_the_body_limit(replicas: Replicas) -> None:
    front, seen, ingress = replicas
    with httpx.Client(base_url=front, timeout=10) as http:
        small = http.post("/v1/chat/completions", content=b"x" * 500)
        assert small.json() == {"bytes": 500} and small.headers[HEADER] == "peer"
        # Over the limit: not carried to the peer; this replica refuses it, as the peer would.
        declared = http.post("/v1/chat/completions", content=b"x" * 5000)
        assert declared.status_code == 413 and declared.json()["error"]["code"] == "request_too_large"

        def chunked() -> Iterator[bytes]:  # no Content-Length: counted as it comes
            for _ in range(10):
                yield b"y" * 400

        streamed = http.post("/v1/chat/completions", content=chunked())
        assert streamed.status_code == 413 and streamed.json()["error"]["code"] == "request_too_large"
    assert [s for s in seen if s[0] == "chat"] == [("chat", 500)]
    assert handed(ingress, "engine") == 3  # three chose the peer


def test_an_unreachable_peer_leaves_the_request_to_this_replica() -> None:
    app, _ = front_app("127.0.0.1:9", capacity=0)  # nothing listens on port 9

    async def go(front: str) -> None:
        async with websockets.connect(ws_url(front)) as ws:
            assert ws.response.headers[HEADER] == "front"
            assert json.loads(await ws.recv())["code"] == "here"

    with serve(app) as front:
        asyncio.run(go(front))
        assert httpx.get(f"{front}/v1/videos/{JOB}", timeout=10).headers[HEADER] == "front"


def test_the_peer_table_ranks_by_free_slots_and_engine_queue() -> None:
    peers = Peers("a")
    peers.update(
        [
            ReplicaReport("a", ReplicaLoad(4, 0, 0), address="h:1"),  # itself: left out
            ReplicaReport("b", ReplicaLoad(4, 3, 2), address="h:2"),
            ReplicaReport("c", ReplicaLoad(4, 1, 5), address="h:3"),
            ReplicaReport("d", ReplicaLoad(4, 0, 0, draining=True), address="h:4"),
            ReplicaReport("e", ReplicaLoad(4, 0, 0), address=None),  # no address yet
        ]
    )
    assert peers.address_of("a") is None and peers.address_of("d") is None and peers.address_of("b") == "h:2"
    # Most free slots first, each pick counted at once: c (3 free), c (2), then b and c tie at 1.
    assert [p.replica for p in (peers.with_room(), peers.with_room(), peers.with_room())] == ["c", "c", "b"]
    assert peers.with_room().replica == "c"  # type: ignore[union-attr]
    assert peers.with_room() is None  # all full: served (refused) here
    # Engine work: only to a shorter queue than this replica's own.
    assert peers.less_loaded(2) is None
    assert peers.less_loaded(3).replica == "b"  # type: ignore[union-attr]
    assert peers.less_loaded(3) is None  # b counted one busier: 3, no longer shorter


def test_a_lost_peers_session_is_told_to_reconnect() -> None:
    from omnirt.realtime.replicas.relay import PEER_LOST, _passed_close

    assert _passed_close(1013, "full") == (1013, "full")
    assert _passed_close(1006, "") == PEER_LOST == (1012, "replica gone")
    assert _passed_close(None, "") == PEER_LOST
    assert _passed_close(1005, "") == (1000, "")
