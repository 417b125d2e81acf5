"""The engine thread and its client, driven with the deterministic echo pipeline."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from omnirt.stages.engine import Engine, EngineClient
from omnirt.stages.types import (
    AudioDelta,
    ContextMessage,
    Finished,
    GenerationRequest,
    Started,
    TextDelta,
    TextPart,
)

from tests.fakes import EchoPipeline


def _request(rid: str, text: str = "hello there", **kw) -> GenerationRequest:
    return GenerationRequest(rid, [ContextMessage("user", (TextPart(text),))], **kw)


async def _collect(stream) -> list:
    return [out async for out in stream]


@pytest.fixture
def engine():
    eng = Engine(EchoPipeline(slots=2, step_seconds=0.002))
    eng.start()
    yield eng
    eng.stop()


def test_stream_yields_started_text_audio_then_finished(engine: Engine) -> None:
    async def main():
        client = EngineClient(engine)
        outs = await _collect(client.submit(_request("r1")))
        assert isinstance(outs[0], Started)
        assert isinstance(outs[-1], Finished) and outs[-1].reason == "stop"
        text = "".join(o.text for o in outs if isinstance(o, TextDelta))
        assert text == "You said: hello there."
        audio = [o for o in outs if isinstance(o, AudioDelta)]
        assert len(audio) == 4 and all(a.pcm.dtype == np.int16 for a in audio)
        assert outs[-1].usage.output_text_tokens == 4

    asyncio.run(main())


def test_requests_are_batched_into_shared_steps() -> None:
    engine = Engine(EchoPipeline(slots=2, step_seconds=0.002))

    async def main():
        client = EngineClient(engine)
        # Both wait in the queue before the engine thread runs (on a loaded machine the thread
        # could otherwise step the first alone before the second is submitted).
        streams = [client.submit(_request(f"r{i}")) for i in range(2)]
        engine.start()
        results = await asyncio.gather(*(_collect(s) for s in streams))
        for outs in results:
            assert outs[-1].reason == "stop"
        # Two requests of 4 words each: shared steps, so far fewer than 2 * 5 steps with batch 1.
        assert engine.stats.rows("speech", "echo")[2] >= 3

    try:
        asyncio.run(main())
    finally:
        engine.stop()


def test_more_requests_than_slots_wait_for_a_free_slot(engine: Engine) -> None:
    async def main():
        client = EngineClient(engine)
        streams = [client.submit(_request(f"r{i}")) for i in range(5)]
        results = await asyncio.gather(*(_collect(s) for s in streams))
        assert [r[-1].reason for r in results] == ["stop"] * 5
        assert max(engine.stats.rows("speech", "echo")) == 2

    asyncio.run(main())


def test_cancel_ends_the_stream_at_once_and_frees_the_slot(engine: Engine) -> None:
    async def main():
        client = EngineClient(engine)
        stream = client.submit(_request("long", "a b c d e f g h i j k l m n o p q r s t u v w x y z"))
        seen = []
        async for out in stream:
            seen.append(out)
            if isinstance(out, TextDelta):
                stream.cancel()
        assert isinstance(seen[-1], Finished) and seen[-1].reason == "cancelled"
        # Nothing after Finished; its usage counts what was delivered.
        assert seen[-1].usage.output_text_tokens == 1
        for _ in range(100):
            if not engine.pipeline.active:
                break
            await asyncio.sleep(0.01)
        assert not engine.pipeline.active
        assert engine.stats.requests_cancelled == 1

    asyncio.run(main())


def test_rejected_request_finishes_with_error_and_engine_goes_on(engine: Engine) -> None:
    async def main():
        client = EngineClient(engine)
        outs = await _collect(client.submit(_request("bad", "reject me")))
        assert outs == [Finished("error", outs[0].usage, "the echo pipeline rejects this input", "rejected")]
        outs = await _collect(client.submit(_request("good")))
        assert outs[-1].reason == "stop"

    asyncio.run(main())


def test_length_limit_finishes_with_length(engine: Engine) -> None:
    async def main():
        client = EngineClient(engine)
        outs = await _collect(client.submit(_request("r", max_output_tokens=2)))
        assert outs[-1].reason == "length"
        assert "".join(o.text for o in outs if isinstance(o, TextDelta)) == "You said:"

    asyncio.run(main())


class _Exploding(EchoPipeline):
    def step(self):
        raise RuntimeError("boom")


def test_a_failing_step_fails_its_requests_not_the_engine() -> None:
    eng = Engine(_Exploding())
    eng.start()

    async def main():
        client = EngineClient(eng)
        outs = await _collect(client.submit(_request("r")))
        assert outs[-1].reason == "error" and outs[-1].code == "internal" and "boom" in outs[-1].error
        assert eng._thread is not None and eng._thread.is_alive()

    try:
        asyncio.run(main())
    finally:
        eng.stop()
