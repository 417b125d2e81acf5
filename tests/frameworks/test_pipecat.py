"""pipecat (``pipecat-ai[openai]``, ``OpenAIRealtimeLLMService``) against ``omnirt serve``.

The pipeline of pipecat's realtime example, ``[transport.input(), user aggregator, llm,
transport.output(), assistant aggregator]``, with an in-memory transport in place of a network
one, built like pipecat's ``LocalAudioTransport`` on its base input and output transports: the
microphone is the test pushing ``InputAudioRawFrame``s at real-time pace, the speaker plays
output frames at real-time pace (so the bot-speaking frames pipecat relies on come as they do in
a call). An observer records every frame any processor pushes. Only
``base_url`` is set on the service; its session properties are pipecat's defaults (none: the
server's own defaults apply, server VAD included), except input transcription in the spoken-turn
test (off by default in pipecat: ``InputAudioTranscription()`` with pipecat's default model) and
``tool_choice`` in the forced-tool test. pipecat treats every server ``error`` event but two as
fatal and pushes an ``ErrorFrame``: the tests fail on any.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.frameworks.conftest import (
    API_KEY,
    BARGE_IN,
    RATE,
    audible,
    barge_in_handled,
    need,
    reply_after_tool_output,
    speech,
    stream,
    until,
)
from tests.frameworks.relay import Connection, Relay

need("pipecat", "pipecat-ai[openai]")
frames = need("pipecat.frames.frames", "pipecat-ai[openai]")
rt_events = need("pipecat.services.openai.realtime.events", "pipecat-ai[openai]")
rt_llm = need("pipecat.services.openai.realtime.llm", "pipecat-ai[openai]")
from pipecat.adapters.llm.schemas.function_schema import FunctionSchema  # noqa: E402
from pipecat.adapters.llm.schemas.tools_schema import ToolsSchema  # noqa: E402
from pipecat.observers.base_observer import BaseObserver, FramePushed  # noqa: E402
from pipecat.pipeline.pipeline import Pipeline  # noqa: E402
from pipecat.pipeline.worker import PipelineParams, PipelineWorker  # noqa: E402
from pipecat.processors.aggregators.llm_context import LLMContext  # noqa: E402
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair  # noqa: E402
from pipecat.processors.frame_processor import FrameDirection  # noqa: E402
from pipecat.transports.base_input import BaseInputTransport  # noqa: E402
from pipecat.transports.base_output import BaseOutputTransport  # noqa: E402
from pipecat.transports.base_transport import TransportParams  # noqa: E402
from pipecat.workers.runner import WorkerRunner  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]


class Recorder(BaseObserver):
    """Every frame pushed between processors, once, with who pushed it."""

    def __init__(self) -> None:
        super().__init__()
        self.pushed: list[tuple[str, Any, FrameDirection]] = []

    async def on_push_frame(self, data: FramePushed) -> None:
        self.pushed.append((data.source.name, data.frame, data.direction))


class Microphone(BaseInputTransport):
    """The input transport, fed by the test (``push_audio_frame``, as a device callback does)."""

    async def start(self, frame: Any) -> None:
        await super().start(frame)
        await self.set_transport_ready(frame)


class Speaker(BaseOutputTransport):
    """The output transport: "plays" each frame by taking its duration, as a device write does."""

    def __init__(self, params: TransportParams) -> None:
        super().__init__(params)
        self.played: list[bytes] = []

    async def start(self, frame: Any) -> None:
        await super().start(frame)
        await self.set_transport_ready(frame)

    async def write_audio_frame(self, frame: Any) -> bool:
        await asyncio.sleep(len(frame.audio) / 2 / frame.sample_rate)
        self.played.append(frame.audio)
        return True


@dataclass
class Bot:
    task: Any
    microphone: Microphone
    speaker: Speaker
    llm: Any
    context: Any
    conn: Connection
    recorder: Recorder
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def frames(self, kind: type) -> list[Any]:
        seen: set[int] = set()
        out = []
        for _, frame, _ in list(self.recorder.pushed):
            if isinstance(frame, kind) and id(frame) not in seen:
                seen.add(id(frame))
                out.append(frame)
        return out

    def errors(self) -> list[str]:
        return [f.error for f in self.frames(frames.ErrorFrame)]

    async def push_audio(self, chunk: bytes) -> None:
        frame = frames.InputAudioRawFrame(audio=chunk, sample_rate=RATE, num_channels=1)
        await self.microphone.push_audio_frame(frame)


WEATHER = FunctionSchema(
    name="get_weather",
    description="Get the current weather in a city.",
    properties={"city": {"type": "string", "description": "The city's name."}},
    required=["city"],
)


@contextlib.asynccontextmanager
async def pipecat_bot(
    relay: Relay, *, session_properties: Any = None, messages: list[dict[str, Any]] | None = None
) -> AsyncIterator[Bot]:
    settings = None
    if session_properties is not None:
        settings = rt_llm.OpenAIRealtimeLLMService.Settings(session_properties=session_properties)
    llm = rt_llm.OpenAIRealtimeLLMService(
        api_key=API_KEY, base_url=relay.url + "/v1/realtime", settings=settings
    )
    context = LLMContext(messages=messages or [], tools=ToolsSchema(standard_tools=[WEATHER]))
    aggregators = LLMContextAggregatorPair(context)
    recorder = Recorder()
    params = TransportParams(audio_in_enabled=True, audio_out_enabled=True)
    microphone, speaker = Microphone(params), Speaker(params)
    pipeline = Pipeline([microphone, aggregators.user(), llm, speaker, aggregators.assistant()])
    task = PipelineWorker(
        pipeline,
        params=PipelineParams(audio_in_sample_rate=RATE),
        observers=[recorder],
        idle_timeout_secs=None,
    )
    bot = Bot(task, microphone, speaker, llm, context, None, recorder)  # type: ignore[arg-type]

    async def get_weather(params: Any) -> None:
        bot.tool_calls.append(dict(params.arguments))
        await params.result_callback(
            {"city": params.arguments.get("city"), "conditions": "sunny, 21 degrees"}
        )

    llm.register_function("get_weather", get_weather)
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(task)
    running = asyncio.create_task(runner.run())
    try:
        bot.conn = await relay.connection()
        await until(
            lambda: bot.conn.server("session.updated") or bot.errors() or running.done(),
            20,
            "session.updated",
            bot.conn,
        )
        assert not bot.errors(), f"pipecat failed: {bot.errors()}\n{bot.conn.summary()}"
        yield bot
        assert not bot.errors(), f"pipecat failed: {bot.errors()}\n{bot.conn.summary()}"
    finally:
        await runner.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(running, 20)


def transcription_on() -> Any:
    """Input transcription with pipecat's own defaults (the one setting its default lacks)."""
    return rt_events.SessionProperties(
        audio=rt_events.AudioConfiguration(
            input=rt_events.AudioInput(transcription=rt_events.InputAudioTranscription())
        )
    )


def test_spoken_turn_with_server_vad_gets_audio_and_a_user_transcript(relay: Relay) -> None:
    async def main() -> None:
        async with pipecat_bot(relay, session_properties=transcription_on()) as bot:
            conn = bot.conn
            # pipecat leaves turn detection to the server's default.
            updates = conn.client("session.update")
            assert all(
                "turn_detection" not in (u["session"].get("audio") or {}).get("input", {}) for u in updates
            )
            await stream(bot.push_audio, speech())
            await until(
                lambda: bot.frames(frames.TTSAudioRawFrame), 60, "reply audio (TTSAudioRawFrame)", conn
            )
            assert bot.frames(frames.UserStartedSpeakingFrame) and bot.frames(frames.UserStoppedSpeakingFrame)
            assert not conn.client("input_audio_buffer.commit")
            await until(
                lambda: bot.frames(frames.TranscriptionFrame),
                60,
                "the user transcript (TranscriptionFrame)",
                conn,
            )
            transcript = bot.frames(frames.TranscriptionFrame)[0].text
            completed = conn.server("conversation.item.input_audio_transcription.completed")
            assert transcript and transcript == completed[0]["transcript"]
            # The reply reaches the speaker.
            await until(lambda: audible(b"".join(bot.speaker.played)), 20, "reply audio played", conn)
            assert not conn.errors(), conn.summary()

    asyncio.run(main())


def test_forced_tool_call_reaches_the_registered_function_and_the_reply_continues(relay: Relay) -> None:
    # pipecat's SessionProperties.tool_choice is "auto" | "none" | "required": it cannot name a
    # function. "required" with one tool forces that tool.
    properties = rt_events.SessionProperties(tool_choice="required")
    messages = [{"role": "user", "content": "What is the weather like in Paris?"}]

    async def main() -> None:
        async with pipecat_bot(relay, session_properties=properties, messages=messages) as bot:
            conn = bot.conn
            await bot.task.queue_frame(frames.LLMRunFrame())
            await until(lambda: bot.tool_calls, 60, "the get_weather handler to be called", conn)
            call = bot.tool_calls[0]
            assert set(call) == {"city"} and isinstance(call["city"], str), call
            done = conn.server("response.function_call_arguments.done")
            assert done and done[0]["name"] == "get_weather"
            # pipecat sends the result and asks for the next response.
            await until(conn.tool_outputs, 20, "the function_call_output", conn)
            await until(lambda: reply_after_tool_output(conn), 60, "a reply after the tool output", conn)
            first = conn.server("response.done")[0]["response"]
            assert first["status"] == "completed" and first["output"][0]["type"] == "function_call", first
            assert not conn.errors(), conn.summary()

    asyncio.run(main())


def test_barge_in_interrupts_the_reply(relay: Relay) -> None:
    async def main() -> None:
        async with pipecat_bot(relay) as bot:
            conn = bot.conn
            await stream(bot.push_audio, speech())
            await until(
                lambda: bot.frames(frames.TTSAudioRawFrame), 60, "reply audio (TTSAudioRawFrame)", conn
            )
            await stream(bot.push_audio, speech(BARGE_IN, lead_ms=0))
            # pipecat sees the user start speaking over the bot and interrupts the pipeline.
            await until(lambda: bot.frames(frames.InterruptionFrame), 30, "an InterruptionFrame", conn)
            # pipecat truncates the reply to what it played; the user's speech gets a reply.
            await barge_in_handled(conn)

    asyncio.run(main())
