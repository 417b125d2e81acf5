"""The WebSocket protocol ``omnirt serve`` runs: uvicorn's, with a bounded kernel send buffer.

Linux grows a TCP socket's send buffer on its own (up to 4 MiB by default), also for a client
that reads nothing, and the server cannot tell those bytes from bytes the client has taken: a
client that stops reading would only show up as behind (``realtime.ws``: its responses held,
then closed) after megabytes of generated audio, minutes of model time. Realtime connections
therefore get a fixed send buffer (``ws_send_buffer_bytes``, 128 KiB: the kernel doubles it to
256 KiB, about 4 s of audio deltas, and still ~2.5 MB/s at a 100 ms round trip, far above what a
session streams); HTTP responses (images, videos) keep the kernel's automatic sizing. The
endpoint also gets the socket itself (scope extension ``omnirt.socket``) to see how much of the
send queue the client has not taken (:func:`unsent_bytes`): a client whose receive window has
closed is behind long before the server's own queue grows.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import socket
import struct
import sys
import termios
from typing import Any

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

#: The scope extension that carries the connection's socket (``{"socket": socket}``).
SOCKET_EXTENSION = "omnirt.socket"


def unsent_bytes(sock: socket.socket) -> int | None:
    """Bytes in ``sock``'s kernel send queue that the peer has not acknowledged (``SIOCOUTQ``),
    or None where the platform does not say (not Linux, a closed socket)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        raw = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except (OSError, ValueError):
        return None
    return struct.unpack("i", raw)[0]


class RealtimeWebSocketProtocol(WebSocketsSansIOProtocol):
    #: SO_SNDBUF of each upgraded connection (0: the kernel's automatic sizing).
    send_buffer_bytes = 0
    _omnirt_socket: socket.socket | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        sock = transport.get_extra_info("socket")
        if sock is not None and self.send_buffer_bytes > 0:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer_bytes)
        self._omnirt_socket = sock
        super().connection_made(transport)  # type: ignore[arg-type]

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        # The app's scope gets the connection's socket (an ASGI extension of ours): the realtime
        # endpoint reads how much of its kernel send queue the client has not taken.
        scope = getattr(self, "scope", None)
        if scope is not None and self._omnirt_socket is not None:
            scope.setdefault("extensions", {})[SOCKET_EXTENSION] = {"socket": self._omnirt_socket}


def websocket_protocol(send_buffer_bytes: int) -> type[RealtimeWebSocketProtocol]:
    """The protocol class for uvicorn's ``ws`` setting, with this send buffer."""
    return type(
        "RealtimeWebSocketProtocol", (RealtimeWebSocketProtocol,), {"send_buffer_bytes": send_buffer_bytes}
    )
