"""Helpers for server VAD tests over the WebSocket: streaming audio, VAD settings."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from .conftest import Client, b64

CHUNK_MS = 100


def vad_update(**settings: Any) -> dict[str, Any]:
    return {
        "type": "session.update",
        "session": {
            "type": "realtime",
            "audio": {"input": {"turn_detection": {"type": "server_vad", **settings}}},
        },
    }


async def stream_audio(
    c: Client, pcm16: bytes, *, chunk_ms: int = CHUNK_MS, speed: float = 10.0
) -> list[float]:
    """Append ``pcm16`` (24 kHz) in chunks, ``speed`` times faster than real time (``1.0``: paced
    by the clock). Returns the wall time each chunk was sent."""
    step = 48 * chunk_ms
    sent: list[float] = []
    t0 = time.perf_counter()
    for i, start in enumerate(range(0, len(pcm16), step)):
        delay = t0 + i * chunk_ms / 1000 / speed - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        await c.send({"type": "input_audio_buffer.append", "audio": b64(pcm16[start : start + step])})
        sent.append(time.perf_counter())
    return sent


def kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]
