"""Full-duplex sessions (``?duplex=1``) over the real WebSocket: a real engine with the turn pipeline
and a duplex pipeline (fake LM, real tiny Mimi), every server frame validated strictly.

The fake model talks (a letter per frame) on frames ``n % 40 < 20`` for ``n < 120`` and is
silent otherwise; the server's quiet level is set above any audio (0 dBFS), so the text alone
decides where stretches are: frames 0-25, 40-65 and 80-105 (each 20 talking frames, then the 6
quiet frames that end it).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import websockets
from omnirt.realtime.app import create_app
from omnirt.realtime.config import ServerConfig
from omnirt.stages.duplex.pipeline import DuplexPipeline
from omnirt.stages.engine import Engine, EngineClient

from tests.duplex.helpers import FRAME, pipeline, tiny_mimi
from tests.server import serve

from .conftest import AUDIO_RESPONSE_TAIL, MAX_FRAME, Client, RecordingPipeline, Server, connect, run

STRETCH_FRAMES = 26
STRETCHES = [(0, 25), (40, 65), (80, 105)]


def talking(n: int) -> bool:
    return n % 40 < 20 and n < 120


@dataclass
class DuplexServer:
    server: Server
    duplex: DuplexPipeline


@contextlib.contextmanager
def duplex_running(**overrides) -> Iterator[DuplexServer]:  # type: ignore[no-untyped-def]
    settings = dict(vad_preload=False, duplex_quiet_dbfs=0.0, duplex_max_ahead_ms=12_000, max_sessions=8)
    config = ServerConfig(**{**settings, **overrides})
    speech = RecordingPipeline(step_seconds=0.005)
    duplex = pipeline(tiny_mimi, slots=4, talking=talking, period=0.01)
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


def responses(events: list[dict]) -> list[list[dict]]:
    """The events of each response, from ``response.created`` to ``response.done``; checks that
    nothing of a response falls outside its bracket."""
    out: list[list[dict]] = []
    current: list[dict] | None = None
    for e in events:
        if e["type"] == "response.created":
            assert current is None, "a response opened inside another"
            current = [e]
        elif current is not None:
            current.append(e)
            if e["type"] == "response.done":
                out.append(current)
                current = None
        else:
            assert not e["type"].startswith("response."), e["type"]
    return out


def audio_bytes(events: list[dict]) -> bytes:
    return b"".join(
        base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta"
    )


def transcript(events: list[dict]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta")


def opened(d: DuplexServer, **kw):  # type: ignore[no-untyped-def]
    return connect(d.server, query="&duplex=1", **kw)


async def until_done(client: Client, count: int, timeout: float = 20.0) -> list[dict]:
    done = 0
    async with asyncio.timeout(timeout):
        while done < count:
            done += (await client.recv(timeout))["type"] == "response.done"
    return client.events


def test_ten_seconds_of_speech_get_one_frame_per_frame_and_bracketed_stretches(dserver: DuplexServer) -> None:
    pcm = speech_pcm(10.0)

    def stepped() -> int:
        return sum(n for (name, _), n in dserver.duplex.calls.items() if name == "lm")

    before = stepped()

    async def main() -> list[dict]:
        async with opened(dserver) as c:
            created = c.events[0]["session"]
            assert created["audio"]["input"]["turn_detection"] is None
            await send_audio(c, pcm)
            events = await until_done(c, 3)
            async with asyncio.timeout(10):
                while stepped() - before < 125:
                    await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)  # all input consumed: nothing more is stepped
            return events

    events = run(main())
    assert stepped() - before == len(pcm) // 2 // FRAME == 125  # one model frame per 80 ms of input
    stretches = responses(events)
    assert len(stretches) == 3
    for r in stretches:
        kinds = [e["type"] for e in r]
        assert kinds[:4] == [
            "response.created",
            "response.output_item.added",
            "conversation.item.added",
            "response.content_part.added",
        ]
        assert kinds[-len(AUDIO_RESPONSE_TAIL) :] == AUDIO_RESPONSE_TAIL
        assert len(audio_bytes(r)) == STRETCH_FRAMES * FRAME * 2
        assert len(transcript(r)) == 20
        done = r[-1]["response"]
        assert done["status"] == "completed"
        assert done["output"][0]["content"][0]["transcript"] == transcript(r)


async def _alone_or_together(d: DuplexServer, pcms: list[bytes]) -> list[list[tuple[str, str]]]:
    async def one(pcm: bytes) -> list[tuple[str, str]]:
        async with opened(d) as c:
            await send_audio(c, pcm)
            events = await until_done(c, 3, timeout=40)
            return [
                (e["type"], e.get("delta", ""))
                for e in events
                if e["type"] in ("response.output_audio.delta", "response.output_audio_transcript.delta")
            ]

    return list(await asyncio.gather(*(one(p) for p in pcms)))


def test_sessions_together_get_what_they_get_alone(dserver: DuplexServer) -> None:
    pcms = [speech_pcm(10.0, 0), speech_pcm(10.0, 1), speech_pcm(10.0, 0)[4800:] + bytes(4800)]
    alone = [run(_alone_or_together(dserver, [p]))[0] for p in pcms]
    together = run(_alone_or_together(dserver, pcms))
    assert alone[0] != alone[1]  # the model's output depends on what it hears
    for a, t in zip(alone, together, strict=True):
        assert a == t


def test_ack_truncate_and_cancel_cut_the_history(dserver: DuplexServer) -> None:
    pcm = speech_pcm(10.0)

    async def main() -> dict:
        async with opened(dserver) as c:
            await send_audio(c, pcm[: 120 * FRAME * 2])  # through frame 119
            events = await until_done(c, 3)
            first, second, _ = responses(events)
            item1 = first[1]["item"]["id"]
            item2 = second[1]["item"]["id"]
            resp2 = second[0]["response"]["id"]
            await c.send(
                {
                    "type": "conversation.item.truncate",
                    "item_id": item1,
                    "content_index": 0,
                    "audio_end_ms": 800,
                }
            )
            truncated = await c.recv()
            await c.send({"type": "playback.ack", "response_id": resp2, "item_id": item2, "played_ms": 400})
            acked = await c.recv()
            await c.send({"type": "conversation.item.retrieve", "item_id": item1})
            got1 = await c.recv()
            await c.send({"type": "conversation.item.retrieve", "item_id": item2})
            got2 = await c.recv()
            return {"truncated": truncated, "acked": acked, "got1": got1, "got2": got2}

    out = run(main())
    assert (
        out["truncated"]["type"] == "conversation.item.truncated" and out["truncated"]["audio_end_ms"] == 800
    )
    assert out["acked"]["type"] == "playback.acknowledged"
    part1 = out["got1"]["item"]["content"][0]
    assert len(part1["transcript"]) == 10  # 800 ms = 10 frames, a letter each
    part2 = out["got2"]["item"]["content"][0]
    assert len(part2["transcript"]) == 5


def test_cancel_ends_the_stretch_and_the_model_keeps_listening(dserver: DuplexServer) -> None:
    pcm = speech_pcm(10.0)

    async def main() -> tuple[list[dict], dict, dict]:
        async with opened(dserver) as c:
            await send_audio(c, pcm[: 10 * FRAME * 2])  # stretch 1 opens, input stops at frame 9
            await c.until("response.content_part.added")
            await asyncio.sleep(0.3)
            rid = c.events[-4]["response"]["id"]
            item = c.events[-3]["item"]["id"]
            await c.send({"type": "playback.ack", "response_id": rid, "item_id": item, "played_ms": 240})
            await c.until("playback.acknowledged")
            await c.send({"type": "response.cancel"})
            done = (await c.until("response.done"))[-1]
            mark = len(c.events)
            await send_audio(c, pcm[10 * FRAME * 2 : 70 * FRAME * 2])  # the rest of stretch 1, stretch 2
            await until_done(c, 1)
            await c.send({"type": "conversation.item.retrieve", "item_id": item})
            got = await c.recv()
            return c.events[mark:], done, got

    after, done, got = run(main())
    assert done["response"]["status"] == "cancelled"
    assert done["response"]["status_details"]["reason"] == "client_cancelled"
    assert len(got["item"]["content"][0]["transcript"]) == 3  # cut at the ack: 240 ms, 3 frames
    (stretch,) = responses(after)  # the cancelled stretch's rest was not sent; stretch 2 was
    assert len(audio_bytes(stretch)) == STRETCH_FRAMES * FRAME * 2


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


def test_a_stalled_reader_is_dropped_without_delaying_the_others() -> None:
    with duplex_running(max_held_seconds=1.0, hold_send_queue_bytes=32 * 1024) as d:
        service = d.server.service
        pcm = speech_pcm(10.0)

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
                await send_audio(c, pcm)
                return await until_done(c, 3, timeout=30)

        async def main():  # type: ignore[no-untyped-def]
            return await asyncio.gather(stalled(), good())

        code, events = run(main())
        assert code == 1008 and service.clients_held >= 1
        stretches = responses(events)
        assert [len(audio_bytes(r)) for r in stretches] == [STRETCH_FRAMES * FRAME * 2] * 3
        assert all(r[-1]["response"]["status"] == "completed" for r in stretches)


def test_models_and_metrics_show_the_duplex_model(dserver: DuplexServer) -> None:
    import httpx

    base = dserver.server.base_url
    models = httpx.get(base + "/v1/models").json()
    assert "fake-duplex" in [m["id"] for m in models["data"]]
    metrics = httpx.get(base + "/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith('omnirt_pipeline_steps_total{kind="duplex"}'))
    assert float(line.split()[-1]) == dserver.server.engine.stats.steps_by_kind["duplex"]
