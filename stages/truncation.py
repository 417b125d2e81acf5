"""Which of a prompt's oldest messages a :class:`~.types.Truncation` leaves out.

Model-agnostic: the pipeline measures what each message costs (tokens, or characters for the
bound that needs no tokenizer, :mod:`.prompt_size`) and :func:`first_kept` picks where the kept
conversation starts. See :class:`~.types.Truncation` for the rule.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from .types import ContextMessage, Truncation


def reply_room(max_context: int, max_output_tokens: int | None) -> int:
    """The tokens a truncated prompt leaves for the reply: its ``max_output_tokens`` (None: the
    server's), at most a quarter of the context."""
    quarter = max(1, max_context // 4)
    return quarter if max_output_tokens is None else max(1, min(max_output_tokens, quarter))


def conversation_budget(truncation: Truncation, available: int) -> int:
    """The tokens the conversation may hold: ``available`` (the context less the head and the
    reply's room), or ``post_instructions`` when lower."""
    limit = truncation.post_instructions
    return available if limit is None else min(available, limit)


def first_kept(
    count: int, held: Callable[[int], int], budget: int, retention_ratio: float, answers: Sequence[bool]
) -> int | None:
    """Where the kept part of a conversation of ``count`` messages starts (the index of its first
    message). ``held(k)``: what the messages from ``k`` on hold (tokens or characters; it shrinks
    as ``k`` grows). 0 when the whole fits ``budget``; else the fewest oldest messages are left out
    for the rest to hold at most ``retention_ratio * budget`` (found by bisection: ``held`` is
    asked about ``log2(count)`` times), then the start moves on past any message that answers one
    before it (``answers``: a reply, a tool's result), but never past the last message, which is kept when it
    fits ``budget`` alone. None: the last message alone is over ``budget``."""
    if len(answers) != count:
        raise ValueError("answers must say, for each of the count messages, whether it answers one before")
    if count == 0 or held(0) <= budget:
        return 0
    last = count - 1
    if held(last) > budget:
        return None
    target = math.floor(budget * min(max(retention_ratio, 0.0), 1.0))
    lo, hi = 1, last  # the answer is in [lo, hi]: hi always qualifies or is the last message
    while lo < hi:
        mid = (lo + hi) // 2
        if held(mid) <= target:
            hi = mid
        else:
            lo = mid + 1
    start = lo
    while start < last and answers[start]:
        start += 1
    return start


def answers_before(messages: Sequence[ContextMessage]) -> list[bool]:
    """For each message: it answers one before it (the assistant's reply, a function's result),
    so a truncated conversation does not start with it."""
    return [m.role in ("assistant", "tool") for m in messages]


def split_head(messages: Sequence[ContextMessage]) -> tuple[list[ContextMessage], list[ContextMessage]]:
    """(the head: a leading ``system`` message, or nothing; the conversation after it)."""
    if messages and messages[0].role == "system":
        return [messages[0]], list(messages[1:])
    return [], list(messages)
