"""A transparent WebSocket relay between a framework under test and ``omnirt serve``.

The frameworks parse server events their own way (pipecat with its own models, livekit with
``construct``), so a test cannot see what they received. The relay sits on loopback between the
two, passes every frame through unchanged (same path and query, the headers a client
authenticates with, close codes both ways) and keeps a copy: each server frame is validated
strictly (:func:`tests.realtime.conftest.validate`: the openai SDK's own pydantic models and the
universal rules of PROTOCOL.md), each client frame is recorded as sent, so a failing test can say
what the framework asked for and what the server answered.

It runs on an event loop of its own in a thread, so a framework that blocks its loop for a moment
does not stall the frames of the other direction.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import websockets
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve

from tests.realtime.conftest import validate
from tests.server import free_port

#: Request headers passed on to the server: what realtime clients authenticate and select with.
FORWARDED_HEADERS = ("authorization", "openai-beta", "api-key", "user-agent")
#: Frames a trace shows once per run, with a count.
REPEATED = (
    "input_audio_buffer.append",
    "response.output_audio.delta",
    "response.output_audio_transcript.delta",
    "response.output_text.delta",
    "response.function_call_arguments.delta",
    "conversation.item.input_audio_transcription.delta",
)
ARROWS = {"client": ">>", "server": "<<"}
#: Frames a trace shows with their fields.
DETAILED = (
    "session.update",
    "response.create",
    "conversation.item.create",
    "conversation.item.truncate",
    "response.done",
    "response.function_call_arguments.done",
    "conversation.item.input_audio_transcription.completed",
)


@dataclass
class Connection:
    """One framework connection through the relay: everything that crossed it, in order."""

    path: str
    headers: dict[str, str]
    #: ``(direction, event)`` with direction ``"client"`` or ``"server"``, in arrival order.
    frames: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    #: Server frames that failed strict validation, with the reason.
    invalid: list[tuple[dict[str, Any] | str, str]] = field(default_factory=list)
    close_code: int | None = None
    _ids: set[str] = field(default_factory=set)

    def server(self, kind: str | None = None) -> list[dict[str, Any]]:
        return [e for d, e in list(self.frames) if d == "server" and (kind is None or e.get("type") == kind)]

    def client(self, kind: str | None = None) -> list[dict[str, Any]]:
        return [e for d, e in list(self.frames) if d == "client" and (kind is None or e.get("type") == kind)]

    def tool_outputs(self) -> list[dict[str, Any]]:
        """The ``function_call_output`` items the framework sent (``conversation.item.create``)."""
        items = [e["item"] for e in self.client("conversation.item.create")]
        return [item for item in items if item.get("type") == "function_call_output"]

    def errors(self) -> list[dict[str, Any]]:
        return [e["error"] for e in self.server("error")]

    def summary(self) -> str:
        """The frames as a readable trace, for failure messages: streamed deltas and audio
        appends are counted between the other events, not listed."""
        lines: list[str] = []
        counts: dict[str, int] = {}

        def flush() -> None:
            if counts:
                lines.append("   (" + ", ".join(f"{n} x {kind}" for kind, n in counts.items()) + ")")
                counts.clear()

        for direction, event in list(self.frames):
            kind = str(event.get("type"))
            if kind in REPEATED:
                counts[f"{ARROWS[direction]} {kind}"] = counts.get(f"{ARROWS[direction]} {kind}", 0) + 1
                continue
            flush()
            if kind == "error":
                detail = json.dumps(event.get("error"))
            elif kind in DETAILED:
                detail = json.dumps({k: v for k, v in event.items() if k not in ("type", "event_id")})[:600]
            else:
                detail = ""
            lines.append(f"{ARROWS[direction]} {kind} {detail}".rstrip())
        flush()
        return "\n".join(lines)


class Relay:
    """``with Relay(upstream) as relay:`` frameworks connect to ``relay.url`` (``ws://HOST:PORT``)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.port = free_port()
        self.url = f"ws://127.0.0.1:{self.port}"
        self.connections: list[Connection] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="ws-relay", daemon=True)

    def __enter__(self) -> Relay:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("relay did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(15)

    async def connection(self, timeout: float = 20) -> Connection:
        """The one connection a test made, once the framework has opened it."""
        deadline = time.monotonic() + timeout
        while not self.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert len(self.connections) == 1, f"{len(self.connections)} connections through the relay"
        return self.connections[0]

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._main())
        self._loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        async with serve(
            self._handle, "127.0.0.1", self.port, max_size=None, compression=None, ping_interval=None
        ):
            self._ready.set()
            await self._stop.wait()

    async def _handle(self, client: ServerConnection) -> None:
        request = client.request
        assert request is not None
        headers = {k: v for k, v in request.headers.raw_items() if k.lower() in FORWARDED_HEADERS}
        conn = Connection(request.path, headers)
        self.connections.append(conn)
        try:
            upstream = await connect(
                self.upstream + request.path,
                additional_headers=headers,
                max_size=None,
                compression=None,
                ping_interval=None,
                proxy=None,
                user_agent_header=None,
            )
        except websockets.InvalidStatus as exc:
            conn.close_code = exc.response.status_code
            await client.close(1011, f"upstream refused: HTTP {exc.response.status_code}")
            return
        async with upstream:
            down = asyncio.create_task(self._pump(upstream, client, conn, "server"))
            up = asyncio.create_task(self._pump(client, upstream, conn, "client"))
            done, pending = await asyncio.wait({down, up}, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, websockets.ConnectionClosed):
                    await task
            # Pass the close on as the side that closed it chose it.
            if down in done:
                conn.close_code = upstream.close_code
                with contextlib.suppress(websockets.ConnectionClosed):
                    await client.close(upstream.close_code or 1000, upstream.close_reason or "")
            else:
                conn.close_code = client.close_code
                with contextlib.suppress(websockets.ConnectionClosed):
                    await upstream.close(client.close_code or 1000, client.close_reason or "")

    @staticmethod
    async def _pump(source: Any, sink: Any, conn: Connection, direction: str) -> None:
        with contextlib.suppress(websockets.ConnectionClosed):
            async for message in source:
                if direction == "server":
                    try:
                        event = validate(message, conn._ids)
                    except Exception as exc:  # noqa: BLE001 - kept and reported by the test
                        try:
                            event = json.loads(message)
                        except ValueError:
                            event = {"type": "<not json>"}
                        conn.invalid.append((event, f"{type(exc).__name__}: {exc}"[:2000]))
                else:
                    try:
                        event = json.loads(message)
                    except ValueError:
                        event = {"type": "<not json>"}
                conn.frames.append((direction, event))
                await sink.send(message)


@contextlib.contextmanager
def relay_to(base_url: str) -> Iterator[Relay]:
    """A relay to the server at ``http://HOST:PORT``."""
    with Relay(base_url.replace("http://", "ws://")) as relay:
        yield relay
