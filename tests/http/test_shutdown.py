"""The server stopped (SIGTERM) while HTTP requests are in flight: bounded, and answered.

HTTP requests get ``shutdown_grace_seconds`` to finish; the engine requests still running then end
with the ``shutdown`` error (a plain request gets its 503 ``service_unavailable``, a stream an SSE
``error`` event), and a client that takes nothing (one that never sends the rest of its body, or
does not read) is dropped after a short while: one such client no longer keeps the server from
exiting (uvicorn alone waits for it forever). A client that goes away before its body is read is
one INFO line, not a traceback.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import threading
import time
from urllib.parse import urlparse

import httpx
import pytest
from omnirt.realtime.app import create_app
from omnirt.realtime.config import ServerConfig
from omnirt.stages.engine import Engine, EngineClient

from tests.fakes import EchoPipeline
from tests.server import serve_server

from .conftest import MODEL, running, user, wait_for

#: ~400 words at 50 ms a step: a reply of ~20 s, far past the grace below.
LONG = " ".join(f"w{i}" for i in range(400))


def _half_sent(base_url: str) -> socket.socket:
    """A connection whose request declares 1000 bytes of body and sends 9 of them."""
    url = urlparse(base_url)
    sock = socket.create_connection((url.hostname, url.port))
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 1000\r\n\r\n{"model":'
    )
    return sock


def test_shutdown_answers_requests_in_flight_with_503_and_drops_a_client_that_takes_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = Engine(EchoPipeline(step_seconds=0.05))
    app = create_app(EngineClient(engine), ServerConfig(shutdown_grace_seconds=0.5, vad_preload=False))
    plain: dict[str, httpx.Response] = {}
    streamed: list[str] = []

    def ask_plain(base_url: str) -> None:
        with httpx.Client(base_url=base_url, timeout=60) as http:
            body = {"model": MODEL, "messages": user(LONG)}
            plain["response"] = http.post("/v1/chat/completions", json=body)

    def ask_streamed(base_url: str) -> None:
        body = {"model": MODEL, "messages": user(LONG), "stream": True}
        with (
            httpx.Client(base_url=base_url, timeout=60) as http,
            http.stream("POST", "/v1/chat/completions", json=body) as response,
        ):
            streamed.extend(line for line in response.iter_lines() if line)

    caplog.set_level(logging.INFO)
    with serve_server(app) as (base_url, uvicorn_server):
        stalled = _half_sent(base_url)
        clients = [threading.Thread(target=f, args=(base_url,)) for f in (ask_plain, ask_streamed)]
        for client in clients:
            client.start()
        assert wait_for(lambda: engine.stats.active == 2 and len(streamed) >= 2, timeout=30)
        uvicorn_server.handle_exit(signal.SIGTERM, None)
        # The server stops (its lifespan stops the engine) although one client never finishes its
        # request; without the bound it waited for that client (and the 20 s replies) forever.
        assert wait_for(lambda: engine._thread is None, timeout=30)
        for client in clients:
            client.join(30)
        stalled.settimeout(10)
        assert stalled.recv(1024) == b""  # dropped, nothing answered (it never sent its body)
        stalled.close()

    response = plain["response"]
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "service_unavailable"
    last = json.loads(streamed[-1].removeprefix("data: "))
    assert last["error"]["code"] == "service_unavailable"
    assert "data: [DONE]" not in streamed
    assert engine.stats.requests_finished == 0
    assert not [r for r in caplog.records if r.exc_info is not None or "Traceback" in r.getMessage()]


def test_shutdown_with_nothing_in_flight_is_prompt() -> None:
    engine = Engine(EchoPipeline())
    app = create_app(EngineClient(engine), ServerConfig(shutdown_grace_seconds=30, vad_preload=False))
    with serve_server(app) as (base_url, uvicorn_server):
        with httpx.Client(base_url=base_url, timeout=20) as http:  # an idle keep-alive connection
            assert http.post("/v1/chat/completions", json={"model": MODEL, "messages": user("hi")}).is_success
            began = time.monotonic()
            uvicorn_server.handle_exit(signal.SIGTERM, None)
            assert wait_for(lambda: engine._thread is None, timeout=30)
        # Not the 30 s grace: nothing was in flight.
        assert time.monotonic() - began < 20


def test_client_gone_before_its_body_is_read_is_one_line_not_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    with running() as server:
        _half_sent(server.base_url).close()
        assert wait_for(lambda: any("went away before" in r.getMessage() for r in caplog.records))
        with server.http() as http:
            metrics = http.get("/metrics").text
            assert http.get("/health").status_code == 200
    assert not [r for r in caplog.records if r.exc_info is not None]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert 'route="/v1/chat/completions",status="499"' in metrics
    assert server.engine.stats.requests_submitted == 0
