"""One server, every kind of session at once: a native duplex session (the embedded demo Moshi),
a turn-based voice session and a chat completion (the embedded demo Qwen3-Omni), each on the real
path (the real engine and app on loopback, real clients), all three running at the same time."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from omnirt.realtime.app import create_app
from omnirt.realtime.config import ServerConfig
from omnirt.stages.engine import Engine, EngineClient
from omnirt.stages.factory import build_pipeline

from tests.duplex.helpers import pipeline as duplex_pipeline
from tests.e2e.test_demo_server import MODEL, DemoServer, _audio_turn, _connect, _manual_turns
from tests.realtime.conftest import Client, SdkClient, Server, connect
from tests.realtime.test_duplex import DuplexServer, completed, drain, send_audio, speech_pcm
from tests.server import serve

FRAME_BYTES = 1920 * 2


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DemoServer, DuplexServer]]:
    mp = pytest.MonkeyPatch()
    mp.setenv("OMNIRT_CACHE", str(tmp_path_factory.mktemp("cache")))
    speech = build_pipeline(None, device="cpu", max_slots=4)
    duplex = duplex_pipeline(slots=4, period=0.02)
    engine = Engine([speech, duplex])
    config = ServerConfig(max_output_tokens=64, vad_preload=False, duplex_max_ahead_ms=12_000)
    app = create_app(EngineClient(engine), config)
    try:
        with serve(app) as base_url:
            server = Server(base_url, engine, speech, app.state.realtime, config)  # type: ignore[arg-type]
            yield DemoServer(base_url, engine), DuplexServer(server, duplex)
    finally:
        mp.undo()


def test_duplex_turns_and_chat_at_once(both: tuple[DemoServer, DuplexServer]) -> None:
    demo, dserver = both
    pcm = speech_pcm(4.0)
    target = dserver.stepped() + len(pcm) // FRAME_BYTES

    async def duplex_session() -> list[dict]:
        async with connect(dserver.server, query="&duplex=1") as client:
            assert isinstance(client, Client)
            await send_audio(client, pcm)
            return await drain(client, lambda: dserver.stepped() >= target, timeout=90)

    async def voice_turn() -> dict:
        async with await _connect(demo) as conn:
            client = SdkClient(conn)
            await client.recv()
            await _manual_turns(client)
            events, _ = await _audio_turn(client, ms=500, max_tokens=12)
            return events[-1]["response"]

    async def chat() -> str | None:
        done = await demo.sdk().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0
        )
        return done.choices[0].finish_reason

    async def main() -> tuple[list[dict], dict, str | None]:
        return await asyncio.gather(duplex_session(), voice_turn(), chat())

    steps_before = dict(demo.engine.stats.steps_by_kind)
    events, response, finish = asyncio.run(main())
    assert dserver.stepped() >= target  # every 80 ms of the duplex input got its model frame
    assert completed(events), "no stretch of duplex speech completed"
    assert response["status"] == "incomplete" and response["output"]  # the turn's reply, cut at 12 tokens
    assert finish == "length"
    steps = demo.engine.stats.steps_by_kind
    assert steps["duplex"] > steps_before["duplex"] and steps["speech"] > steps_before["speech"]
