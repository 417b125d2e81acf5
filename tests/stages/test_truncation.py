"""Where a truncated conversation starts (``stages/truncation.py``): the rule of
:class:`~omnirt.stages.types.Truncation` on message costs, with every ``held`` call counted."""

from __future__ import annotations

import pytest
from omnirt.stages.truncation import conversation_budget, first_kept, reply_room, split_head
from omnirt.stages.types import ContextMessage, TextPart, Truncation


def held_by(costs: list[int], asked: list[int] | None = None):
    def held(k: int) -> int:
        if asked is not None:
            asked.append(k)
        return sum(costs[k:])

    return held


def test_a_conversation_that_fits_keeps_everything() -> None:
    costs = [10, 20, 30]
    assert first_kept(3, held_by(costs), 60, 0.5, [False] * 3) == 0
    assert first_kept(0, held_by([]), 0, 1.0, []) == 0


def test_just_enough_of_the_oldest_goes_at_ratio_one() -> None:
    costs = [10, 20, 30, 40]  # 100 in all
    assert first_kept(4, held_by(costs), 90, 1.0, [False] * 4) == 1  # 90 left
    assert first_kept(4, held_by(costs), 89, 1.0, [False] * 4) == 2  # 70 left
    assert first_kept(4, held_by(costs), 40, 1.0, [False] * 4) == 3  # the last alone


def test_a_retention_ratio_leaves_room_for_the_next_turns() -> None:
    costs = [10] * 10  # 100
    assert first_kept(10, held_by(costs), 90, 1.0, [False] * 10) == 1  # 90 left
    assert first_kept(10, held_by(costs), 90, 0.5, [False] * 10) == 6  # 40 left: under 45
    assert first_kept(10, held_by(costs), 90, 0.0, [False] * 10) == 9  # only the last


def test_the_last_message_is_kept_when_it_fits_alone_and_refused_when_not() -> None:
    assert first_kept(3, held_by([5, 5, 50]), 50, 0.5, [False] * 3) == 2  # over the target, kept
    assert first_kept(3, held_by([5, 5, 51]), 50, 1.0, [False] * 3) is None


def test_an_answer_never_starts_what_is_kept() -> None:
    costs = [10, 10, 10, 10, 10]
    answers = [False, False, True, True, False]  # a reply and a result, or a call's two results
    assert first_kept(5, held_by(costs), 30, 1.0, answers) == 4  # 2 would start with a result
    # ... but never past the last message
    assert first_kept(3, held_by([10, 10, 10]), 10, 1.0, [False, False, True]) == 2


def test_bisection_asks_about_a_few_starts_only() -> None:
    costs = [1] * 1000
    asked: list[int] = []
    assert first_kept(1000, held_by(costs, asked), 500, 0.8, [False] * 1000) == 600
    assert len(asked) <= 2 + 10  # the whole, the last, then log2(1000) probes


def test_answers_must_match_the_count() -> None:
    with pytest.raises(ValueError):
        first_kept(2, held_by([1, 1]), 1, 1.0, [False])


def test_reply_room_and_budget() -> None:
    assert reply_room(4096, 512) == 512
    assert reply_room(4096, 4096) == 1024  # at most a quarter of the context
    assert reply_room(4096, None) == 1024
    assert reply_room(2, 5) == 1
    assert conversation_budget(Truncation(), 3000) == 3000
    assert conversation_budget(Truncation(post_instructions=1000), 3000) == 1000
    assert conversation_budget(Truncation(post_instructions=5000), 3000) == 3000


def test_split_head_takes_a_leading_system_message_only() -> None:
    system = ContextMessage("system", (TextPart("be brief"),))
    user = ContextMessage("user", (TextPart("hi"),))
    assert split_head([system, user]) == ([system], [user])
    assert split_head([user, system]) == ([], [user, system])
    assert split_head([]) == ([], [])


def test_replies_and_tool_results_answer() -> None:
    from omnirt.stages.truncation import answers_before

    roles = ["user", "assistant", "tool", "system", "user"]
    messages = [ContextMessage(r, (TextPart("x"),)) for r in roles]  # type: ignore[arg-type]
    assert answers_before(messages) == [False, True, True, False, False]
