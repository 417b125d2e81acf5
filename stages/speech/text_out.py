"""A reply's text as it is streamed: incremental detokenising, stop strings held back until they
can be ruled out, tool-call blocks held back until they close (:mod:`.tool_calls`), and the
alignment of reply tokens to sent characters (for the audio)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from ..types import TextDelta, ToolCall
from .detok import IncrementalDetokenizer
from .tool_calls import CLOSE_TAG, OPEN_TAG, Piece, parse_tool_call

TextOutput = TextDelta | ToolCall


class TextOut:
    """Feeds reply tokens, hands out the text that may be sent (with the tokens it covers) and the
    tool calls, in reply order.

    Tokens come with the :class:`~.tool_calls.Piece` the reply's splitter gave them (all
    :attr:`Piece.TEXT` for a request without tools). The text before a ``<tool_call>`` is sent
    when the block opens (stop strings apply to the text outside blocks only); a closed block is
    a :class:`ToolCall` when it parses against ``tool_names``, else it is sent as text, and so is
    a block the reply leaves open.
    """

    def __init__(
        self, tokenizer: Any, *, vocab_limit: int, stops: list[str], tool_names: Collection[str] = ()
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_limit = vocab_limit
        self.detok = IncrementalDetokenizer(tokenizer, vocab_limit=vocab_limit)
        self.stops = [s for s in stops if s]
        self.tool_names = frozenset(tool_names)
        self.unsent = ""  # decoded text held back (it may begin a stop string)
        self.sent_chars = 0
        self.pending_tokens = 0  # text tokens counted in no sent text yet
        self.block: list[int] | None = None  # the body of the open call block
        self.block_tokens = 0  # tokens of the open block, its tags included
        #: Reply characters sent after each reply token (``chars_after[k]``: after token ``k``).
        self.chars_after: list[int] = []

    def push(self, token: int, piece: Piece = Piece.TEXT) -> tuple[list[TextOutput], bool]:
        """One reply token: returns (what may be sent now, a stop string was hit). After a stop
        string nothing more is sent."""
        out: list[TextOutput] = []
        stopped = False
        if piece is Piece.TEXT:
            self.pending_tokens += 1
            stopped = self._release(self.detok.push(token), out, final=False)
        elif piece is Piece.OPEN:
            # The text so far goes out first, whole: a stop string cannot span a call.
            stopped = self._release(self.detok.flush(), out, final=True)
            self.block, self.block_tokens = [], 1
        elif piece is Piece.BODY:
            assert self.block is not None
            self.block.append(token)
            self.block_tokens += 1
        else:
            self.block_tokens += 1
            body = self._decode(self.block or [])
            call = parse_tool_call(body, self.tool_names)
            if call is not None:
                out.append(ToolCall(call.name, call.arguments, tokens=self.block_tokens))
            else:  # not a call of a declared function: it is text
                self.pending_tokens += self.block_tokens
                stopped = self._release(OPEN_TAG + body + CLOSE_TAG, out, final=False)
            self.block, self.block_tokens = None, 0
        self.chars_after.append(self.sent_chars)
        return out, stopped

    def finish(self, *, flush: bool) -> list[TextOutput]:
        """The end of the reply: what is still held back (unless it ended on a stop string),
        an unclosed call block as text."""
        out: list[TextOutput] = []
        if flush:
            text = self.detok.flush()
            if self.block is not None:
                self.pending_tokens += self.block_tokens
                text += OPEN_TAG + self._decode(self.block)
                self.block, self.block_tokens = None, 0
            self._release(text, out, final=True)
        if self.chars_after:
            self.chars_after[-1] = self.sent_chars
        return out

    def chars_at(self, token_index: int, done: bool) -> int:
        """Characters sent once reply token ``token_index`` is spoken (``done``: no more come)."""
        if token_index < 0:
            return 0
        if token_index >= len(self.chars_after):
            return self.sent_chars if done else (self.chars_after or [0])[-1]
        return self.chars_after[token_index]

    def _decode(self, ids: list[int]) -> str:
        ids = [t for t in ids if t < self.vocab_limit]
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _release(self, text: str, out: list[TextOutput], *, final: bool) -> bool:
        """Adds ``text`` to what is held back and appends what may go out now; True when a stop
        string was hit (the text is cut before it)."""
        self.unsent += text
        cut, found = len(self.unsent), False
        if self.stops:
            hits = [i for i in (self.unsent.find(s) for s in self.stops) if i >= 0]
            if hits:
                cut, found = min(hits), True
            elif not final:
                for k in range(min(len(self.unsent), max(map(len, self.stops)) - 1), 0, -1):
                    tail = self.unsent[-k:]
                    if any(s.startswith(tail) for s in self.stops):
                        cut = len(self.unsent) - k
                        break
        send = self.unsent[:cut]
        self.unsent = "" if found else self.unsent[cut:]
        if send:
            out.append(TextDelta(send, self.pending_tokens))
            self.pending_tokens = 0
            self.sent_chars += len(send)
        return found
