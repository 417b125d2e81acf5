"""A bound on a prompt's size that needs no tokenizer: refuse, before tokenising, prompts that
cannot possibly fit the model's context.

Tokenising a multi-megabyte prompt holds the GIL for seconds and a lot of memory, stalling every
other session; yet no token is ever shorter than one character, and the longest tokens of the
tokenizers served here are a few characters (Qwen's BPE: at most 16 for anything but runs of
whitespace or punctuation). A prompt of more than ``max_context_tokens * MAX_CHARS_PER_TOKEN``
characters of text therefore cannot fit, and is refused at once by character counting alone
(``len`` of each string: constant time per part). Prompts under the bound are tokenised and
checked exactly as before.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from .types import ContextMessage, TextPart, ToolCallPart, ToolResultPart, ToolSpec

#: A safe upper bound of characters per token for the served tokenizers.
MAX_CHARS_PER_TOKEN = 16


def max_prompt_chars(max_context_tokens: int) -> int:
    """The most characters of text a prompt of ``max_context_tokens`` tokens can hold."""
    return max_context_tokens * MAX_CHARS_PER_TOKEN


def prompt_chars(messages: Iterable[ContextMessage], tools: Iterable[ToolSpec] = ()) -> int:
    """Characters of text in a request's messages and tool definitions (audio and images are
    bounded elsewhere)."""
    total = 0
    for message in messages:
        for part in message.parts:
            if isinstance(part, TextPart):
                total += len(part.text)
            elif isinstance(part, ToolCallPart):
                total += len(part.call_id) + len(part.name) + len(part.arguments)
            elif isinstance(part, ToolResultPart):
                total += len(part.call_id) + len(part.output)
    for tool in tools:
        total += len(tool.name) + len(tool.description) + len(json.dumps(tool.parameters))
    return total


def too_long_message(chars: int, max_context_tokens: int) -> str | None:
    """OpenAI's wording for a prompt over the context, or None when ``chars`` may fit."""
    if chars <= max_prompt_chars(max_context_tokens):
        return None
    return (
        f"This model's maximum context length is {max_context_tokens} tokens. However, your messages "
        f"hold {chars} characters of text, more than can fit in it. Please reduce the length of the "
        "messages."
    )
