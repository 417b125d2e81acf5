"""Playback accounting alone (sessions/playback.py): acks while a response streams are recorded
and applied only when it is interrupted; acks after it ended, and truncation, cut at once."""

from __future__ import annotations

import numpy as np
import pytest
from omnirt.sessions import events as ev
from omnirt.sessions.conversation import Conversation
from omnirt.sessions.errors import ErrorCode, SessionError
from omnirt.sessions.items import MessageItem, OutputAudio
from omnirt.sessions.playback import ACK_RESPONSES, Playback
from omnirt.sessions.response import Response


def reply(playback: Playback, n: int = 0) -> tuple[Response, OutputAudio]:
    part = OutputAudio(transcript="one two three")
    for chars in (3, 7, 13):
        part.append(np.ones(2400, np.int16), chars)  # 100 ms per word
    item = MessageItem(f"item_{n}", "assistant", [part])
    playback.conversation.insert(item)
    response = Response(f"resp_{n}", "conv", ["audio"], "inf", "alloy", "audio/pcm", output=[item])
    playback.track(response)
    return response, part


@pytest.mark.parametrize("status", ["cancelled", "completed"])
def test_an_ack_while_streaming_cuts_only_an_interrupted_response(status: str) -> None:
    playback = Playback(Conversation("conv"))
    response, part = reply(playback)
    event = playback.ack(response.id, "item_0", 150, streaming=True)
    assert event == ev.PlaybackAcknowledged(response.id, "item_0", 150, 300)
    assert part.samples == 7200  # recorded, not applied
    response.status = status  # type: ignore[assignment]
    playback.settle(response)
    cut = status == "cancelled"
    assert (part.samples, part.transcript) == ((3600, "one") if cut else (7200, "one two three"))


def test_an_ack_after_the_response_or_a_truncate_cuts_at_once() -> None:
    playback = Playback(Conversation("conv"))
    response, part = reply(playback)
    playback.ack(response.id, "item_0", 200, streaming=False)
    assert (part.samples, part.frozen, part.transcript) == (4800, True, "one two")
    response2, part2 = reply(playback, 1)
    playback.ack(response2.id, "item_1", 250, streaming=True)
    assert playback.truncate("item_1", 0, 100) == ev.ItemTruncated("item_1", 0, 100)
    response2.status = "cancelled"
    playback.settle(response2)  # the truncation dropped the recorded ack
    assert part2.samples == 2400


def test_bad_acks_are_refused_and_change_nothing() -> None:
    playback = Playback(Conversation("conv"))
    response, part = reply(playback)
    for args, code, param in [
        (("resp_x", "item_0", 10), ErrorCode.INVALID_VALUE, "response_id"),
        ((response.id, "item_x", 10), ErrorCode.ITEM_TRUNCATE_INVALID_ID, "item_id"),
        ((response.id, "item_0", 301), ErrorCode.INVALID_VALUE, "played_ms"),
    ]:
        with pytest.raises(SessionError) as info:
            playback.ack(*args, streaming=False)
        assert (info.value.code, info.value.param) == (code, param)
    assert part.samples == 7200 and not part.frozen
    for n in range(1, ACK_RESPONSES + 1):
        reply(playback, n)
    with pytest.raises(SessionError):  # forgotten: only the most recent responses are kept
        playback.ack(response.id, "item_0", 10, streaming=False)
