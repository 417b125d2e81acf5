"""The WebSocket protocol ``omnirt serve`` runs: uvicorn's, with a bounded kernel send buffer.

Linux grows a TCP socket's send buffer on its own (up to 4 MiB by default), also for a client
that reads nothing, and the server cannot tell those bytes from bytes the client has taken: a
client that stops reading would only show up as behind (``realtime.ws``: its responses held,
then closed) after megabytes of generated audio, minutes of model time. Realtime connections
therefore get a fixed send buffer (``ws_send_buffer_bytes``, 128 KiB: the kernel doubles it to
256 KiB, about 4 s of audio deltas, and still ~2.5 MB/s at a 100 ms round trip, far above what a
session streams); HTTP responses (images, videos) keep the kernel's automatic sizing.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol


class RealtimeWebSocketProtocol(WebSocketsSansIOProtocol):
    #: SO_SNDBUF of each upgraded connection (0: the kernel's automatic sizing).
    send_buffer_bytes = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        sock = transport.get_extra_info("socket")
        if sock is not None and self.send_buffer_bytes > 0:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer_bytes)
        super().connection_made(transport)  # type: ignore[arg-type]


def websocket_protocol(send_buffer_bytes: int) -> type[RealtimeWebSocketProtocol]:
    """The protocol class for uvicorn's ``ws`` setting, with this send buffer."""
    return type(
        "RealtimeWebSocketProtocol", (RealtimeWebSocketProtocol,), {"send_buffer_bytes": send_buffer_bytes}
    )
