"""Hand a request that reached one replica to another, over that replica's own HTTP port.

Used only when HAProxy is the fleet's ingress (:mod:`.ingress`): HAProxy sends each connection to
a replica by its own balancing, so the rare request that belongs elsewhere (a session reaching a
full replica, a video job's request reaching a replica that does not hold the job) is carried on
by the replica it reached:

- :func:`forward_http`: one HTTP request, its response streamed back as it comes;
- :class:`WebSocketRelay`: a WebSocket, frames both ways until either side closes, the close code
  and reason passed on.

Both mark what they send with :data:`FORWARDED_HEADER`, and a replica serves a marked request
itself (never hands it on again). Both raise :class:`PeerUnreachable` when the other replica
cannot be reached before anything was answered, so the caller can serve the request itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.datastructures import Headers
from starlette.types import Message, Receive, Scope, Send
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from ..auth import subprotocols

log = logging.getLogger(__name__)

#: Set on what one replica hands to another: the receiver serves it itself.
FORWARDED_HEADER = "x-omnirt-forwarded"
#: Headers that belong to one connection (RFC 9110 7.6.1), not passed from one hop to the next.
#: ``Host`` is passed: the other replica checks a browser's ``Origin`` against it, as this one would.
_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade"}
)
#: The WebSocket handshake's own headers, made anew by the client library (``Host`` from the URI).
_HANDSHAKE = frozenset(
    {
        "host",
        "sec-websocket-key",
        "sec-websocket-version",
        "sec-websocket-extensions",
        "sec-websocket-protocol",
    }
)
#: Seconds to reach the other replica before giving up (it is on the same network as this one).
CONNECT_SECONDS = 5.0
#: Seconds a client has to answer the close the other replica sent it.
CLOSE_SECONDS = 5.0


#: A relayed session whose other replica went without a close (killed, cut off): its client is
#: told to reconnect (1012, service restart), which lands it on a replica that serves.
PEER_LOST = (1012, "replica gone")


#: Close codes no close frame may carry (1005: none given; 1006: no close at all).
_NOT_SENDABLE = frozenset({1005, 1006})


def _passed_close(code: int | None, reason: str) -> tuple[int, str]:
    """The close to pass to the client for the other replica's: its own, but for the codes no
    close frame may carry."""
    if code is None or code == 1006:
        return PEER_LOST
    if code == 1005:
        return 1000, ""
    return code, reason


class PeerUnreachable(ConnectionError):
    """The other replica could not be reached; nothing was sent to the client."""


def forwarded(scope: Scope) -> bool:
    """Whether another replica handed this request here."""
    return FORWARDED_HEADER in Headers(scope=scope)


def _passed_headers(scope: Scope, drop: frozenset[str] = _HOP) -> list[tuple[str, str]]:
    headers = [
        (name.decode("latin-1"), value.decode("latin-1"))
        for name, value in scope.get("headers", ())
        if name.decode("latin-1").lower() not in drop
    ]
    return [*headers, (FORWARDED_HEADER, "1")]


def _target(scope: Scope, authority: str, scheme: str) -> str:
    query = scope.get("query_string", b"").decode("latin-1")
    path = scope.get("raw_path") or scope["path"].encode()
    return f"{scheme}://{authority}{path.decode('latin-1')}" + (f"?{query}" if query else "")


def _host_and_port(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` apart."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class Body:
    """An HTTP request's body as read for forwarding."""

    data: bytes
    #: More of it is still to come (reading stopped past the limit).
    more: bool = False
    #: The client left before the body ended.
    left: bool = False

    def fits(self, limit: int) -> bool:
        """Whole and within ``limit`` bytes: one to forward."""
        return not self.more and not self.left and len(self.data) <= limit

    def message(self) -> Message:
        """The ``http.request`` message that gives what was read to another reader."""
        return {"type": "http.request", "body": self.data, "more_body": self.more}


async def request_body(receive: Receive, limit: int) -> Body:
    """The body of an HTTP request, read until it ends or passes ``limit`` bytes (then it stops:
    the replica's own app answers such a request, 413, reading the rest)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return Body(b"".join(chunks), left=True)
        chunk = message.get("body", b"")
        chunks.append(chunk)
        size += len(chunk)
        more = bool(message.get("more_body", False))
        if not more or size > limit:
            return Body(b"".join(chunks), more=more)


def replaying(first: Message, receive: Receive) -> Receive:
    """``receive`` with ``first`` (a message already taken from it) given again first."""
    pending = [first]

    async def again() -> Message:
        return pending.pop() if pending else await receive()

    return again


async def forward_http(
    scope: Scope, body: bytes, send: Send, address: str, client: httpx.AsyncClient
) -> None:
    """Serve the HTTP request in ``scope`` (its ``body`` read already) from the replica at
    ``address`` (``host:port``)."""
    request = client.build_request(
        scope["method"], _target(scope, address, "http"), headers=_passed_headers(scope), content=body
    )
    try:
        response = await client.send(request, stream=True)
    except httpx.TransportError as exc:
        raise PeerUnreachable(f"{address}: {exc!r}") from exc
    try:
        headers = [
            (name.encode("latin-1"), value.encode("latin-1"))
            for name, value in response.headers.multi_items()
            if name.lower() not in _HOP
        ]
        await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        async for chunk in response.aiter_raw():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:
        await response.aclose()


class WebSocketRelay:
    """One relayed WebSocket: the client's (this replica's ASGI side, its ``websocket.connect``
    taken already) and the other replica's."""

    def __init__(self, scope: Scope, receive: Receive, send: Send, address: str) -> None:
        self.scope, self.receive, self.send, self.address = scope, receive, send, address
        self.peer: ClientConnection | None = None
        self._closing: tuple[int, str] | None = None

    async def run(self, replica_header: str) -> None:
        """Relay until either side closes. PeerUnreachable before the client was accepted."""
        headers = Headers(scope=self.scope)
        offered = subprotocols(headers)
        # The client's Host in the URI (the other replica's origin check reads it), the other
        # replica's address for the connection itself.
        host, port = _host_and_port(self.address)
        try:
            self.peer = await connect(
                _target(self.scope, headers.get("host") or self.address, "ws"),
                host=host,
                port=port,
                additional_headers=_passed_headers(self.scope, _HOP | _HANDSHAKE),
                subprotocols=offered or None,  # type: ignore[arg-type]
                open_timeout=CONNECT_SECONDS,
                compression=None,  # the hop is local; the client's own deflate is the outer server's
                max_size=None,  # the other replica enforces its own frame limit
                ping_interval=None,  # the two ends keep their own connections alive
                close_timeout=2.0,
            )
        except (OSError, TimeoutError, InvalidHandshake) as exc:
            if isinstance(exc, InvalidStatus):
                log.warning("replica %s refused a relayed session: %s", self.address, exc)
            raise PeerUnreachable(f"{self.address}: {exc!r}") from exc
        peer = self.peer
        served_by = peer.response.headers.get(replica_header) if peer.response is not None else None
        accept: Message = {"type": "websocket.accept", "subprotocol": peer.subprotocol}
        if served_by:
            accept["headers"] = [(replica_header.encode(), served_by.encode())]
        await self.send(accept)
        upstream = asyncio.create_task(self._client_to_peer(peer), name="omnirt relay up")
        downstream = asyncio.create_task(self._peer_to_client(peer), name="omnirt relay down")
        try:
            done, _ = await asyncio.wait({upstream, downstream}, return_when=asyncio.FIRST_COMPLETED)
            if downstream in done:
                # The peer ended and the client was sent its close: the client's disconnect comes
                # once it has answered (taking its receive away earlier would cut the handshake).
                await asyncio.wait({upstream}, timeout=CLOSE_SECONDS)
        finally:
            for task in (upstream, downstream):
                task.cancel()
            await asyncio.gather(upstream, downstream, return_exceptions=True)
            await peer.close()

    async def close(self, code: int, reason: str) -> None:
        """End the relay from this side: the client gets ``code``/``reason``, the peer a 1001."""
        self._closing = (code, reason)
        if self.peer is not None:
            await self.peer.close(1001, reason)

    async def _client_to_peer(self, peer: ClientConnection) -> None:
        while True:
            message = await self.receive()
            if message["type"] == "websocket.disconnect":
                code = message.get("code", 1000)
                # A client gone without a close (1006): the peer hears it going away.
                await peer.close(1001 if code in _NOT_SENDABLE else code, message.get("reason") or "")
                return
            data: Any = message.get("text")
            if data is None:
                data = message.get("bytes", b"")
            try:
                await peer.send(data)
            except ConnectionClosed:
                return  # the other task passes the peer's close on

    async def _peer_to_client(self, peer: ClientConnection) -> None:
        try:
            async for data in peer:
                key = "text" if isinstance(data, str) else "bytes"
                await self.send({"type": "websocket.send", key: data})
        except ConnectionClosed:
            pass
        code, reason = self._closing or _passed_close(peer.close_code, peer.close_reason or "")
        with contextlib.suppress(Exception):  # the client may be gone already
            await self.send({"type": "websocket.close", "code": code, "reason": reason})
