"""How a response streams function calls, driven output by output by a scripted engine stream.

The engine's order is not fixed: audio of the text before a call can arrive after the call (the
talker lags the thinker), text can follow a call. These tests feed each order and check the
items and events the session makes of it.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import numpy as np
from omnirt.sessions import events as ev
from omnirt.sessions.config import SessionLimits
from omnirt.sessions.errors import ErrorCode, SessionError
from omnirt.sessions.items import FunctionCallItem, InputText, MessageItem, OutputAudio
from omnirt.sessions.response import ResponseOptions
from omnirt.sessions.session import RealtimeSession
from omnirt.sessions.voices import VoiceCatalog
from omnirt.stages.types import AudioDelta, Finished, GenerationRequest, Output, TextDelta, ToolCall, Usage

_counter = itertools.count()


def ids(prefix: str) -> str:
    return f"{prefix}_{next(_counter)}"


class ScriptedStream:
    """An engine stream whose outputs the test pushes."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Output] = asyncio.Queue()
        self.usage = Usage()
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    async def __aiter__(self) -> AsyncIterator[Output]:
        while True:
            output = await self.queue.get()
            yield output
            if isinstance(output, Finished):
                return


class ScriptedClient:
    def __init__(self) -> None:
        self.streams: list[ScriptedStream] = []
        self.requests: list[GenerationRequest] = []

    def submit(self, request: GenerationRequest) -> ScriptedStream:
        self.requests.append(request)
        self.streams.append(ScriptedStream())
        return self.streams[-1]


def pcm(ms: int) -> np.ndarray:
    return np.full(24 * ms, 1000, dtype=np.int16)


async def play(outputs: list[Output], *, cancel_after: int | None = None) -> tuple[RealtimeSession, list]:
    """A session with one user item; one response fed ``outputs`` (then cancelled, if asked)."""
    client = ScriptedClient()
    events: list[object] = []
    session = RealtimeSession(
        client,
        model="m",
        limits=SessionLimits(voices=VoiceCatalog.for_model(("v",))),
        emit=events.append,
        new_id=ids,
    )
    session.update({"tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "g"}]})
    session.create_item(MessageItem(ids("item"), "user", [InputText("hi")]))
    session.create_response()
    stream = client.streams[-1]
    for i, output in enumerate(outputs):
        stream.queue.put_nowait(output)
        if cancel_after == i:
            await asyncio.sleep(0.05)
            session.cancel_response()
            break
    async with asyncio.timeout(5):
        while not any(isinstance(e, ev.ResponseDone) for e in events):
            await asyncio.sleep(0.005)
    return session, events[events.index(next(e for e in events if isinstance(e, ev.ResponseCreated))) :]


def kinds(events: list) -> list[str]:
    return [type(e).__name__ for e in events]


CALL = ["OutputItemAdded", "ItemAdded", "FunctionCallArgumentsDelta", "FunctionCallArgumentsDone"]
CALL += ["OutputItemDone", "ItemDone"]


def test_audio_after_the_call_stays_in_the_message_which_closes_first() -> None:
    outputs: list[Output] = [
        TextDelta("Calling f."),
        ToolCall("f", '{"a": 1}'),
        AudioDelta(pcm(100), 10),  # the talker catching up with the text
        Finished("stop", Usage(output_text_tokens=3)),
    ]
    session, events = asyncio.run(play(outputs))
    message_tail = ["OutputAudioDone", "OutputTextDone", "ContentPartDone", "OutputItemDone", "ItemDone"]
    assert kinds(events)[-12:] == [*message_tail, *CALL, "ResponseDone"]
    response = events[-1].response
    message, call = response.output
    assert isinstance(message, MessageItem) and isinstance(message.content[0], OutputAudio)
    assert message.content[0].duration_ms == 100 and message.status == "completed"
    assert isinstance(call, FunctionCallItem) and (call.name, call.arguments) == ("f", '{"a": 1}')
    added = next(e for e in events if isinstance(e, ev.FunctionCallArgumentsDone))
    assert added.output_index == 1 and added.call_id == call.call_id
    assert response.status == "completed"
    assert [i.id for i in session.conversation][-2:] == [message.id, call.id]


def test_a_call_with_nothing_open_goes_out_at_once_and_later_text_is_a_new_item() -> None:
    outputs: list[Output] = [
        ToolCall("g", "{}"),
        TextDelta("Done."),
        ToolCall("f", "{}"),
        Finished("length", Usage()),
    ]
    session, events = asyncio.run(play(outputs))
    response = events[-1].response
    assert [type(i).__name__ for i in response.output] == [
        "FunctionCallItem",
        "MessageItem",
        "FunctionCallItem",
    ]
    assert [getattr(i, "name", None) for i in response.output] == ["g", None, "f"]
    # g closed before the message opened; f waited for the message to close
    assert kinds(events)[1:7] == CALL
    assert kinds(events)[7] == "OutputItemAdded" and events[7].output_index == 1
    # a call is complete even when the response ran out of tokens after it
    assert response.status == "incomplete" and response.output[2].status == "completed"
    assert response.output[1].status == "incomplete"


def test_cancel_drops_a_waiting_call_and_keeps_a_sent_one() -> None:
    outputs: list[Output] = [ToolCall("g", "{}"), TextDelta("and"), ToolCall("f", "{}")]
    session, events = asyncio.run(play(outputs, cancel_after=2))
    response = events[-1].response
    assert response.status == "cancelled"
    assert [getattr(i, "name", "message") for i in response.output] == ["g", "message"]
    assert sum(isinstance(e, ev.FunctionCallArgumentsDone) for e in events) == 1
    assert isinstance(events[-1], ev.ResponseDone)


def test_playback_ack_of_a_function_call_item_is_refused() -> None:
    session, events = asyncio.run(play([ToolCall("f", "{}"), Finished("stop", Usage())]))
    response = events[-1].response
    call = response.output[0]
    try:
        session.ack_playback(response.id, call.id, 0)
    except SessionError as exc:
        assert (exc.code, exc.param) == (ErrorCode.UNSUPPORTED_CONTENT_TYPE, "item_id")
    else:
        raise AssertionError("ack of a function_call item was accepted")


def test_response_options_tools_reach_the_request() -> None:
    async def main() -> GenerationRequest:
        client = ScriptedClient()
        session = RealtimeSession(client, model="m", limits=SessionLimits(), emit=lambda e: None, new_id=ids)
        session.update({"tools": [{"type": "function", "name": "f"}], "tool_choice": "required"})
        session.create_response(
            ResponseOptions(tools=[{"type": "function", "name": "g", "description": "G"}])
        )
        await session.close(notify=False)
        return client.requests[-1]

    request = asyncio.run(main())
    assert [(t.name, t.description, t.parameters) for t in request.tools] == [
        ("g", "G", {"type": "object", "properties": {}})
    ]
    assert request.tool_choice == "required"
