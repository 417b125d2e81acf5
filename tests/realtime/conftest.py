"""A real server on loopback (uvicorn + the real Engine + EchoPipeline) and strict clients.

Every frame a test receives goes through :func:`validate`: the SDK's own pydantic models
(``TypeAdapter(RealtimeServerEvent)``), as ``openai-agents`` does, plus the universal rules of
PROTOCOL.md (unique ``event_id``, ids of at most 32 characters).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import inspect
import io
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import websockets
from omnirt.realtime.app import create_app
from omnirt.realtime.config import ServerConfig
from omnirt.realtime.ws import RealtimeService
from omnirt.stages.engine import Engine, EngineClient
from omnirt.stages.types import GenerationRequest
from openai import AsyncOpenAI
from openai.types.realtime import RealtimeServerEvent
from PIL import Image
from pydantic import TypeAdapter

from tests.fakes import EchoPipeline
from tests.server import serve

MODEL = "echo-test"
ADAPTER: TypeAdapter[Any] = TypeAdapter(RealtimeServerEvent)
#: Documented extensions (PROTOCOL.md) that a stock client never receives unasked.
EXTENSION_EVENTS = {"session.closed", "playback.acknowledged"}
ID_FIELDS = ("event_id", "item_id", "response_id", "previous_item_id")
MAX_FRAME = 1024 * 1024


class RecordingPipeline(EchoPipeline):
    """EchoPipeline that keeps every request it was given (to check the context sent)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.info = dataclasses.replace(self.info, voices=("echo", "alto"))
        self.requests: list[GenerationRequest] = []
        self.removed: list[str] = []

    def add(self, request: GenerationRequest, prepared: Any) -> None:
        self.requests.append(request)
        super().add(request, prepared)

    def remove(self, request_id: str):  # type: ignore[no-untyped-def]
        usage = super().remove(request_id)
        self.removed.append(request_id)
        return usage


@dataclass
class Server:
    base_url: str
    engine: Engine
    pipeline: RecordingPipeline
    service: RealtimeService
    config: ServerConfig

    @property
    def ws_url(self) -> str:
        return self.base_url.replace("http://", "ws://") + "/v1/realtime?model=" + MODEL

    def sdk(self, api_key: str = "test-key") -> AsyncOpenAI:
        return AsyncOpenAI(
            api_key=api_key,
            websocket_base_url=self.base_url.replace("http://", "ws://") + "/v1",
            max_retries=0,
        )


@contextlib.contextmanager
def running(config: ServerConfig | None = None, step_seconds: float = 0.005) -> Iterator[Server]:
    config = config or ServerConfig()
    pipeline = RecordingPipeline(step_seconds=step_seconds)
    engine = Engine(pipeline)
    app = create_app(EngineClient(engine), config)
    with serve(app) as base_url:
        yield Server(base_url, engine, pipeline, app.state.realtime, config)


@pytest.fixture(scope="package")
def server() -> Iterator[Server]:
    with running() as s:
        yield s


def validate(raw: str | bytes, seen_ids: set[str] | None = None) -> dict[str, Any]:
    """Parse one server frame and check it strictly; returns the event as a dict."""
    assert len(raw) < MAX_FRAME, f"server frame of {len(raw)} bytes"
    event = json.loads(raw)
    assert isinstance(event.get("event_id"), str) and event["event_id"].startswith("event_")
    if event["type"] in EXTENSION_EVENTS:
        assert set(event) >= {"type", "event_id"}
    else:
        ADAPTER.validate_python(event)
    for name in ID_FIELDS:
        value = event.get(name)
        assert value is None or len(value) <= 32, f"{name} {value!r} longer than 32"
    if seen_ids is not None:
        assert event["event_id"] not in seen_ids, "event_id reused"
        seen_ids.add(event["event_id"])
    return event


class _Receiver:
    """Receiving shared by both clients: each frame validated strictly, kept in ``events``."""

    events: list[dict[str, Any]]
    _ids: set[str]

    async def _frame(self) -> str | bytes:
        raise NotImplementedError

    async def recv(self, timeout: float = 5.0) -> dict[str, Any]:
        event = validate(await asyncio.wait_for(self._frame(), timeout), self._ids)
        self.events.append(event)
        return event

    async def until(self, kind: str, timeout: float = 10.0) -> list[dict[str, Any]]:
        """Events up to and including the first of type ``kind``."""
        out = []
        while True:
            event = await self.recv(timeout)
            out.append(event)
            if event["type"] == kind:
                return out


@dataclass
class Client(_Receiver):
    """A raw ``websockets`` client: sends any frame, validates every frame it receives."""

    ws: Any
    events: list[dict[str, Any]] = field(default_factory=list)
    _ids: set[str] = field(default_factory=set)

    async def send(self, event: dict[str, Any] | str) -> None:
        await self.ws.send(event if isinstance(event, str) else json.dumps(event))

    async def _frame(self) -> str | bytes:
        return await self.ws.recv()

    async def error(self) -> dict[str, Any]:
        event = await self.recv()
        assert event["type"] == "error", event
        return event["error"]

    async def closed(self, timeout: float = 5.0) -> int | None:
        """Wait for the server to close; validates anything still sent. Returns the close code."""
        with contextlib.suppress(websockets.ConnectionClosed):
            while True:
                await self.recv(timeout)
        return self.ws.close_code


@contextlib.asynccontextmanager
async def connect(
    server: Server,
    *,
    query: str = "",
    headers: dict[str, str] | None = None,
    subprotocols: list[str] | None = None,
    expect_session: bool = True,
    manual: bool = False,
) -> AsyncIterator[Client]:
    """A connected client past ``session.created``. Sessions start with server VAD (OpenAI's
    default); ``manual`` turns it off first, as a client that commits by itself does."""
    async with websockets.connect(
        server.ws_url + query,
        additional_headers=headers or {},
        subprotocols=subprotocols,  # type: ignore[arg-type]
        max_size=MAX_FRAME,
    ) as ws:
        client = Client(ws)
        if expect_session:
            created = await client.recv()
            assert created["type"] == "session.created"
        if manual:
            await client.send(MANUAL_TURNS)
            updated = await client.recv()
            assert updated["type"] == "session.updated", updated
            assert updated["session"]["audio"]["input"]["turn_detection"] is None
        yield client


class SdkClient(_Receiver):
    """The official SDK's connection, reading raw frames so each is validated strictly."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.events: list[dict[str, Any]] = []
        self._ids: set[str] = set()

    async def _frame(self) -> str | bytes:
        return await self.conn.recv_bytes()


#: What a client that commits its turns itself sends first (sessions start with server VAD).
MANUAL_TURNS = {
    "type": "session.update",
    "session": {"type": "realtime", "audio": {"input": {"turn_detection": None}}},
}


@contextlib.asynccontextmanager
async def sdk_connect(server: Server, *, manual: bool = False) -> AsyncIterator[SdkClient]:
    realtime = server.sdk().realtime
    # SDKs from 3.x reconnect on their own; 1.107 (the first GA release) has no such option.
    options = {"max_retries": 0} if "max_retries" in inspect.signature(realtime.connect).parameters else {}
    async with realtime.connect(model=MODEL, **options) as conn:
        client = SdkClient(conn)
        created = await client.recv()
        assert created["type"] == "session.created"
        if manual:
            await conn.session.update(session=MANUAL_TURNS["session"])  # type: ignore[arg-type]
            assert (await client.recv())["type"] == "session.updated"
        yield client


#: The events that end an audio response, in order (after its last audio delta).
AUDIO_RESPONSE_TAIL = [
    "response.output_audio.done",
    "response.output_audio_transcript.done",
    "response.content_part.done",
    "response.output_item.done",
    "conversation.item.done",
    "response.done",
]


def text_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    """A user text message item as ``conversation.item.create`` takes it."""
    item: dict[str, Any] = {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": text}],
    }
    if item_id:
        item["id"] = item_id
    return item


def tone(ms: int, rate: int = 24_000) -> np.ndarray:
    t = np.arange(rate * ms // 1000) / rate
    return (0.3 * np.sin(2 * np.pi * 330 * t) * 32767).astype(np.int16)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def png(size: int | None = None) -> bytes:
    """A readable 1x1 PNG; with ``size``, zero bytes after its end make it exactly ``size`` bytes
    (decoders stop at the image's end)."""
    out = io.BytesIO()
    Image.new("RGB", (1, 1), (200, 30, 30)).save(out, "PNG")
    data = out.getvalue()
    if size is not None:
        assert size >= len(data), f"a PNG has at least {len(data)} bytes"
        data += bytes(size - len(data))
    return data


def pcm_b64(ms: int) -> str:
    return b64(tone(ms).astype("<i2").tobytes())


def wait_until(predicate: Any, timeout: float = 5.0) -> bool:
    """Poll ``predicate`` (state the engine thread updates asynchronously)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return bool(predicate())


def run(coro: Any) -> Any:
    return asyncio.run(coro)
