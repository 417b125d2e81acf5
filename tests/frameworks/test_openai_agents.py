"""The OpenAI Agents SDK (``openai-agents``, ``agents.realtime``) against ``omnirt serve``.

The SDK as its README shows it: a ``RealtimeAgent`` with a ``@function_tool``, a
``RealtimeRunner``, ``runner.run()`` and ``session.send_audio`` for microphone audio. Only the
``url`` model option (and the API key it needs) points it at the server; every session setting
is the SDK's default (voice ``ash``, ``semantic_vad`` with ``interrupt_response``,
``gpt-4o-mini-transcribe`` input transcription), except ``tool_choice`` in the forced-tool test.
The SDK validates every server event with the openai SDK's models and reports what fails as an
error event: the tests fail on any.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.frameworks.conftest import (
    API_KEY,
    BARGE_IN,
    audible,
    barge_in_handled,
    need,
    reply_after_tool_output,
    speech,
    stream,
    until,
)
from tests.frameworks.relay import Connection, Relay

agents = need("agents", "openai-agents")
rt = need("agents.realtime", "openai-agents")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]


@dataclass
class Weather:
    """What the tool handler saw."""

    calls: list[dict[str, Any]] = field(default_factory=list)


def make_agent(weather: Weather) -> Any:
    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city.

        Args:
            city: The city's name.
        """
        weather.calls.append({"city": city})
        return f"It is sunny and 21 degrees in {city}."

    return rt.RealtimeAgent(
        name="Assistant",
        instructions="You are a helpful voice assistant. Keep your answers short.",
        tools=[get_weather],
    )


@dataclass
class Run:
    session: Any
    conn: Connection
    events: list[Any]

    def of(self, kind: str) -> list[Any]:
        return [e for e in self.events if e.type == kind]

    def raw(self, kind: str) -> list[dict[str, Any]]:
        """Server events of ``kind`` as the SDK's model layer passed them on."""
        return [
            e.data.data
            for e in self.events
            if e.type == "raw_model_event"
            and e.data.type == "raw_server_event"
            and e.data.data.get("type") == kind
        ]

    def sdk_errors(self) -> list[str]:
        return [repr(e.error) for e in self.of("error")]


@contextlib.asynccontextmanager
async def agent_session(
    relay: Relay, agent: Any, settings: dict[str, Any] | None = None
) -> AsyncIterator[Run]:
    config = {"model_settings": settings} if settings else None
    runner = rt.RealtimeRunner(agent, config=config)
    session = await runner.run(model_config={"url": relay.url + "/v1/realtime", "api_key": API_KEY})
    events: list[Any] = []

    async def collect() -> None:
        async for event in session:
            events.append(event)

    async with session:
        task = asyncio.create_task(collect())
        conn = await relay.connection()
        run = Run(session, conn, events)
        try:
            # The SDK's session.update (voice, turn detection, transcription, tools) is answered.
            await until(lambda: conn.server("session.updated") or conn.errors(), 20, "session.updated", conn)
            assert not conn.errors(), (
                f"the SDK's session.update was refused: {conn.errors()}\n{conn.summary()}"
            )
            yield run
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    assert not run.sdk_errors(), f"the SDK reported errors: {run.sdk_errors()}\n{conn.summary()}"


def user_transcripts(run: Run) -> list[str]:
    """User audio transcripts in the SDK's history (as its UI shows them)."""
    history = run.session._history  # noqa: SLF001 - the public history arrives in events; this is the same list
    for event in reversed(run.events):
        if event.type == "history_updated":
            history = event.history
            break
    out = []
    for item in history:
        if getattr(item, "role", None) == "user":
            out += [c.transcript for c in item.content if c.type == "input_audio" and c.transcript]
    return out


def test_spoken_turn_with_server_vad_gets_audio_and_a_user_transcript(relay: Relay) -> None:
    async def main() -> None:
        async with agent_session(relay, make_agent(Weather())) as run:
            conn = run.conn
            await stream(run.session.send_audio, speech())
            await until(lambda: run.of("audio"), 60, "reply audio (RealtimeAudio)", conn)
            # Server VAD made the turn: the SDK never committed nor asked for a response.
            assert not conn.client("input_audio_buffer.commit") and not conn.client("response.create")
            assert conn.server("input_audio_buffer.speech_started")
            assert conn.server("input_audio_buffer.speech_stopped")
            # The user's words reach the SDK's history through input audio transcription.
            await until(
                lambda: (
                    conn.server("conversation.item.input_audio_transcription.completed")
                    or conn.server("conversation.item.input_audio_transcription.failed")
                ),
                60,
                "conversation.item.input_audio_transcription.completed",
                conn,
            )
            completed = conn.server("conversation.item.input_audio_transcription.completed")
            assert completed, conn.summary()
            assert completed[0]["transcript"], completed
            await until(lambda: user_transcripts(run), 20, "the user transcript in the SDK's history", conn)
            assert user_transcripts(run)[0] == completed[0]["transcript"]
            assert audible(b"".join(e.audio.data for e in run.of("audio")))
            assert not conn.errors(), conn.summary()

    asyncio.run(main())


def test_forced_tool_call_reaches_the_function_tool_and_the_reply_continues(relay: Relay) -> None:
    weather = Weather()
    settings = {"tool_choice": {"type": "function", "name": "get_weather"}}

    async def main() -> None:
        async with agent_session(relay, make_agent(weather), settings) as run:
            conn = run.conn
            await run.session.send_message("What is the weather like in Paris?")
            await until(lambda: run.of("tool_end"), 60, "the get_weather tool to run (tool_end)", conn)
            start = run.of("tool_start")[0]
            assert start.tool.name == "get_weather"
            args = json.loads(start.arguments)
            assert isinstance(args.get("city"), str), args
            assert weather.calls and weather.calls[0] == {"city": args["city"]}
            calls = conn.server("response.function_call_arguments.done")
            assert calls and json.loads(calls[0]["arguments"]) == args
            # The SDK sends the tool's output and asks for the next response: the model goes on.
            # The SDK emits tool_end once the output is sent; the relay may forward it a moment later.
            await until(conn.tool_outputs, 20, "the function_call_output", conn)
            await until(lambda: reply_after_tool_output(conn), 60, "a reply after the tool output", conn)
            first = conn.server("response.done")[0]["response"]
            assert first["status"] == "completed" and first["output"][0]["type"] == "function_call", first
            assert not conn.errors(), conn.summary()

    asyncio.run(main())


def test_barge_in_interrupts_the_reply(relay: Relay) -> None:
    async def main() -> None:
        async with agent_session(relay, make_agent(Weather())) as run:
            conn = run.conn
            await stream(run.session.send_audio, speech())
            await until(lambda: run.of("audio"), 60, "reply audio (RealtimeAudio)", conn)
            # The user talks over the reply while it streams.
            await stream(run.session.send_audio, speech(BARGE_IN, lead_ms=0))
            await until(lambda: run.of("audio_interrupted"), 30, "the SDK's audio_interrupted event", conn)
            # The SDK truncates the reply to what it played; the user's speech gets a reply.
            await barge_in_handled(conn)

    asyncio.run(main())
