"""uvicorn's server, with realtime sessions ended cleanly before uvicorn closes their sockets.

uvicorn's own shutdown (SIGTERM, Ctrl-C, ``should_exit``) closes every WebSocket at once with
1012, so a client whose response is streaming never gets its ``response.done``. This server first
stops accepting connections, then lets the realtime service end each session
(:meth:`~omnirt.realtime.ws.RealtimeService.shutdown`: ``response.done`` ``cancelled``, then close
1012, within ``shutdown_grace_seconds``), then runs uvicorn's shutdown for everything else.

It also keeps client mistakes that uvicorn logs as tracebacks to one line each
(:mod:`.transport_log`).
"""

from __future__ import annotations

import socket

import uvicorn
from starlette.applications import Starlette

from .transport_log import quiet_client_faults


class GracefulServer(uvicorn.Server):
    """``uvicorn.Server`` for an app made by :func:`~omnirt.realtime.app.create_app`."""

    def __init__(self, config: uvicorn.Config, app: Starlette) -> None:
        super().__init__(config)  # uvicorn's logging is set up by now (uvicorn.Config)
        quiet_client_faults()
        self.realtime = app.state.realtime

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:  # no new connections while the sessions end
            server.close()
        await self.realtime.shutdown()
        await super().shutdown(sockets)
