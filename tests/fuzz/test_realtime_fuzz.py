"""Property-based fuzzing of ``/v1/realtime`` on a live ``omnirt serve`` (the embedded models).

Each example opens a session (GA, or beta with ``OpenAI-Beta: realtime=v1``), sends a few frames
drawn from :mod:`.realtime_events` (events of every client type, mutated and malformed frames),
then a plain ``session.update`` as a probe, and reads up to its ``session.updated`` (then cancels
a reply still streaming, and reads up to its ``response.done``). It holds when:

- every server frame is strict JSON (no ``NaN``) and validates against the openai SDK's models (GA
  or beta) and the protocol's rules (``tests.realtime.conftest.validate``);
- no ``error`` is of type or code ``server_error``, and no response fails with one;
- the probe is answered: the connection is still usable. The only closes allowed are the
  documented ones the frames asked for: 1000 after ``session.close``, 1007 (or 1006: the socket
  closed at once) after a text frame that is not UTF-8 (RFC 6455; the transport's close);
- the server logged no traceback and nothing at ERROR.

Last, the server's memory (with its VAD process) has grown by less than ``RSS_GROWTH_LIMIT``
over the whole run, after a warm-up that ran each kind of work once.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
from typing import Any

import websockets
from hypothesis import event, given
from hypothesis import strategies as st
from openai.types.beta.realtime import RealtimeServerEvent as BetaServerEvent
from pydantic import TypeAdapter

from tests.realtime.conftest import EXTENSION_EVENTS, MAX_FRAME, validate

from .conftest import LiveServer, fuzz_settings, strict_json
from .hostile import Frame
from .realtime_events import PNG_B64, frames, pcm

BETA_ADAPTER: TypeAdapter[Any] = TypeAdapter(BetaServerEvent)
#: Close codes a client may cause, and the frame kind or event that causes each.
CLOSE_NORMAL = 1000  # session.close
#: A text frame that is not UTF-8: the transport fails the connection (RFC 6455 7.1.7), sending
#: 1007 and closing the socket at once, so a client still sending sees its close frame lost: 1006.
CLOSE_INVALID_UTF8 = {1007, 1006}
#: Longest wait for one server event (a reply streams while the probe is answered).
RECV_TIMEOUT = 30.0
#: Growth of the server's RSS over the fuzz run, after the warm-up.
RSS_GROWTH_LIMIT = 128 * 1024 * 1024
_probes = itertools.count()


def validate_beta(raw: str | bytes, seen: set[str]) -> dict[str, Any]:
    """A beta client's frame, checked with the SDK's beta models (as tests/realtime/test_beta)."""
    assert len(raw) < MAX_FRAME, f"server frame of {len(raw)} bytes"
    parsed = json.loads(raw)
    assert isinstance(parsed.get("event_id"), str) and parsed["event_id"] not in seen, parsed
    seen.add(parsed["event_id"])
    if parsed["type"] not in EXTENSION_EVENTS:
        BETA_ADAPTER.validate_python(parsed)
    return parsed


def assert_no_server_error(parsed: dict[str, Any]) -> None:
    """No error event, failed transcription or failed response of type or code ``server_error``."""
    kind = parsed["type"]
    error: Any = None
    if kind == "error" or kind.endswith("transcription.failed"):
        error = parsed.get("error")
    elif kind == "response.done":
        error = ((parsed["response"].get("status_details") or {}).get("error")) or None
    if error:
        assert error.get("type") != "server_error" and error.get("code") != "server_error", parsed


async def send(ws: Any, frame: Frame) -> None:
    if frame.kind == "text":
        await ws.send(frame.data)
    elif frame.kind == "bad_utf8":
        await ws.send(frame.data, text=True)
    else:
        await ws.send(frame.data, text=False)


async def exchange(live: LiveServer, sent: list[Frame], beta: bool) -> str:
    """Run one example; returns the session's id."""
    headers = {"OpenAI-Beta": "realtime=v1"} if beta else {}
    seen: set[str] = set()

    def check(raw: str | bytes) -> dict[str, Any]:
        strict_json(raw)
        parsed = validate_beta(raw, seen) if beta else validate(raw, seen)
        assert_no_server_error(parsed)
        return parsed

    async with websockets.connect(live.ws_url, additional_headers=headers, max_size=MAX_FRAME) as ws:
        created = check(await asyncio.wait_for(ws.recv(), RECV_TIMEOUT))
        assert created["type"] == "session.created"
        marker = f"probe {next(_probes)}"
        probe = {"type": "session.update", "session": {"instructions": marker}}
        if not beta:
            probe["session"]["type"] = "realtime"
        streaming: set[str] = set()  # responses created and not done

        async def receive() -> dict[str, Any]:
            reply = check(await asyncio.wait_for(ws.recv(), RECV_TIMEOUT))
            kind = reply["type"]
            event(f"server: {kind}" + (f" {reply['error']['code']}" if kind == "error" else ""))
            if kind == "response.created":
                streaming.add(reply["response"]["id"])
            elif kind == "response.done":
                streaming.discard(reply["response"]["id"])
            return reply

        try:
            for frame in sent:
                event(f"frame: {frame.kind}")
                await send(ws, frame)
            await ws.send(json.dumps(probe))
            while True:
                reply = await receive()
                if reply["type"] == "session.updated" and reply["session"].get("instructions") == marker:
                    break
            # A reply still streaming is cancelled, and must end with its response.done.
            if streaming:
                await ws.send(json.dumps({"type": "response.cancel"}))
                while streaming:
                    await receive()
            return created["session"]["id"]
        except websockets.ConnectionClosed:
            pass
        # Closed by the server: everything it sent first is checked too, and the close must be one
        # the frames asked for.
        with contextlib.suppress(websockets.ConnectionClosed):
            while True:
                check(await asyncio.wait_for(ws.recv(), RECV_TIMEOUT))
        allowed = set()
        if any(f.kind == "bad_utf8" for f in sent):
            allowed |= CLOSE_INVALID_UTF8
        if any(f.kind == "text" and '"session.close"' in str(f.data) for f in sent):
            allowed.add(CLOSE_NORMAL)
        assert ws.close_code in allowed, f"closed with {ws.close_code} ({ws.close_reason!r})"
        event(f"closed: {ws.close_code}")
        return created["session"]["id"]


def warm_up(live: LiveServer) -> None:
    """Each kind of realtime work once (a text and an audio reply, an image part, committed and
    transcribed audio) before the baseline memory is taken."""

    async def main() -> None:
        async with websockets.connect(live.ws_url, max_size=MAX_FRAME) as ws:
            await ws.recv()
            events = [
                {
                    "type": "session.update",
                    "session": {
                        "type": "realtime",
                        "audio": {"input": {"turn_detection": None, "transcription": {"model": "whisper-1"}}},
                    },
                },
                {
                    "type": "conversation.item.create",
                    "item": {
                        "type": "message",
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "hello"},
                            {"type": "input_image", "image_url": "data:image/png;base64," + PNG_B64},
                        ],
                    },
                },
                {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm(300)).decode()},
                {"type": "input_audio_buffer.commit"},
                {"type": "response.create", "response": {"max_output_tokens": 3}},
            ]
            for event in events:
                await ws.send(json.dumps(event))
            while json.loads(await asyncio.wait_for(ws.recv(), 60))["type"] != "response.done":
                pass
            await ws.send(
                json.dumps(
                    {
                        "type": "response.create",
                        "response": {"max_output_tokens": 3, "output_modalities": ["text"]},
                    }
                )
            )
            while json.loads(await asyncio.wait_for(ws.recv(), 60))["type"] != "response.done":
                pass

    for _ in range(2):
        asyncio.run(main())


@fuzz_settings(examples=150)
@given(sent=st.lists(frames(), min_size=2, max_size=8), beta=st.sampled_from([False, False, False, True]))
def test_client_events_never_break_the_server_or_the_connection(
    live: LiveServer, sent: list[Frame], beta: bool
) -> None:
    if live.baseline_rss is None:
        warm_up(live)
        live.assert_no_fault_logged()
        live.baseline_rss = live.rss()
    session = asyncio.run(exchange(live, sent, beta))
    live.assert_alive()
    live.assert_no_fault_logged(until=f"realtime session {session} ended")


def test_server_memory_stayed_bounded(live: LiveServer) -> None:
    """Runs after the fuzzing above (same module, same server): RSS grew by under the limit."""
    if live.baseline_rss is None:  # run alone
        warm_up(live)
        live.baseline_rss = live.rss()
    rss = live.settled_rss()
    grown = rss - live.baseline_rss
    print(f"realtime fuzz: server RSS {live.baseline_rss / 2**20:.0f} MiB -> {rss / 2**20:.0f} MiB")
    assert grown < RSS_GROWTH_LIMIT, f"server RSS grew by {grown / 2**20:.0f} MiB"
    live.assert_no_fault_logged()
