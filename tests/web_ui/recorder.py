"""An ASGI wrapper that records every WebSocket text frame in both directions, per connection.

It sits outside the real app, so tests see exactly what the browser sent and what the server
answered, without reaching into the session layer.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs


@dataclass
class Frame:
    at: float  # time.monotonic() when it passed
    event: dict[str, Any]


@dataclass
class RecordedConnection:
    query: dict[str, list[str]]
    received: list[Frame] = field(default_factory=list)  # client -> server
    sent: list[Frame] = field(default_factory=list)  # server -> client

    def client_events(self, kind: str | None = None) -> list[dict[str, Any]]:
        return [f.event for f in self.received if kind is None or f.event.get("type") == kind]

    def server_events(self, kind: str | None = None) -> list[dict[str, Any]]:
        return [f.event for f in self.sent if kind is None or f.event.get("type") == kind]

    @property
    def session_id(self) -> str | None:
        created = self.server_events("session.created")
        return created[0]["session"]["id"] if created else None


class Recorder:
    def __init__(self, app: Any) -> None:
        self.app = app
        self.connections: list[RecordedConnection] = []

    def session(self, session_id: str) -> RecordedConnection:
        for conn in self.connections:
            if conn.session_id == session_id:
                return conn
        raise LookupError(f"no recorded connection for session {session_id}")

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "websocket":
            await self.app(scope, receive, send)
            return
        conn = RecordedConnection(parse_qs(scope.get("query_string", b"").decode()))
        self.connections.append(conn)

        async def recording_receive() -> dict[str, Any]:
            message = await receive()
            if message["type"] == "websocket.receive" and message.get("text"):
                conn.received.append(Frame(time.monotonic(), json.loads(message["text"])))
            return message

        async def recording_send(message: dict[str, Any]) -> None:
            if message["type"] == "websocket.send" and message.get("text"):
                conn.sent.append(Frame(time.monotonic(), json.loads(message["text"])))
            await send(message)

        await self.app(scope, recording_receive, recording_send)
