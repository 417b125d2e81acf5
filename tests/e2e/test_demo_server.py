"""End to end on the embedded default: the real server on loopback, the real Qwen3-Omni pipeline
(thinker -> talker -> code2wav, random weights) in the real engine, the official SDK as client,
and every realtime frame validated strictly with the SDK's own models."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import inspect
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import openai
import pytest
from omnirt.codecs.audio import b64encode, float_to_pcm16
from omnirt.realtime.app import create_app
from omnirt.realtime.config import ServerConfig
from omnirt.stages.engine import Engine, EngineClient
from omnirt.stages.factory import build_pipeline
from openai import AsyncOpenAI

from tests.realtime.conftest import AUDIO_RESPONSE_TAIL, SdkClient
from tests.server import serve

MODEL = "demo-qwen3-omni"


@dataclass
class DemoServer:
    """The embedded speech pipeline in the real engine and app, on loopback (what
    ``tests.realtime.conftest.connect`` and the SDK need of a server)."""

    base_url: str
    engine: Engine

    @property
    def ws_url(self) -> str:
        return self.base_url.replace("http://", "ws://") + "/v1/realtime?model=" + MODEL

    def sdk(self) -> AsyncOpenAI:
        ws = self.base_url.replace("http://", "ws://") + "/v1"
        return AsyncOpenAI(api_key="k", base_url=self.base_url + "/v1", websocket_base_url=ws, max_retries=0)


@contextlib.contextmanager
def running_demo(
    tmp_path_factory: pytest.TempPathFactory,
    *,
    max_output_tokens: int,
    max_slots: int = 4,
    max_context: int | None = None,
) -> Iterator[DemoServer]:
    mp = pytest.MonkeyPatch()
    mp.setenv("OMNIRT_CACHE", str(tmp_path_factory.mktemp("cache")))
    pipeline = build_pipeline(None, device="cpu", max_slots=max_slots, max_context=max_context)
    engine = Engine(pipeline)
    app = create_app(EngineClient(engine), ServerConfig(max_output_tokens=max_output_tokens))
    try:
        with serve(app) as base_url:
            yield DemoServer(base_url, engine)
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoServer]:
    with running_demo(tmp_path_factory, max_output_tokens=64) as server:
        yield server


def speechlike(ms: int) -> bytes:
    t = np.arange(24 * ms) / 24_000
    env = 0.5 + 0.5 * np.sin(2 * np.pi * 3 * t)
    pcm = 0.3 * env * np.sin(2 * np.pi * (180 + 40 * np.sin(2 * np.pi * 2 * t)) * t)
    return float_to_pcm16(pcm)


async def _connect(server: DemoServer):
    realtime = server.sdk().realtime
    options = {"max_retries": 0} if "max_retries" in inspect.signature(realtime.connect).parameters else {}
    return realtime.connect(model=MODEL, **options)


async def _manual_turns(client: SdkClient, **session: object) -> dict:
    """Turn the default server VAD off (this client commits its turns), with other settings."""
    audio: dict = {"input": {"turn_detection": None}, **session.pop("audio", {})}  # type: ignore[dict-item]
    update = {"type": "realtime", "audio": audio, **session}
    await client.conn.send({"type": "session.update", "session": update})
    updated = await client.recv()
    assert updated["type"] == "session.updated", updated
    return updated["session"]


async def _audio_turn(client: SdkClient, ms: int = 1000, max_tokens: int = 6) -> tuple[list[dict], float]:
    audio = speechlike(ms)
    for i in range(0, len(audio), 4800):  # 100 ms appends, as a live client sends them
        await client.conn.send({"type": "input_audio_buffer.append", "audio": b64encode(audio[i : i + 4800])})
    t0 = time.perf_counter()
    await client.conn.send({"type": "input_audio_buffer.commit"})
    await client.conn.send({"type": "response.create", "response": {"max_output_tokens": max_tokens}})
    events: list[dict] = []
    first_audio = None
    while True:
        event = await client.recv(timeout=60)
        events.append(event)
        if event["type"] == "response.output_audio.delta" and first_audio is None:
            first_audio = time.perf_counter() - t0
        if event["type"] == "response.done":
            break
    assert first_audio is not None, [e["type"] for e in events]
    return events, first_audio


def test_models_say_the_weights_are_random(demo: DemoServer) -> None:
    async def main() -> None:
        models = await demo.sdk().models.list()
        card = models.data[0].model_dump()
        assert card["id"] == MODEL and card["random_weights"] is True

    asyncio.run(main())


def test_audio_turns_stream_speech_and_carry_history(demo: DemoServer) -> None:
    async def main() -> None:
        async with await _connect(demo) as conn:
            client = SdkClient(conn)
            assert (await client.recv())["type"] == "session.created"
            # OpenAI's voice name: an alias of one of the model's voices, so the real pipeline speaks.
            instructions = "You are a helpful voice assistant. Answer briefly and kindly. " * 6
            voice = {"output": {"voice": "marin"}}
            session = await _manual_turns(client, audio=voice, instructions=instructions)
            assert session["audio"]["output"]["voice"] == "marin"
            events, first_audio = await _audio_turn(client)
            kinds = [e["type"] for e in events]
            assert kinds[:3] == [
                "input_audio_buffer.committed",
                "conversation.item.added",
                "conversation.item.done",
            ]
            assert kinds[3:7] == [
                "response.created",
                "response.output_item.added",
                "conversation.item.added",
                "response.content_part.added",
            ]
            assert kinds[-6:] == AUDIO_RESPONSE_TAIL
            done = events[-1]["response"]
            assert done["audio"]["output"]["voice"] == "marin"
            # Random weights never stop on their own: the turn ends on its token budget.
            assert done["status"] == "incomplete"
            assert done["status_details"]["reason"] == "max_output_tokens"
            usage = done["usage"]
            assert usage["output_token_details"]["text_tokens"] == 6
            assert usage["output_token_details"]["audio_tokens"] > 0
            assert usage["input_token_details"]["audio_tokens"] > 0
            pcm = b"".join(
                base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta"
            )
            assert len(pcm) > 24_000 * 2 * 0.2 and len(pcm) % 2 == 0
            assert np.abs(np.frombuffer(pcm, "<i2")).max() > 0
            transcript = "".join(
                e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta"
            )
            assert transcript == done["output"][0]["content"][0]["transcript"]
            assert first_audio < 10.0

            # The second turn's prompt holds the first turn (user audio + the reply's transcript).
            events2, _ = await _audio_turn(client)
            usage2 = events2[-1]["response"]["usage"]
            assert (
                usage2["input_tokens"] > usage["input_tokens"] + usage["output_token_details"]["text_tokens"]
            )
            # ... which is not read again: the first turn's prompt (instructions, its audio) is reused.
            cached = usage2["input_token_details"]
            assert usage["input_token_details"]["cached_tokens"] < usage["input_tokens"]
            assert usage["input_tokens"] <= cached["cached_tokens"] < usage2["input_tokens"]
            audio = usage["input_token_details"]["audio_tokens"]
            assert cached["cached_tokens_details"]["audio_tokens"] == audio

    asyncio.run(main())


def test_text_turn_and_cancel_mid_stream(demo: DemoServer) -> None:
    async def main() -> None:
        async with await _connect(demo) as conn:
            client = SdkClient(conn)
            await client.recv()
            await conn.send(
                {
                    "type": "conversation.item.create",
                    "item": {
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_text", "text": "Hi!"}],
                    },
                }
            )
            await conn.send(
                {
                    "type": "response.create",
                    "response": {"output_modalities": ["text"], "max_output_tokens": 5},
                }
            )
            events = await client.until("response.done", timeout=60)
            kinds = {e["type"] for e in events}
            assert "response.output_text.delta" in kinds and "response.output_audio.delta" not in kinds
            assert events[-1]["response"]["usage"]["output_token_details"]["text_tokens"] == 5

            await conn.send({"type": "response.create", "response": {"max_output_tokens": 40}})
            await client.until("response.output_audio.delta", timeout=60)
            await conn.send({"type": "response.cancel"})
            events = await client.until("response.done", timeout=30)
            done = events[-1]["response"]
            assert done["status"] == "cancelled" and done["status_details"]["reason"] == "client_cancelled"
            # Nothing of the cancelled response follows its response.done.
            with pytest.raises(asyncio.TimeoutError):
                await client.recv(timeout=0.5)

    asyncio.run(main())


def test_chat_completions_share_the_engine_with_a_live_session(demo: DemoServer) -> None:
    stats = demo.engine.stats
    before = sum(n for rows, n in stats.rows("speech", "thinker").items() if rows >= 2)

    async def voice() -> dict:
        async with await _connect(demo) as conn:
            client = SdkClient(conn)
            await client.recv()
            await _manual_turns(client)
            events, _ = await _audio_turn(client, ms=500, max_tokens=24)
            return events[-1]["response"]

    async def chat() -> tuple[str, str]:
        sdk = demo.sdk()
        plain = await sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0
        )
        stream = await sdk.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hello again"}],
            max_tokens=8,
            temperature=0,  # OpenAI's default is 1.0: sampling could draw the end token early
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
        return plain.choices[0].finish_reason, "".join(
            c.choices[0].delta.content or "" for c in chunks if c.choices
        )

    async def main() -> None:
        response, (finish, streamed) = await asyncio.gather(voice(), chat())
        assert response["status"] == "incomplete"
        assert finish == "length" and streamed

    asyncio.run(main())
    after = sum(n for rows, n in stats.rows("speech", "thinker").items() if rows >= 2)
    assert after > before, "chat and the voice turn never shared a thinker decode call"


def test_a_huge_prompt_is_refused_before_tokenising(demo: DemoServer) -> None:
    """The speech pipeline's own guard (what the HTTP and realtime checks stand in front of): a
    6 MiB prompt is refused at once, not tokenised; through the server it is a 400."""
    from omnirt.stages.pipeline import RequestRejected
    from omnirt.stages.types import ContextMessage, GenerationRequest, TextPart

    pipeline = demo.engine.pipelines["speech"]
    huge = "word " * (6 * 1024 * 1024 // 5)
    request = GenerationRequest("r", [ContextMessage("user", (TextPart(huge),))], output_audio=False)
    t0 = time.perf_counter()
    with pytest.raises(RequestRejected, match="maximum context length"):
        pipeline.prepare(request)
    assert time.perf_counter() - t0 < 0.5

    async def main() -> None:
        sdk = demo.sdk()
        t0 = time.perf_counter()
        with pytest.raises(openai.BadRequestError) as info:
            await sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": huge}])
        assert info.value.code == "context_length_exceeded"
        assert time.perf_counter() - t0 < 1.0
        ok = await sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=4, temperature=0
        )
        assert ok.choices[0].finish_reason == "length"

    asyncio.run(main())
