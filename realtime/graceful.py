"""uvicorn's server, with realtime sessions and HTTP requests ended cleanly, in bounded time, before
uvicorn closes their sockets.

uvicorn's own shutdown (SIGTERM, Ctrl-C, ``should_exit``) closes every WebSocket at once with
1012, so a client whose response is streaming never gets its ``response.done``; and it waits for
every HTTP response in flight to be sent, without a bound, so one client that stops reading a
stream (or never sends the rest of a body) keeps the server from ever exiting. This server first
stops accepting connections, then, at the same time:

- lets the realtime service end each session
  (:meth:`~omnirt.realtime.ws.RealtimeService.shutdown`: ``response.done`` ``cancelled``, then close
  1012, within ``shutdown_grace_seconds``);
- lets the HTTP requests in flight finish within ``shutdown_grace_seconds`` (no keep-alive after
  them); then ends the engine requests still running with the ``shutdown`` error
  (:meth:`~omnirt.stages.engine.EngineClient.shut_down`: a 503 ``service_unavailable``, or an SSE
  ``error`` event once streaming), gives those answers :data:`HTTP_CLOSE_SECONDS` to go out, and
  drops the connections still not done (a client that does not read);

then runs uvicorn's shutdown for everything else.

It also keeps client mistakes that uvicorn logs as tracebacks to one line each
(:mod:`.transport_log`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn
from starlette.applications import Starlette

from .transport_log import quiet_client_faults

log = logging.getLogger(__name__)

#: After the grace period, how long the HTTP requests ended with 503 get to send it before their
#: connections are dropped (a client that does not read never takes it).
HTTP_CLOSE_SECONDS = 2.0
#: How often the HTTP connections are looked at while waiting for them.
POLL_SECONDS = 0.05


class GracefulServer(uvicorn.Server):
    """``uvicorn.Server`` for an app made by :func:`~omnirt.realtime.app.create_app`."""

    def __init__(self, config: uvicorn.Config, app: Starlette) -> None:
        super().__init__(config)  # uvicorn's logging is set up by now (uvicorn.Config)
        quiet_client_faults()
        self.realtime = app.state.realtime
        self.client = app.state.client
        self.grace = app.state.config.shutdown_grace_seconds

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, except that a SIGTERM it shut down for is not raised again after: a clean
        stop exits 0 (as ``--replicas`` does), not as killed by the signal (143). Ctrl-C is raised
        again as uvicorn does (the CLI logs it and exits 0)."""
        with super().capture_signals():
            try:
                yield
            finally:
                self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:  # no new connections while the sessions end
            server.close()
        await asyncio.gather(self.realtime.shutdown(), self._end_http())
        await super().shutdown(sockets)

    def _busy_http(self) -> list[Any]:
        """The HTTP connections (not WebSockets) with a request in flight, or a response not yet
        taken by their client."""
        busy = []
        for connection in list(self.server_state.connections):
            if not hasattr(connection, "cycle"):  # a WebSocket: the realtime service ends it
                continue
            cycle, transport = connection.cycle, connection.transport
            if cycle is None or transport is None:
                continue  # no request yet (uvicorn closes it)
            if not cycle.response_complete or transport.get_write_buffer_size() > 0:
                busy.append(connection)
        return busy

    async def _wait_http(self, timeout: float) -> list[Any]:
        """Waits up to ``timeout`` for the busy HTTP connections; those still busy."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (busy := self._busy_http()) and loop.time() < deadline:
            await asyncio.sleep(POLL_SECONDS)
        return busy

    async def _end_http(self) -> None:
        busy = self._busy_http()
        if not busy:
            return
        log.info("shutting down: %d HTTP request(s) in flight get %gs to finish", len(busy), self.grace)
        for connection in busy:
            connection.shutdown()  # no keep-alive: closed once its response is out
        busy = await self._wait_http(self.grace)
        if not busy:
            return
        ended = self.client.shut_down()
        log.info("shutdown grace over: ended %d engine request(s) still running", ended)
        busy = await self._wait_http(HTTP_CLOSE_SECONDS)
        if not busy:
            return
        log.info("shutting down: dropping %d HTTP connection(s) whose client did not finish", len(busy))
        for connection in busy:
            connection.transport.abort()
        await asyncio.sleep(0)  # their connection_lost runs: uvicorn no longer waits for them
