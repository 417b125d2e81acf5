"""pipecat (``pipecat-ai[openai]``, ``OpenAIRealtimeLLMService``) against ``omnirt serve``.

The pipeline of pipecat's realtime example, ``[input, user aggregator, llm, output, assistant
aggregator]``, without a network transport: the test queues ``InputAudioRawFrame``s at the
pipeline's source at the pace a microphone transport would push them, and an observer records
every frame any processor pushes (where a transport or an RTVI client would see them). Only
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

from tests.frameworks.conftest import API_KEY, BARGE_IN, RATE, need, speech, stream, until
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
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor  # noqa: E402
from pipecat.workers.runner import WorkerRunner  # noqa: E402

pytestmark = pytest.mark.timeout(150)


class Recorder(BaseObserver):
    """Every frame pushed between processors, once, with who pushed it."""

    def __init__(self) -> None:
        super().__init__()
        self.pushed: list[tuple[str, Any, FrameDirection]] = []

    async def on_push_frame(self, data: FramePushed) -> None:
        self.pushed.append((data.source.name, data.frame, data.direction))


class Output(FrameProcessor):
    """Where the output transport sits: passes everything on."""

    async def process_frame(self, frame: Any, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        await self.push_frame(frame, direction)


@dataclass
class Bot:
    task: Any
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
        await self.task.queue_frame(frames.InputAudioRawFrame(audio=chunk, sample_rate=RATE, num_channels=1))


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
    pipeline = Pipeline([aggregators.user(), llm, Output(), aggregators.assistant()])
    task = PipelineWorker(
        pipeline,
        params=PipelineParams(audio_in_sample_rate=RATE),
        observers=[recorder],
        idle_timeout_secs=None,
    )
    bot = Bot(task, llm, context, None, recorder)  # type: ignore[arg-type]

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
            await until(
                lambda: bot.frames(frames.TTSStoppedFrame), 60, "the end of the reply (TTSStoppedFrame)", conn
            )
            # The user's words land in pipecat's context (written once the reply has started, or at
            # its end when the transcript comes later).
            await until(
                lambda: any(
                    m.get("role") == "user" and transcript in str(m.get("content"))
                    for m in bot.context.get_messages()
                ),
                20,
                "the transcript in the context",
                conn,
            )
            audio = sum(len(f.audio) for f in bot.frames(frames.TTSAudioRawFrame))
            assert audio > RATE * 2 * 0.2
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
            await until(
                lambda: any(
                    e["item"]["type"] == "function_call_output"
                    for e in conn.client("conversation.item.create")
                ),
                20,
                "the function_call_output",
                conn,
            )
            await until(
                lambda: len(conn.server("response.done")) >= 2,
                60,
                "a second response.done after the tool output",
                conn,
            )
            first, second = conn.server("response.done")[:2]
            assert first["response"]["status"] == "completed", first
            assert second["response"]["output"], second
            assert second["response"]["usage"]["input_tokens"] > first["response"]["usage"]["input_tokens"]
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
            done = await until(lambda: conn.server("response.done"), 30, "response.done", conn)
            first = done[0]["response"]
            assert first["status"] == "cancelled", first
            assert first["status_details"]["reason"] == "turn_detected", first
            # pipecat truncates the reply to what it played; the server accepts it.
            await until(
                lambda: conn.client("conversation.item.truncate"), 10, "conversation.item.truncate", conn
            )
            await until(
                lambda: conn.server("conversation.item.truncated") or conn.errors(),
                10,
                "conversation.item.truncated",
                conn,
            )
            assert not conn.errors(), conn.summary()
            await until(
                lambda: len(conn.server("response.created")) >= 2,
                60,
                "the reply to the interrupting turn",
                conn,
            )

    asyncio.run(main())
