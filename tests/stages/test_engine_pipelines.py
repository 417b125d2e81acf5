"""The engine with several pipelines (real threads): routing, failure isolation, per-pipeline
queues, prompt work on its own threads, cancel during prompt work, shutdown."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest
from omnirt.stages.engine import Engine, EngineClient
from omnirt.stages.types import (
    ContextMessage,
    Finished,
    GenerationRequest,
    Output,
    Started,
    TextDelta,
    TextPart,
    Usage,
)

from tests.fakes import EchoPipeline

from .pipelines import FrameRequest, JobPipeline, JobRequest, RealClock


def _talk(rid: str, text: str = "hello there") -> GenerationRequest:
    return GenerationRequest(rid, [ContextMessage("user", (TextPart(text),))])


async def _collect(stream) -> list:  # type: ignore[no-untyped-def]
    return [out async for out in stream]


def _text(outs: list[Output]) -> str:
    return "".join(o.text for o in outs if isinstance(o, TextDelta))


class _Sink:
    """A plain engine sink: records outputs and the thread each came from."""

    def __init__(self) -> None:
        self.outputs: list[Output] = []
        self.done = threading.Event()

    def __call__(self, output: Output) -> None:
        self.outputs.append(output)
        if isinstance(output, Finished):
            self.done.set()


class _GatedEcho(EchoPipeline):
    """Echo whose prompt work for a text starting with "slow" blocks until ``gate`` is set."""

    def __init__(self, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(**kwargs)
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.prepare_threads: list[str] = []
        self.added: list[str] = []

    def prepare(self, request: GenerationRequest):  # type: ignore[no-untyped-def]
        self.prepare_threads.append(threading.current_thread().name)
        text = request.messages[-1].parts[-1].text  # type: ignore[union-attr]
        if text.startswith("slow"):
            self.entered.set()
            assert self.gate.wait(10)
        return super().prepare(request)

    def add(self, request: GenerationRequest, prepared) -> None:  # type: ignore[no-untyped-def]
        self.added.append(request.request_id)
        super().add(request, prepared)


@pytest.fixture
def make_engine() -> Iterator:
    engines: list[Engine] = []

    def make(*pipelines, **kwargs) -> Engine:  # type: ignore[no-untyped-def]
        engine = Engine(list(pipelines), **kwargs)
        engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.stop()


def test_requests_reach_the_pipeline_of_their_type(make_engine) -> None:  # type: ignore[no-untyped-def]
    echo, jobs = EchoPipeline(), JobPipeline(RealClock(), cost=0.001)
    engine = make_engine(echo, jobs)

    async def main():  # type: ignore[no-untyped-def]
        client = EngineClient(engine)
        return await asyncio.gather(
            _collect(client.submit(_talk("talk"))),
            _collect(client.submit(JobRequest("job", steps=2))),
            _collect(client.submit(FrameRequest("frame"))),  # no duplex pipeline here
        )

    talk, job, frame = asyncio.run(main())
    assert _text(talk) == "You said: hello there."
    assert [o.text for o in job if isinstance(o, TextDelta)] == ["diffusion 1", "diffusion 2"]
    assert job[-1] == Finished("stop", Usage(output_text_tokens=2))
    assert frame == [Finished("error", Usage(), "no loaded model serves FrameRequest requests", "rejected")]
    assert jobs.added == ["job"] and list(echo.calls) and engine.stats.rows("diffusion", "diffusion")[1] == 2
    assert engine.info is echo.info and EngineClient(engine).infos == (echo.info, jobs.info)


def test_a_failing_step_of_one_pipeline_fails_only_its_requests(make_engine) -> None:  # type: ignore[no-untyped-def]
    echo, jobs = EchoPipeline(step_seconds=0.005), JobPipeline(RealClock(), cost=0.005)
    jobs.explode = True
    engine = make_engine(echo, jobs)
    words = " ".join(f"w{i}" for i in range(30))

    async def main():  # type: ignore[no-untyped-def]
        client = EngineClient(engine)
        talk = client.submit(_talk("talk", words))
        first = await anext(aiter(talk))  # streaming before and after the other pipeline fails
        job = await _collect(client.submit(JobRequest("job", steps=5)))
        return [first, *await _collect(talk)], job

    talk, job = asyncio.run(main())
    assert job == [Finished("error", Usage(), "internal error: diffusion boom", "internal")]
    assert jobs.removed == ["job"]
    assert isinstance(talk[0], Started) and talk[-1].reason == "stop"
    assert _text(talk) == f"You said: {words}."
    assert engine.stats.requests_failed == 1 and engine.stats.requests_finished == 1
    assert engine._thread is not None and engine._thread.is_alive()


def test_a_full_pipeline_does_not_hold_up_admission_to_another(make_engine) -> None:  # type: ignore[no-untyped-def]
    echo, jobs = EchoPipeline(), JobPipeline(RealClock(), cost=0.02, slots=1)
    engine = make_engine(echo, jobs, max_waiting=1)

    async def main():  # type: ignore[no-untyped-def]
        client = EngineClient(engine)
        running = client.submit(JobRequest("j1", steps=100))
        assert isinstance(await anext(aiter(running)), TextDelta)  # j1 holds the only slot
        queued = client.submit(JobRequest("j2", steps=1))
        while engine.stats.waiting != 1:
            await asyncio.sleep(0.005)
        refused = await _collect(client.submit(JobRequest("j3", steps=1)))
        talk = await _collect(client.submit(_talk("talk")))
        state = jobs.has_work(), list(jobs.added)
        running.cancel()
        return refused, talk, state, await _collect(queued)

    refused, talk, (busy, added), queued = asyncio.run(main())
    assert refused == [Finished("error", Usage(), "the diffusion queue is full", "overloaded")]
    assert talk[-1].reason == "stop" and _text(talk) == "You said: hello there."
    assert busy and added == ["j1"]  # the talk ran while j1 ran and j2 waited
    assert queued[-1] == Finished("stop", Usage(output_text_tokens=1))


def test_prompt_work_runs_off_the_engine_thread_and_a_slow_one_delays_nobody(make_engine) -> None:  # type: ignore[no-untyped-def]
    echo = _GatedEcho(step_seconds=0.002)
    engine = make_engine(echo)
    slow, fast = _Sink(), _Sink()
    engine.submit(_talk("slow", "slow one"), slow)
    assert echo.entered.wait(5)
    t0 = time.monotonic()
    engine.submit(_talk("fast", "quick"), fast)
    assert fast.done.wait(5)
    took = time.monotonic() - t0
    assert not slow.outputs and echo.added == ["fast"]  # still in its prompt work
    echo.gate.set()
    assert slow.done.wait(5)
    assert slow.outputs[-1].reason == "stop" and fast.outputs[-1].reason == "stop"  # type: ignore[union-attr]
    assert took < 1.0  # 4 steps of 2 ms; the slow prompt work would hold it up 10 s
    assert len(echo.prepare_threads) == 2
    assert all(name.startswith("omnirt-prepare") for name in echo.prepare_threads)


def test_cancel_during_prompt_work_cancels(make_engine) -> None:  # type: ignore[no-untyped-def]
    echo = _GatedEcho(step_seconds=0.002)
    engine = make_engine(echo)
    sink = _Sink()
    engine.submit(_talk("r", "slow down"), sink)
    assert echo.entered.wait(5)
    engine.cancel("r")
    assert sink.outputs == [Finished("cancelled", Usage())]
    echo.gate.set()  # its prompt work ends now; nothing of it may follow the Finished
    after = _Sink()
    engine.submit(_talk("next"), after)
    assert after.done.wait(5)
    assert sink.outputs == [Finished("cancelled", Usage())]
    assert echo.added == ["next"]
    assert engine.stats.requests_cancelled == 1 and engine.stats.requests_finished == 1


def test_cancel_through_the_stream_during_prompt_work(make_engine) -> None:  # type: ignore[no-untyped-def]
    echo = _GatedEcho()
    engine = make_engine(echo)

    async def main():  # type: ignore[no-untyped-def]
        stream = EngineClient(engine).submit(_talk("r", "slow"))
        await asyncio.to_thread(echo.entered.wait, 5)
        stream.cancel()
        echo.gate.set()
        outs = await _collect(stream)
        await asyncio.sleep(0.1)
        return outs

    assert asyncio.run(main()) == [Finished("cancelled", Usage())]
    assert not echo.added and not echo.active


def test_rejected_prompt_never_reaches_the_engine_thread(make_engine) -> None:  # type: ignore[no-untyped-def]
    echo = _GatedEcho()
    engine = make_engine(echo)
    sink = _Sink()
    engine.submit(_talk("bad", "reject me"), sink)
    assert sink.done.wait(5)
    assert sink.outputs == [Finished("error", Usage(), "the echo pipeline rejects this input", "rejected")]
    assert not echo.added and engine.stats.requests_failed == 1 and engine.stats.requests_submitted == 1


def test_stop_fails_preparing_waiting_and_active_requests_with_shutdown() -> None:
    echo = _GatedEcho(slots=1, step_seconds=0.005)
    engine = Engine(echo)
    engine.start()
    active, waiting, preparing = _Sink(), _Sink(), _Sink()
    engine.submit(_talk("active", " ".join(["w"] * 100_000)), active)  # never ends on its own here
    deadline = time.monotonic() + 5
    while not active.outputs and time.monotonic() < deadline:  # admitted first: it holds the slot
        time.sleep(0.005)
    engine.submit(_talk("waiting"), waiting)
    engine.submit(_talk("preparing", "slow"), preparing)
    assert echo.entered.wait(5)
    while engine.stats.waiting != 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    engine.stop()
    echo.gate.set()
    shutdown = Finished("error", Usage(), "server shutting down", "shutdown")
    assert active.outputs[-1] == shutdown and isinstance(active.outputs[0], Started)
    assert waiting.outputs == [shutdown] and preparing.outputs == [shutdown]
    assert not echo.active  # removed from the pipeline, slot freed
    assert engine.stats.requests_failed == 3
