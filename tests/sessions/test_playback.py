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


def test_an_ack_takes_the_same_end_as_a_truncate() -> None:
    """Audio that is not a whole number of ms (100.5 ms): a truncate may name its rounded-up end
    (101), and so may the ack that stands for it; it keeps all of the audio."""
    playback = Playback(Conversation("conv"))
    part = OutputAudio(transcript="one")
    part.append(np.ones(2412, np.int16), 3)
    item = MessageItem("item_0", "assistant", [part])
    playback.conversation.insert(item)
    response = Response("resp_0", "conv", ["audio"], "inf", "alloy", "audio/pcm", output=[item])
    playback.track(response)
    assert playback.ack(response.id, "item_0", 101, streaming=False).played_ms == 101
    assert (part.samples, part.transcript) == (2412, "one")
    with pytest.raises(SessionError):
        playback.ack(response.id, "item_0", 102, streaming=False)


def test_the_cut_at_the_last_ack_gives_way_to_what_the_client_says_next() -> None:
    """An interrupted reply is cut at its last ack (100 ms); the client's ack or truncate after
    that (200 ms, what it heard when it stopped) cuts the whole audio there instead; one past
    the whole audio is refused."""
    for how in ("ack", "truncate"):
        playback = Playback(Conversation("conv"))
        response, part = reply(playback)
        playback.ack(response.id, "item_0", 100, streaming=True)
        response.status = "cancelled"
        playback.settle(response)
        assert (part.samples, part.transcript) == (2400, "one")
        with pytest.raises(SessionError):
            playback.ack(response.id, "item_0", 301, streaming=False)
        if how == "ack":
            assert playback.ack(response.id, "item_0", 200, streaming=False).committed_ms == 200
        else:
            playback.truncate("item_0", 0, 200)
        assert (part.samples, part.transcript, part.frozen) == (4800, "one two", True)
        with pytest.raises(SessionError):  # the client's word is final
            playback.truncate("item_0", 0, 250)
