"""The real speech pipeline inside the engine thread, through the asyncio client; its scheduling
surface (prepare / add, deadline, step cost, model-call counts)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from omnirt.stages.engine import Engine, EngineClient
from omnirt.stages.pipeline import Priority, RequestRejected
from omnirt.stages.speech.loader import load_speech_pipeline
from omnirt.stages.types import AudioDelta, Finished, Started, TextDelta

from .conftest import audio_request, drain, text_request


def test_engine_serves_batched_turns_and_cancels(demo_dir: Path) -> None:
    pipe = load_speech_pipeline(demo_dir, max_slots=2, max_audio_frames=20)
    engine = Engine(pipe)
    engine.start()

    async def collect(stream, cancel_after: int | None = None):
        outs = []
        async for out in stream:
            outs.append(out)
            if cancel_after is not None and len(outs) == cancel_after:
                stream.cancel()
        return outs

    async def main():
        client = EngineClient(engine)
        streams = [
            client.submit(audio_request("a", max_output_tokens=8)),
            client.submit(text_request("t", max_output_tokens=12)),
            client.submit(audio_request("c", max_output_tokens=200)),  # waits for a slot
        ]
        return await asyncio.gather(collect(streams[0]), collect(streams[1]), collect(streams[2], 4))

    try:
        a, t, c = asyncio.run(main())
        deadline = time.monotonic() + 10
        while pipe.has_work() and time.monotonic() < deadline:  # the engine drops "c" at its next step
            time.sleep(0.01)
    finally:
        engine.stop()
    assert isinstance(a[0], Started) and a[-1].reason == "length"
    assert any(isinstance(o, AudioDelta) for o in a) and any(isinstance(o, TextDelta) for o in a)
    assert t[-1].reason == "length" and t[-1].usage.output_text_tokens == 12
    assert not any(isinstance(o, AudioDelta) for o in t)
    assert isinstance(c[-1], Finished) and c[-1].reason == "cancelled" and len(c) == 5
    # "a" and "t" decoded in shared thinker calls; "c" waited for a slot, so never three rows.
    thinker = engine.stats.rows("speech", "thinker")
    assert max(thinker) == 2 and thinker[2] >= 3
    assert engine.stats.rows("speech", "thinker_prefill") == {1: 3}
    assert pipe.can_add() and not pipe.has_work()


def test_prepare_builds_the_prompt_and_add_takes_the_slot(demo_dir: Path) -> None:
    pipe = load_speech_pipeline(demo_dir, max_slots=1, max_audio_frames=4)
    assert pipe.kind == "speech" and pipe.priority is Priority.REALTIME
    assert pipe.accepts(text_request("t")) and not pipe.accepts("t")
    with pytest.raises(RequestRejected, match="unknown voice"):
        pipe.prepare(audio_request("a", voice="nobody"))
    prepared = pipe.prepare(text_request("t", max_output_tokens=3))
    assert prepared.max_tokens == 3 and prepared.speaker_id == -1
    assert prepared.prompt.text_tokens == prepared.prompt.length > 0
    assert pipe.can_add() and not pipe.has_work()  # prompt work holds no slot
    pipe.add(text_request("t", max_output_tokens=3), prepared)
    assert not pipe.can_add() and pipe.next_deadline() is None and pipe.step_cost() == 0.0
    outs = drain(pipe)
    assert outs[-1] == ("t", Finished("length", outs[-1][1].usage))
    assert pipe.step_cost() > 0
    assert pipe.calls["thinker_prefill", 1] == 1 and pipe.calls["thinker", 1] == 2  # tokens 2 and 3
