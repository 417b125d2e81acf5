"""Tool calls in the thinker's reply, in the Qwen3 / Qwen3-Omni chat format.

The chat template asks the model to answer a function call as one block per call::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``<tool_call>`` and ``</tool_call>`` are single added tokens of the vocabulary, so a reply is
split on token ids, as it streams (:class:`CallSplitter`): the tokens outside a block are text
(shown and spoken), the tokens from ``<tool_call>`` to its ``</tool_call>`` are a call (held back,
never spoken). A closed block becomes a :class:`~omnirt.stages.types.ToolCall` when its body parses
as ``{"name": <a declared function>, "arguments": <a JSON object>}`` (:func:`parse_tool_call`);
any other block is given back as plain text, tags included, so nothing the model wrote is lost.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from ..types import ToolCall

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


@dataclass(frozen=True)
class ToolTags:
    """The ids of the call tags in a vocabulary."""

    open_id: int
    close_id: int

    @classmethod
    def of(cls, tokenizer: Any) -> ToolTags | None:
        """The tags of ``tokenizer``, or None when it has no single token for either."""
        added = tokenizer.get_added_vocab()
        if OPEN_TAG in added and CLOSE_TAG in added:
            return cls(int(added[OPEN_TAG]), int(added[CLOSE_TAG]))
        return None


class Piece(enum.Enum):
    """What a reply token is, as :class:`CallSplitter` sees it."""

    TEXT = "text"  # outside any call: shown and spoken
    OPEN = "open"  # the ``<tool_call>`` that opens a block
    BODY = "body"  # inside a block
    CLOSE = "close"  # the ``</tool_call>`` that closes it


class CallSplitter:
    """Token-level state of one reply: inside a call block or not. A ``<tool_call>`` inside a
    block is part of its body (the block will not parse); a ``</tool_call>`` outside any is text."""

    def __init__(self, tags: ToolTags) -> None:
        self.tags = tags
        self.inside = False

    def feed(self, token: int) -> Piece:
        if self.inside:
            if token == self.tags.close_id:
                self.inside = False
                return Piece.CLOSE
            return Piece.BODY
        if token == self.tags.open_id:
            self.inside = True
            return Piece.OPEN
        return Piece.TEXT


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_tool_call(body: str, names: Collection[str]) -> ToolCall | None:
    """The call written between the tags, or None when ``body`` is not exactly a JSON object
    ``{"name": N, "arguments": A}`` with ``N`` in ``names`` and ``A`` an object. The arguments
    come back re-serialised (``json.dumps``), so they always parse."""
    try:
        value = json.loads(body, parse_constant=_no_constant)
    except ValueError:
        return None
    if not isinstance(value, dict) or set(value) != {"name", "arguments"}:
        return None
    name, arguments = value["name"], value["arguments"]
    if not isinstance(name, str) or name not in names or not isinstance(arguments, dict):
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))
