"""Playback accounting: keeping the assistant's audio in the conversation to what the user heard.

``conversation.item.truncate`` cuts an item at once. ``playback.ack`` (extension) reports how much
of an item has played: after its response ended that is the same cut; while the response still
streams the position is recorded, and the item is cut there if the response is then interrupted
(:meth:`Playback.settle`). That cut stands for what the client had said when the interruption came:
its next truncate or ack of the item (the exact position, sent once it stopped playing) replaces it,
up to the audio the item had. Methods validate before they change anything and return the event to
send; the owning session sends it.
"""

from __future__ import annotations

import collections
import dataclasses

from .conversation import Conversation
from .errors import ErrorCode, SessionError
from .events import ItemTruncated, PlaybackAcknowledged
from .items import Item, MessageItem, OutputAudio
from .response import Response

#: Responses remembered for ``playback.ack`` (the most recent ones).
ACK_RESPONSES = 32


class Playback:
    def __init__(self, conversation: Conversation) -> None:
        self.conversation = conversation
        #: In-conversation responses by id, for playback acks (bounded, most recent last).
        self.responses: collections.OrderedDict[str, Response] = collections.OrderedDict()
        #: Played audio (ms) acknowledged per assistant item of a still-streaming response.
        self._played: dict[str, int] = {}
        #: The whole audio of items that :meth:`settle` cut at their last ack (the latest
        #: interrupted response's only): the client's next truncate or ack of one cuts from it.
        self._uncut: dict[str, OutputAudio] = {}

    def track(self, response: Response) -> None:
        """An in-conversation response started: its items may be acknowledged."""
        self.responses[response.id] = response
        self._uncut.clear()
        while len(self.responses) > ACK_RESPONSES:
            self.responses.popitem(last=False)

    def truncate(self, item_id: str, content_index: int, audio_end_ms: int) -> ItemTruncated:
        """Cut an assistant audio part to what the user heard: the audio after ``audio_end_ms``
        and the transcript not yet spoken by then. Allowed while the response still streams."""
        item = self.conversation.get(item_id, ErrorCode.ITEM_TRUNCATE_INVALID_ID, "truncating")
        _check_truncatable(item)
        assert isinstance(item, MessageItem)
        if not 0 <= content_index < len(item.content) or not isinstance(
            item.content[content_index], OutputAudio
        ):
            raise SessionError(
                ErrorCode.INVALID_VALUE,
                f"Item '{item_id}' has no audio content at content_index {content_index}.",
                "content_index",
            )
        part = item.content[content_index]
        assert isinstance(part, OutputAudio)
        whole = self._uncut.get(item_id) if content_index == 0 else None
        end_ms = (whole or part).end_ms
        if audio_end_ms > end_ms:
            raise SessionError(
                ErrorCode.INVALID_VALUE,
                f"audio_end_ms {audio_end_ms} is past the end of the item's audio ({end_ms} ms).",
                "audio_end_ms",
            )
        if whole is not None:
            self._restore(item_id, part)
        part.truncate(audio_end_ms)
        self._played.pop(item_id, None)
        return ItemTruncated(item_id, content_index, audio_end_ms)

    def ack(self, response_id: str, item_id: str, played_ms: int, *, streaming: bool) -> PlaybackAcknowledged:
        """``playback.ack``: the user heard ``played_ms`` of the item's audio; ``streaming``: the
        response is still running (the position is recorded, see the module doc)."""
        response = self.responses.get(response_id)
        if response is None:
            raise SessionError(
                ErrorCode.INVALID_VALUE,
                f"No recent response with response_id '{response_id}' in this conversation.",
                "response_id",
            )
        # The same checks and codes as conversation.item.truncate (which an ack stands for).
        if not any(i.id == item_id for i in response.output):
            raise SessionError(
                ErrorCode.ITEM_TRUNCATE_INVALID_ID,
                f"Response '{response_id}' has no output item '{item_id}'.",
                "item_id",
            )
        item = self.conversation.get(item_id, ErrorCode.ITEM_TRUNCATE_INVALID_ID, "acknowledging")
        _check_truncatable(item)
        assert isinstance(item, MessageItem)
        part = item.content[0] if item.content else None
        if not isinstance(part, OutputAudio):
            raise SessionError(
                ErrorCode.INVALID_VALUE, f"Item '{item_id}' has no audio at content_index 0.", "item_id"
            )
        end_ms = (self._uncut.get(item_id) or part).end_ms
        if played_ms < 0 or played_ms > end_ms:
            raise SessionError(
                ErrorCode.INVALID_VALUE,
                f"played_ms {played_ms} is outside the item's audio (0 to {end_ms} ms).",
                "played_ms",
            )
        if streaming and not part.frozen:
            self._played[item_id] = played_ms
        else:
            self._restore(item_id, part)
            if played_ms < part.duration_ms:
                part.truncate(played_ms)
            self._played.pop(item_id, None)
        return PlaybackAcknowledged(response_id, item_id, played_ms, part.duration_ms)

    def settle(self, response: Response) -> None:
        """A response ended: its recorded positions are dropped, and when it was interrupted
        (``cancelled``) each item is cut to what the last ack said was heard."""
        for item in response.output:
            played = self._played.pop(item.id, None)
            if played is None or response.status != "cancelled" or not isinstance(item, MessageItem):
                continue
            part = item.content[0] if item.content else None
            if isinstance(part, OutputAudio) and not part.frozen and played < part.duration_ms:
                self._uncut[item.id] = dataclasses.replace(part)  # truncate() rebinds, never mutates
                part.truncate(played)

    def _restore(self, item_id: str, part: OutputAudio) -> None:
        """Undo :meth:`settle`'s cut of the item (its audio whole again, not frozen), if it had one."""
        whole = self._uncut.pop(item_id, None)
        if whole is not None:
            part.chunks, part.transcript, part.marks = whole.chunks, whole.transcript, whole.marks
            part.samples, part.frozen = whole.samples, whole.frozen


def _check_truncatable(item: Item) -> None:
    """Only assistant messages holding audio can be truncated (OpenAI's code and wording)."""
    if not (
        isinstance(item, MessageItem)
        and item.role == "assistant"
        and any(isinstance(c, OutputAudio) for c in item.content)
    ):
        raise SessionError(
            ErrorCode.UNSUPPORTED_CONTENT_TYPE, "Only model output audio messages can be truncated", "item_id"
        )
