"""A reply's text as it is streamed: incremental detokenising, stop strings held back until they
can be ruled out, and the alignment of reply tokens to sent characters (for the audio)."""

from __future__ import annotations

from typing import Any

from .detok import IncrementalDetokenizer


class TextOut:
    """Feeds reply tokens, hands out the text that may be sent (with the tokens it covers)."""

    def __init__(self, tokenizer: Any, *, vocab_limit: int, stops: list[str]) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, vocab_limit=vocab_limit)
        self.stops = [s for s in stops if s]
        self.unsent = ""  # decoded text held back (it may begin a stop string)
        self.sent_chars = 0
        self.pending_tokens = 0  # tokens counted in no sent text yet
        #: Reply characters sent after each reply token (``chars_after[k]``: after token ``k``).
        self.chars_after: list[int] = []

    def push(self, token: int) -> tuple[str, int, bool]:
        """One reply token: returns (text to send now, tokens it covers, a stop string was hit).
        After a stop string nothing more is sent."""
        self.pending_tokens += 1
        text, tokens, stopped = self._release(self.detok.push(token), final=False)
        self.chars_after.append(self.sent_chars)
        return text, tokens, stopped

    def finish(self, *, flush: bool) -> tuple[str, int]:
        """The end of the reply: what is still held back (unless it ended on a stop string)."""
        text, tokens = "", 0
        if flush:
            text, tokens, _ = self._release(self.detok.flush(), final=True)
        if self.chars_after:
            self.chars_after[-1] = self.sent_chars
        return text, tokens

    def chars_at(self, token_index: int, done: bool) -> int:
        """Characters sent once reply token ``token_index`` is spoken (``done``: no more come)."""
        if token_index < 0:
            return 0
        if token_index >= len(self.chars_after):
            return self.sent_chars if done else (self.chars_after or [0])[-1]
        return self.chars_after[token_index]

    def _release(self, text: str, *, final: bool) -> tuple[str, int, bool]:
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
        tokens = 0
        if send:
            tokens, self.pending_tokens = self.pending_tokens, 0
            self.sent_chars += len(send)
        return send, tokens, found
