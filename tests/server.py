"""Real servers on loopback for tests: ``with serve(app) as base_url: ...`` (uvicorn in a thread)
and ``with serve_cli(args, ...) as base_url: ...`` (``omnirt serve`` in a process)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import uvicorn
from omnirt.realtime import cli
from omnirt.realtime.config import ServerConfig
from omnirt.realtime.graceful import GracefulServer
from omnirt.realtime.ws_protocol import websocket_protocol


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
    with serve_server(
        app,
        ws_max_size=ws_max_size,
        ws_per_message_deflate=ws_per_message_deflate,
        start_timeout=start_timeout,
    ) as (base_url, _):
        yield base_url


@contextlib.contextmanager
def serve_server(
    app,
    *,
    ws_max_size: int = cli.ws_max_size(ServerConfig()),
    ws_per_message_deflate: bool = cli.WS_PER_MESSAGE_DEFLATE,
    start_timeout: float = 30,
) -> Iterator[tuple[str, uvicorn.Server]]:
    """As :func:`serve`, also yielding the uvicorn server (``omnirt serve``'s
    :class:`~omnirt.realtime.graceful.GracefulServer` for an app with a realtime service), so a
    test can stop it as SIGTERM does (``server.handle_exit(signal.SIGTERM, None)``)."""
    port = free_port()
    served = getattr(getattr(app, "state", None), "config", None)
    send_buffer = served.ws_send_buffer_bytes if isinstance(served, ServerConfig) else 0
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        http=cli.UVICORN_HTTP,  # as omnirt serve runs
        loop=cli.UVICORN_LOOP,
        ws=websocket_protocol(send_buffer),
        ws_max_size=ws_max_size,
        ws_per_message_deflate=ws_per_message_deflate,
        lifespan="on",
    )
    has_realtime = getattr(getattr(app, "state", None), "realtime", None) is not None
    server = GracefulServer(config, app) if has_realtime else uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        thread.join(30)


@contextlib.contextmanager
def serve_cli(args: list[str], *, cache: Path, log: Path, start_timeout: float = 180) -> Iterator[str]:
    """``omnirt serve ARGS --port P`` as a user runs it: the real CLI in a process of its own,
    cache under ``cache``, output in ``log``; yields ``http://127.0.0.1:P`` once ``/health``
    answers, and stops the process after (terminate, then kill)."""
    with serve_cli_process(args, cache=cache, log=log, start_timeout=start_timeout) as (base, _):
        yield base


def cli_env(cache: Path) -> dict[str, str]:
    """The environment ``omnirt serve`` runs in for tests: this process's, cache under ``cache``."""
    return dict(os.environ, OMNIRT_CACHE=str(cache), HF_HUB_OFFLINE="1")


@contextlib.contextmanager
def serve_cli_process(
    args: list[str], *, cache: Path, log: Path, start_timeout: float = 180, port: int | None = None
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """As :func:`serve_cli`, also yielding the server's process (its pid, to watch its memory);
    ``port``: this one rather than a free one."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "omnirt.realtime.cli", "serve", *args, "--port", str(port)]
    env = cli_env(cache)
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            assert proc.poll() is None, f"omnirt serve exited: {log.read_text()[-3000:]}"
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"omnirt serve did not come up: {log.read_text()[-3000:]}"
            time.sleep(0.2)
        yield base, proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
