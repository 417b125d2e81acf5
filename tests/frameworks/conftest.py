"""Voice-agent frameworks against a real ``omnirt serve`` on loopback.

One server for the package: the ``omnirt serve`` CLI in a process of its own, serving the
embedded demo model (random weights) on CPU, as a new user starts it. Each test points its
framework at a :class:`~tests.frameworks.relay.Relay` in front of that server (the framework's
own URL option, nothing else changed), which validates every server frame strictly and records
both directions for the failure messages.

The frameworks are a test extra (``pip install -e '.[frameworks]'``, which ``install.sh`` runs);
a missing one, or a missing espeak-ng/sox, skips locally and fails under CI (``CI`` set).
"""

from __future__ import annotations

import asyncio
import importlib
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from tests.frameworks.relay import Connection, Relay, relay_to
from tests.server import serve_cli

#: The pip extra that holds the frameworks (pyproject.toml).
EXTRA = "frameworks"
#: What the frameworks send as their API key (the server runs without auth).
API_KEY = "sk-omnirt-test"
RATE = 24_000
SENTENCE = "Hello there, I would like to book a table for two people tonight, please."
BARGE_IN = "Wait, stop, could you tell me the weather for tomorrow morning instead?"


def missing(what: str, hint: str) -> None:
    """Skip (fail under CI) because ``what`` is not installed."""
    message = f"{what} not installed ({hint})"
    if os.environ.get("CI"):
        pytest.fail(f"{message}: CI must run every framework test", pytrace=False)
    pytest.skip(message, allow_module_level=True)


def need(module: str, distribution: str) -> ModuleType:
    """Import ``module`` of the frameworks extra, or skip/fail (under CI) saying what is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing(f"{distribution} ({exc})", f"pip install -e '.[{EXTRA}]'")
        raise  # unreachable: missing() raises


def need_speech_tools() -> None:
    tools = [tool for tool in ("espeak-ng", "sox") if shutil.which(tool) is None]
    if tools:
        missing(" and ".join(tools), "apt-get install -y espeak-ng sox")


def speech(text: str = SENTENCE, *, lead_ms: int = 300, tail_ms: int = 1200) -> bytes:
    """``text`` spoken by espeak-ng: 24 kHz mono PCM16 with silence around it (server VAD ends
    the turn in the tail)."""
    need_speech_tools()
    from tests.vad.speech import place, spoken

    return place(spoken(text), lead_ms=lead_ms, tail_ms=tail_ms).pcm16()


def silence(ms: int) -> bytes:
    return np.zeros(RATE * ms // 1000, "<i2").tobytes()


async def stream(
    send: Callable[[bytes], Any], pcm16: bytes, *, chunk_ms: int = 40, speed: float = 1.0
) -> None:
    """Hand ``pcm16`` (24 kHz) to ``send`` in ``chunk_ms`` chunks, paced as a microphone would
    (``speed`` times real time). ``send`` may be sync or async."""
    step = RATE * 2 * chunk_ms // 1000
    t0 = time.perf_counter()
    for i, start in enumerate(range(0, len(pcm16), step)):
        delay = t0 + i * chunk_ms / 1000 / speed - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        result = send(pcm16[start : start + step])
        if asyncio.iscoroutine(result):
            await result


async def until(condition: Callable[[], Any], timeout: float, what: str, conn: Connection | None) -> Any:
    """Poll ``condition`` until it is truthy; on timeout fail saying ``what`` was awaited and
    showing the frames that crossed the relay."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            trace = conn.summary() if conn is not None else "(no connection)"
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}\n{trace}", pytrace=False)
        await asyncio.sleep(0.05)


async def barge_in_handled(conn: Connection) -> None:
    """After the user talked over a reply: the server's turn detection cancelled it, the
    framework truncated it to what it played and the server accepted that, and the interrupting
    speech got a response of its own."""
    done = await until(lambda: conn.server("response.done"), 30, "response.done", conn)
    first = done[0]["response"]
    assert first["status"] == "cancelled", first
    assert first["status_details"]["reason"] == "turn_detected", first
    await until(lambda: conn.client("conversation.item.truncate"), 10, "conversation.item.truncate", conn)
    await until(
        lambda: conn.server("conversation.item.truncated") or conn.errors(),
        10,
        "conversation.item.truncated",
        conn,
    )
    assert not conn.errors(), conn.summary()
    await until(
        lambda: len(conn.server("response.created")) >= 2, 60, "the reply to the interrupting turn", conn
    )


def reply_after_tool_output(conn: Connection) -> dict[str, Any] | None:
    """The ``response.created`` of the first response the server started after it added a
    ``function_call_output`` item, once that response has an output item; ``None`` before."""
    output_added = False
    for event in conn.server():
        if event["type"] == "conversation.item.added" and event["item"]["type"] == "function_call_output":
            output_added = True
        elif event["type"] == "response.created" and output_added:
            rid = event["response"]["id"]
            return (
                event
                if any(e["response_id"] == rid for e in conn.server("response.output_item.added"))
                else None
            )
    return None


def audible(pcm16: bytes) -> bool:
    """Some PCM16 that is not silence."""
    return len(pcm16) >= 2 and int(np.abs(np.frombuffer(pcm16[: len(pcm16) // 2 * 2], "<i2")).max()) > 0


@dataclass
class OmnirtServer:
    base_url: str
    log: Path


@pytest.fixture(scope="package")
def omnirt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OmnirtServer]:
    """``omnirt serve --device cpu``: the embedded demo model, as the README starts it."""
    log = tmp_path_factory.mktemp("log") / "serve.log"
    with serve_cli(["--device", "cpu"], cache=tmp_path_factory.mktemp("cache"), log=log) as base:
        yield OmnirtServer(base, log)
    assert "Traceback" not in log.read_text(), log.read_text()[-5000:]


@pytest.fixture
def relay(omnirt: OmnirtServer) -> Iterator[Relay]:
    """A relay to the server for one test. After the test: every server frame that crossed it
    passed strict validation."""
    with relay_to(omnirt.base_url) as r:
        yield r
    invalid = [(event.get("type"), why) for c in r.connections for event, why in c.invalid]
    assert not invalid, f"server frames failing strict validation: {invalid}"
