"""Incremental detokenization: new text per token, never splitting a multi-byte character."""

from __future__ import annotations

from typing import Any

#: Decoding a window this far back keeps byte-level merges and leading spaces right.
_CONTEXT = 6


class IncrementalDetokenizer:
    """Feed token ids one at a time; ``push`` returns the text they completed (maybe "")."""

    def __init__(self, tokenizer: Any, *, vocab_limit: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_limit = vocab_limit if vocab_limit is not None else len(tokenizer)
        self.ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens whose text has been returned

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        if token_id >= self.vocab_limit:  # padded vocabulary rows of the model: no text
            return ""
        self.ids.append(token_id)
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""  # an incomplete UTF-8 sequence (or a token without text): wait
        new = after[len(before) :]
        self._read = len(self.ids)
        self._prefix = max(0, self._read - _CONTEXT)
        return new

    def flush(self) -> str:
        """At the end of the reply: whatever is still held back (an unfinished character)."""
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        new = after[len(before) :] if len(after) > len(before) else ""
        self._read = len(self.ids)
        return new
