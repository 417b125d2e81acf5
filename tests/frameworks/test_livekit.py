"""livekit (``livekit-agents`` + ``livekit-plugins-openai``) against ``omnirt serve``.

``livekit.plugins.openai.realtime.RealtimeModel(base_url=...)`` with every other option at its
default (voice ``marin``, ``semantic_vad``, ``gpt-4o-mini-transcribe`` input transcription;
``tool_choice`` in one of the two forced-tool tests), and
its ``RealtimeSession`` used without a LiveKit room: audio goes in through ``push_audio`` as
``rtc.AudioFrame``s, replies come out of the ``generation_created`` streams. What livekit's
``AgentActivity`` does around the session (executing tools with ``llm.utils.execute_function_call``,
sending the outputs with ``update_chat_ctx`` and asking for the reply; interrupting and truncating
on ``input_speech_started``) is done here the same way, in :class:`Agent`, with the places in
``livekit/agents/voice/agent_activity.py`` it follows.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.frameworks.conftest import (
    API_KEY,
    BARGE_IN,
    RATE,
    audible,
    need,
    reply_after_tool_output,
    speech,
    stream,
    until,
)
from tests.frameworks.relay import Connection, Relay

rtc = need("livekit.rtc", "livekit-agents")
lk_llm = need("livekit.agents.llm", "livekit-agents")
lk_utils = need("livekit.agents.llm.utils", "livekit-agents")
lk_openai = need("livekit.plugins.openai.realtime", "livekit-plugins-openai")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]
#: livekit's own code for an ignored error: the race of its ``response.cancel`` with the server's
#: own cancel on speech (OpenAI answers it the same way; livekit drops it by its message).
RACE = "response_cancel_not_active"


@dataclass
class Reply:
    """One generation as livekit hands it over, and what was "played" of it."""

    response_id: str | None
    audio: list[tuple[float, Any]] = field(default_factory=list)  # (arrival, rtc.AudioFrame)
    text: list[str] = field(default_factory=list)
    calls: list[Any] = field(default_factory=list)  # llm.FunctionCall
    message_ids: list[str] = field(default_factory=list)
    done: bool = False

    def audio_ms(self) -> float:
        return sum(f.samples_per_channel / f.sample_rate * 1000 for _, f in self.audio)

    def played_ms(self) -> int:
        """Playback at real time from the first frame, never past what arrived."""
        if not self.audio:
            return 0
        return int(min((time.monotonic() - self.audio[0][0]) * 1000, self.audio_ms()))


@dataclass
class Agent:
    """A LiveKit agent's use of the realtime session, without the room."""

    session: Any
    conn: Connection
    tools: list[Any]
    replies: list[Reply] = field(default_factory=list)
    transcripts: list[Any] = field(default_factory=list)  # llm.InputTranscriptionCompleted
    speech_started: int = 0
    interrupted: list[Reply] = field(default_factory=list)
    errors: list[Any] = field(default_factory=list)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def attach(self) -> None:
        self.session.on("generation_created", self._on_generation)
        self.session.on("input_speech_started", self._on_speech_started)
        self.session.on("input_audio_transcription_completed", self.transcripts.append)
        self.session.on("error", self.errors.append)

    def _on_generation(self, ev: Any) -> None:
        reply = Reply(ev.response_id)
        self.replies.append(reply)
        task = asyncio.create_task(self._consume(ev, reply))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _consume(self, ev: Any, reply: Reply) -> None:
        async def message(msg: Any) -> None:
            reply.message_ids.append(msg.message_id)

            async def audio() -> None:
                async for frame in msg.audio_stream:
                    reply.audio.append((time.monotonic(), frame))

            async def text() -> None:
                async for delta in msg.text_stream:
                    reply.text.append(str(delta))

            await asyncio.gather(audio(), text())

        async def messages() -> None:
            started = []
            async for msg in ev.message_stream:  # each message is read as it streams
                started.append(asyncio.create_task(message(msg)))
            await asyncio.gather(*started)

        async def functions() -> None:
            async for call in ev.function_stream:
                reply.calls.append(call)

        await asyncio.gather(messages(), functions())
        reply.done = True

    def _on_speech_started(self, _: Any) -> None:
        # agent_activity.py:2258-2273 and :2425: the server's speech start interrupts the
        # current speech, cancels the generation, and the played part is what is kept (the
        # realtime reply task truncates the message to the playback position).
        self.speech_started += 1
        current = self.replies[-1] if self.replies and not self.replies[-1].done else None
        if current is None:
            return
        self.interrupted.append(current)
        self.session.interrupt()
        if current.message_ids:
            self.session.truncate(
                message_id=current.message_ids[0],
                modalities=["audio", "text"],
                audio_end_ms=current.played_ms(),
            )

    async def run_tools(self, reply: Reply) -> list[Any]:
        """agent_activity.py:4890-4950: execute the calls, send the outputs, ask for the reply
        (``tool_choice`` back to ``auto``)."""
        tool_ctx = lk_llm.ToolContext(self.tools)
        outputs = []
        for call in reply.calls:
            result = await lk_utils.execute_function_call(
                lk_llm.FunctionToolCall(name=call.name, arguments=call.arguments, call_id=call.call_id),
                tool_ctx,
            )
            outputs.append(result)
        chat_ctx = self.session.chat_ctx.copy()
        chat_ctx.items.extend(r.fnc_call_out for r in outputs)
        self.session.interrupt()
        await self.session.update_chat_ctx(chat_ctx)
        await self.session.generate_reply(tool_choice="auto")
        return outputs

    async def push_audio(self, chunk: bytes) -> None:
        self.session.push_audio(rtc.AudioFrame(chunk, RATE, 1, len(chunk) // 2))


@contextlib.asynccontextmanager
async def livekit_agent(relay: Relay, tools: list[Any] | None = None, **options: Any) -> AsyncIterator[Agent]:
    base_url = relay.url.replace("ws://", "http://") + "/v1"
    model = lk_openai.RealtimeModel(base_url=base_url, api_key=API_KEY, **options)
    session = model.session()
    try:
        conn = await relay.connection()
        agent = Agent(session, conn, tools or [])
        agent.attach()
        await until(lambda: conn.server("session.updated") or conn.errors(), 20, "session.updated", conn)
        assert not conn.errors(), f"livekit's session.update was refused: {conn.errors()}\n{conn.summary()}"
        if tools:
            await session.update_tools(tools)
        yield agent
    finally:
        for task in list(agent.tasks):
            task.cancel()
        await session.aclose()
        await model.aclose()


def test_spoken_turn_with_server_vad_gets_audio_and_a_user_transcript(relay: Relay) -> None:
    async def main() -> None:
        async with livekit_agent(relay) as agent:
            conn = agent.conn
            await stream(agent.push_audio, speech())
            await until(
                lambda: agent.replies and agent.replies[0].audio, 60, "reply audio (audio_stream)", conn
            )
            assert agent.speech_started == 1
            assert not conn.client("input_audio_buffer.commit") and not conn.client("response.create")
            # livekit turns transcription on by default and then relies on it for the user's text.
            await until(
                lambda: [t for t in agent.transcripts if t.is_final],
                60,
                "a final user transcript (input_audio_transcription_completed)",
                conn,
            )
            final = [t for t in agent.transcripts if t.is_final][0]
            assert final.transcript
            user_items = [i for i in agent.session.chat_ctx.items if getattr(i, "role", None) == "user"]
            assert user_items and final.transcript in user_items[0].text_content
            assert audible(b"".join(bytes(f.data) for _, f in agent.replies[0].audio))
            assert not conn.errors() and not agent.errors, (agent.errors, conn.summary())

    asyncio.run(main())


FORCED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("where", ["model", "response"])
def test_forced_tool_call_reaches_the_function_tool_and_the_reply_continues(relay: Relay, where: str) -> None:
    """``tool_choice`` naming the function, given where livekit takes it: the model's option (sent
    in its first ``session.update``, before ``update_tools`` sends the tools) or one reply's
    (``generate_reply(tool_choice=...)``, livekit's per-response tool choice)."""
    calls: list[dict[str, Any]] = []

    @lk_llm.function_tool
    async def get_weather(city: str) -> str:
        """Get the current weather in a city.

        Args:
            city: The city's name.
        """
        calls.append({"city": city})
        return f"It is sunny and 21 degrees in {city}."

    options = {"tool_choice": FORCED} if where == "model" else {}

    async def main() -> None:
        async with livekit_agent(relay, tools=[get_weather], **options) as agent:
            conn = agent.conn
            chat_ctx = agent.session.chat_ctx.copy()
            chat_ctx.add_message(role="user", content="What is the weather like in Paris?")
            await agent.session.update_chat_ctx(chat_ctx)
            reply = agent.session.generate_reply(**({} if where == "model" else {"tool_choice": FORCED}))
            await asyncio.wait_for(reply, 20)
            await until(
                lambda: agent.replies and agent.replies[0].done, 60, "the forced response to end", conn
            )
            first = agent.replies[0]
            assert [c.name for c in first.calls] == ["get_weather"], conn.summary()
            outputs = await agent.run_tools(first)
            assert calls == [json.loads(first.calls[0].arguments)] and isinstance(calls[0]["city"], str), (
                calls
            )
            assert not outputs[0].fnc_call_out.is_error, outputs[0].fnc_call_out
            # The reply continues, with the tool's output in the conversation.
            await until(lambda: reply_after_tool_output(conn), 60, "a reply after the tool output", conn)
            first_done = conn.server("response.done")[0]["response"]
            assert first_done["status"] == "completed", first_done
            assert not conn.errors() and not agent.errors, (agent.errors, conn.summary())

    asyncio.run(main())


def test_barge_in_interrupts_the_reply(relay: Relay) -> None:
    async def main() -> None:
        async with livekit_agent(relay) as agent:
            conn = agent.conn
            await stream(agent.push_audio, speech())
            await until(
                lambda: agent.replies and agent.replies[0].audio, 60, "reply audio (audio_stream)", conn
            )
            await stream(agent.push_audio, speech(BARGE_IN, lead_ms=0))
            await until(lambda: agent.interrupted, 30, "input_speech_started during the reply", conn)
            await until(lambda: agent.replies[0].done, 30, "the interrupted generation to end", conn)
            first = conn.server("response.done")[0]["response"]
            assert first["status"] == "cancelled", first
            assert first["status_details"]["reason"] == "turn_detected", first
            await until(
                lambda: conn.server("conversation.item.truncated") or conn.errors(),
                10,
                "conversation.item.truncated",
                conn,
            )
            unexpected = [e for e in conn.errors() if e["code"] != RACE]
            assert not unexpected and not agent.errors, (agent.errors, conn.summary())
            await until(
                lambda: len(agent.replies) >= 2 and agent.replies[1].audio,
                60,
                "the reply to the interrupting turn",
                conn,
            )

    asyncio.run(main())
