"""Full-duplex sessions (``?duplex=1``) over the real WebSocket: a real engine with the turn pipeline
and the embedded default's duplex model (the demo Moshi, its Mimi and tokenizer), every server
frame validated strictly.

The demo samples (it talks in stretches and is silent between; see ``stages/duplex/demo.py``)
with a fixed seed, so a session's output depends on its input alone. The server's stretch rule
is the default one (text or audio above -40 dBFS starts a stretch, 6 quiet frames with padding
text end it). Input goes faster than real time (the tick runs every 10 ms).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import websockets
from omnirt.realtime.app import create_app
from omnirt.realtime.config import ServerConfig
from omnirt.sessions.stretches import level_dbfs
from omnirt.stages.duplex.pipeline import DuplexPipeline
from omnirt.stages.engine import Engine, EngineClient

from tests.duplex.helpers import FRAME, pipeline
from tests.server import serve

from .conftest import AUDIO_RESPONSE_TAIL, MAX_FRAME, Client, RecordingPipeline, Server, connect, run

FRAME_BYTES = 2 * FRAME
QUIET_FRAMES = 6


@dataclass
class DuplexServer:
    server: Server
    duplex: DuplexPipeline

    def stepped(self) -> int:
        """Session frames the duplex pipeline has stepped (all sessions together)."""
        return sum(n * count for (name, n), count in self.duplex.calls.items() if name == "lm")


@contextlib.contextmanager
def duplex_running(**overrides) -> Iterator[DuplexServer]:  # type: ignore[no-untyped-def]
    settings = dict(vad_preload=False, duplex_max_ahead_ms=12_000, max_sessions=8)
    config = ServerConfig(**{**settings, **overrides})
    speech = RecordingPipeline(step_seconds=0.005)
    duplex = pipeline(slots=4, period=0.01)
    engine = Engine([speech, duplex])
    app = create_app(EngineClient(engine), config)
    with serve(app) as base_url:
        yield DuplexServer(Server(base_url, engine, speech, app.state.realtime, config), duplex)


@pytest.fixture(scope="module")
def dserver() -> Iterator[DuplexServer]:
    with duplex_running() as s:
        yield s


def speech_pcm(seconds: float, sentence: int = 0) -> bytes:
    """Real speech (espeak-ng), looped to ``seconds``, as PCM16 bytes."""
    from tests.vad.speech import SENTENCES, spoken

    voice = spoken(SENTENCES[sentence])
    n = int(seconds * 24_000)
    x = np.resize(np.concatenate([voice, np.zeros(2400, np.float32)]), n)
    return (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()


async def send_audio(client: Client, pcm: bytes, chunk_ms: int = 80) -> None:
    step = chunk_ms * 48
    for i in range(0, len(pcm), step):
        await client.send(
            {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm[i : i + step]).decode()}
        )


async def drain(
    client: Client, done: Callable[[], bool], quiet: float = 0.5, timeout: float = 40
) -> list[dict]:
    """Reads events until ``done()`` holds and nothing more came for ``quiet`` seconds."""
    async with asyncio.timeout(timeout):
        while True:
            try:
                await client.recv(quiet)
            except TimeoutError:
                if done():
                    return client.events


def responses(events: list[dict]) -> list[list[dict]]:
    """The events of each response, from ``response.created`` to ``response.done`` (a last one
    may still be open); checks that nothing of a response falls outside its bracket."""
    out: list[list[dict]] = []
    current: list[dict] | None = None
    for e in events:
        if e["type"] == "response.created":
            assert current is None, "a response opened inside another"
            current = [e]
            out.append(current)
        elif current is not None:
            current.append(e)
            if e["type"] == "response.done":
                current = None
        else:
            assert not e["type"].startswith("response."), e["type"]
    return out


def completed(events: list[dict]) -> list[list[dict]]:
    return [r for r in responses(events) if r[-1]["type"] == "response.done"]


def audio_bytes(events: list[dict]) -> bytes:
    return b"".join(
        base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta"
    )


def transcript(events: list[dict]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta")


def spoken_by(stretch: list[dict], frames: int) -> str:
    """The transcript of a stretch's first ``frames`` frames (a frame's text comes before its audio)."""
    text, audio = "", 0
    for e in stretch:
        if e["type"] == "response.output_audio.delta":
            audio += len(base64.b64decode(e["delta"]))
        elif e["type"] == "response.output_audio_transcript.delta":
            if audio >= frames * FRAME_BYTES:
                break
            text += e["delta"]
    return text


def deltas(events: list[dict]) -> list[tuple[str, str]]:
    kinds = ("response.output_audio.delta", "response.output_audio_transcript.delta")
    return [(e["type"], e["delta"]) for e in events if e["type"] in kinds]


def opened(d: DuplexServer, **kw):  # type: ignore[no-untyped-def]
    return connect(d.server, query="&duplex=1", **kw)


async def session_events(d: DuplexServer, pcms: list[bytes]) -> list[list[dict]]:
    """Each pcm streamed by its own session, all at once; the events each got once the model
    has heard all of them."""
    target = d.stepped() + sum(len(p) // FRAME_BYTES for p in pcms)

    async def one(pcm: bytes) -> list[dict]:
        async with opened(d) as c:
            await send_audio(c, pcm)
            return await drain(c, lambda: d.stepped() >= target)

    return list(await asyncio.gather(*(one(p) for p in pcms)))


def test_ten_seconds_of_speech_get_one_frame_per_frame_and_bracketed_stretches(dserver: DuplexServer) -> None:
    pcm = speech_pcm(10.0)
    before = dserver.stepped()
    (events,) = run(session_events(dserver, [pcm]))
    assert events[0]["session"]["audio"]["input"]["turn_detection"] is None
    assert dserver.stepped() - before == len(pcm) // FRAME_BYTES == 125  # a model frame per 80 ms of input
    stretches = completed(events)
    assert len(stretches) >= 2  # the model's speech starts and ends, more than once
    sent = 0
    for r in stretches:
        kinds = [e["type"] for e in r]
        assert kinds[:4] == [
            "response.created",
            "response.output_item.added",
            "conversation.item.added",
            "response.content_part.added",
        ]
        assert kinds[-len(AUDIO_RESPONSE_TAIL) :] == AUDIO_RESPONSE_TAIL
        audio = np.frombuffer(audio_bytes(r), "<i2")
        assert len(audio) % FRAME == 0
        frames = audio.reshape(-1, FRAME)
        sent += len(frames)
        assert level_dbfs(frames[:3]) > -20  # it talks: loud audio from the start ...
        assert all(level_dbfs(f) <= -40 for f in frames[-QUIET_FRAMES:])  # ... ends after 6 quiet frames
        assert transcript(r)  # with text
        done = r[-1]["response"]
        assert done["status"] == "completed"
        assert done["output"][0]["content"][0]["transcript"] == transcript(r)
    assert sent < 125  # the silences between stretches are not sent


def test_sessions_together_get_what_they_get_alone(dserver: DuplexServer) -> None:
    pcms = [speech_pcm(10.0, 0), speech_pcm(10.0, 1), speech_pcm(10.0, 0)[4800:] + bytes(4800)]
    alone = [deltas(run(session_events(dserver, [p]))[0]) for p in pcms]
    together = [deltas(e) for e in run(session_events(dserver, pcms))]
    assert alone[0] != alone[1] and alone[0] != alone[2]  # the model's output depends on what it hears
    assert all(alone)
    for a, t in zip(alone, together, strict=True):
        assert a == t


def test_ack_and_truncate_cut_the_history(dserver: DuplexServer) -> None:
    pcm = speech_pcm(10.0)
    target = dserver.stepped() + len(pcm) // FRAME_BYTES

    async def main() -> tuple[list[list[dict]], dict]:
        async with opened(dserver) as c:
            await send_audio(c, pcm)
            first, second = completed(await drain(c, lambda: dserver.stepped() >= target))[:2]
            item1, item2 = first[1]["item"]["id"], second[1]["item"]["id"]
            resp2 = second[0]["response"]["id"]
            out = {}
            await c.send(
                {
                    "type": "conversation.item.truncate",
                    "item_id": item1,
                    "content_index": 0,
                    "audio_end_ms": 800,
                }
            )
            out["truncated"] = await c.recv()
            await c.send({"type": "playback.ack", "response_id": resp2, "item_id": item2, "played_ms": 400})
            out["acked"] = await c.recv()
            for name, item in (("got1", item1), ("got2", item2)):
                await c.send({"type": "conversation.item.retrieve", "item_id": item})
                out[name] = await c.recv()
            return [first, second], out

    (first, second), out = run(main())
    assert len(audio_bytes(first)) > 10 * FRAME_BYTES and len(audio_bytes(second)) > 5 * FRAME_BYTES
    truncated = out["truncated"]
    assert truncated["type"] == "conversation.item.truncated" and truncated["audio_end_ms"] == 800
    acked = out["acked"]
    assert acked["type"] == "playback.acknowledged" and acked["played_ms"] == 400
    assert acked["committed_ms"] == 400  # a finished stretch is cut at once
    # 800 ms = 10 frames, 400 ms = 5 frames: the history keeps the text spoken by then
    assert out["got1"]["item"]["content"][0]["transcript"] == spoken_by(first, 10)
    assert out["got2"]["item"]["content"][0]["transcript"] == spoken_by(second, 5)
    assert len(spoken_by(first, 10)) < len(transcript(first))  # a real cut


def test_cancel_ends_the_stretch_and_the_model_keeps_listening(dserver: DuplexServer) -> None:
    pcm = speech_pcm(10.0)
    (alone,) = run(session_events(dserver, [pcm]))
    target = dserver.stepped() + len(pcm) // FRAME_BYTES

    async def main() -> tuple[list[dict], dict]:
        async with opened(dserver) as c:
            await send_audio(c, pcm)
            created = (await c.until("response.created", timeout=20))[-1]
            rid = created["response"]["id"]
            item = (await c.until("response.output_item.added"))[-1]["item"]["id"]
            for _ in range(3):
                await c.until("response.output_audio.delta")
            await c.send({"type": "playback.ack", "response_id": rid, "item_id": item, "played_ms": 240})
            await c.until("playback.acknowledged")
            await c.send({"type": "response.cancel"})
            await c.until("response.done")
            events = await drain(c, lambda: dserver.stepped() >= target)
            await c.send({"type": "conversation.item.retrieve", "item_id": item})
            return events, await c.recv()

    events, got = run(main())
    cancelled, *rest = responses(events)
    done = cancelled[-1]["response"]
    assert done["status"] == "cancelled" and done["status_details"]["reason"] == "client_cancelled"
    assert got["item"]["content"][0]["transcript"] == spoken_by(cancelled, 3)  # cut at the ack: 3 frames
    # Nothing more of the cancelled stretch was sent; the later stretches are those of the same
    # input alone: the model kept listening, its state untouched by the cancel.
    assert rest and all(r[0]["response"]["id"] != done["id"] for r in rest)
    assert [deltas(r) for r in rest] == [deltas(r) for r in responses(alone)[1:]]


def test_bad_events_get_clear_errors_and_the_session_goes_on(dserver: DuplexServer) -> None:
    async def main() -> list[dict]:
        async with opened(dserver) as c:
            errors = []
            for event in (
                {"type": "input_audio_buffer.commit"},
                {"type": "input_audio_buffer.clear"},
                {"type": "response.create"},
                {"type": "response.cancel"},
                {
                    "type": "session.update",
                    "session": {
                        "type": "realtime",
                        "audio": {"input": {"turn_detection": {"type": "server_vad"}}},
                    },
                },
                {"type": "input_audio_buffer.append", "audio": base64.b64encode(b"abc").decode()},
                {
                    "type": "input_audio_buffer.append",
                    "audio": base64.b64encode(bytes(2 * 24_000 * 13)).decode(),
                },
                {"type": "conversation.item.retrieve", "item_id": "item_nope"},
                {
                    "type": "conversation.item.truncate",
                    "item_id": "item_nope",
                    "content_index": 0,
                    "audio_end_ms": 0,
                },
            ):
                await c.send(event)
                errors.append((await c.recv())["error"])
            await c.send(
                {
                    "type": "session.update",
                    "session": {
                        "type": "realtime",
                        "instructions": "be brief",
                        "audio": {"input": {"format": {"type": "audio/pcmu"}}},
                    },
                }
            )
            updated = await c.recv()
            assert updated["session"]["instructions"] == "be brief"
            mulaw = bytes([0xFF]) * 8000  # 1 s of G.711 silence, resampled to 24 kHz
            await c.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(mulaw).decode()})
            await c.send({"type": "session.close"})
            await c.until("session.closed")
            return errors

    errors = run(main())
    codes = [e["code"] for e in errors]
    assert codes == [
        "unsupported",
        "unsupported",
        "unsupported",
        "response_cancel_not_active",
        "invalid_value",
        "invalid_value",
        "input_backpressure",
        "item_retrieve_invalid_item_id",
        "item_truncate_invalid_item_id",
    ]
    assert "full-duplex" in errors[0]["message"]


def test_duplex_without_a_duplex_model_is_refused() -> None:
    from .conftest import running

    async def main(server: Server) -> tuple[dict, int | None]:
        async with connect(server, query="&duplex=1", expect_session=False) as c:
            error = await c.error()
            return error, await c.closed()

    with running(ServerConfig(vad_preload=False)) as server:
        error, code = run(main(server))
    assert error["code"] == "unsupported" and code == 1008


def test_push_to_talk_with_duplex_is_refused_not_ignored() -> None:
    """``?duplex=1&turn=push_to_talk`` asks for two things that cannot hold at once: refused with
    ``invalid_value`` and close 1008 (it opened a duplex session, the turn silently dropped)."""

    async def main(d: DuplexServer) -> tuple[dict, int | None]:
        async with connect(d.server, query="&duplex=1&turn=push_to_talk", expect_session=False) as c:
            error = await c.error()
            return error, await c.closed()

    with duplex_running() as d:
        error, code = run(main(d))
    assert (error["code"], code) == ("invalid_value", 1008)
    assert "turn=push_to_talk does not apply to a full-duplex session" in error["message"]


def test_a_stalled_reader_is_dropped_without_delaying_the_others() -> None:
    with duplex_running(max_held_seconds=1.0, hold_send_queue_bytes=32 * 1024) as d:
        service = d.server.service
        pcm = speech_pcm(10.0)
        (alone,) = run(session_events(d, [pcm]))

        async def stalled() -> int | None:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", int(d.server.base_url.rsplit(":", 1)[1])))
            url = d.server.ws_url + "&duplex=1"
            async with websockets.connect(url, sock=sock, max_queue=1, max_size=MAX_FRAME) as ws:
                c = Client(ws)
                await c.recv()
                await send_audio(c, pcm)  # then reads nothing
                while service.slow_clients_closed == 0:
                    await asyncio.sleep(0.05)
                return await c.closed(timeout=10)

        async def good() -> list[dict]:
            async with opened(d) as c:
                await asyncio.sleep(0.2)  # the stalled one is streaming already
                start = d.stepped()
                await send_audio(c, pcm)
                return await drain(c, lambda: d.stepped() >= start + len(pcm) // FRAME_BYTES)

        async def main():  # type: ignore[no-untyped-def]
            return await asyncio.gather(stalled(), good())

        code, events = run(main())
        assert code == 1008 and service.clients_held >= 1
        assert deltas(events) == deltas(alone)  # the good session got all it gets alone
        assert all(r[-1]["response"]["status"] == "completed" for r in completed(events))


def test_models_and_metrics_show_the_duplex_model(dserver: DuplexServer) -> None:
    import httpx

    base = dserver.server.base_url
    models = httpx.get(base + "/v1/models").json()
    assert "demo-moshi" in [m["id"] for m in models["data"]]
    metrics = httpx.get(base + "/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith('omnirt_pipeline_steps_total{kind="duplex"}'))
    assert float(line.split()[-1]) == dserver.server.engine.stats.steps_by_kind["duplex"]


def test_settings_the_model_cannot_follow_are_refused(dserver: DuplexServer) -> None:
    """Text-only output, function tools, a reply length cap and a truncation other than ``auto``:
    the duplex model always speaks, calls no tools, decides how long it speaks and lets its oldest
    audio fall out of its window, so a session.update asking for any of them gets ``unsupported``
    naming the field (the session keeps what it had), instead of an echo that says text-only while
    audio keeps coming. ``["audio"]``, no tools, a tool_choice alone, ``max_output_tokens: inf``
    and ``truncation: auto`` are fine."""

    async def main() -> tuple[list[dict], dict]:
        async with opened(dserver) as c:
            errors = []
            tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
            ratio = {"type": "retention_ratio", "retention_ratio": 0.5}
            patches = (
                {"output_modalities": ["text"]},
                {"tools": [tool]},
                {"truncation": "disabled"},
                {"truncation": ratio},
                {"max_output_tokens": 100},
            )
            for patch in patches:
                await c.send({"type": "session.update", "session": {"type": "realtime", **patch}})
                errors.append(await c.error())
            await c.send(
                {
                    "type": "session.update",
                    "session": {
                        "type": "realtime",
                        "output_modalities": ["audio"],
                        "tools": [],
                        "tool_choice": "auto",
                        "truncation": "auto",
                        "max_output_tokens": "inf",
                    },
                }
            )
            return errors, (await c.until("session.updated"))[-1]["session"]

    errors, session = run(main())
    assert [(e["code"], e["param"]) for e in errors] == [
        ("unsupported", "session.output_modalities"),
        ("unsupported", "session.tools"),
        ("unsupported", "session.truncation"),
        ("unsupported", "session.truncation"),
        ("unsupported", "session.max_output_tokens"),
    ]
    assert session["output_modalities"] == ["audio"] and session["tools"] == []
    assert session["truncation"] == "auto"
