"""Run a real uvicorn server on loopback for tests: ``with serve(app) as base_url: ...``."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn
from omnirt.realtime import cli
from omnirt.realtime.config import ServerConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(
    app,
    *,
    ws_max_size: int = cli.ws_max_size(ServerConfig()),
    ws_per_message_deflate: bool = cli.WS_PER_MESSAGE_DEFLATE,
    start_timeout: float = 30,
) -> Iterator[str]:
    """Serve ``app`` on a free loopback port in a thread; yields ``http://127.0.0.1:PORT``.

    permessage-deflate is off by default, as ``omnirt serve`` runs (realtime/cli.py)."""
    port = free_port()
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        ws_max_size=ws_max_size,
        ws_per_message_deflate=ws_per_message_deflate,
        lifespan="on",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
