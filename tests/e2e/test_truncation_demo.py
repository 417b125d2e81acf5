"""``session.truncation`` end to end: the real server on loopback with the embedded Qwen3-Omni
(random weights, CPU) at a context of 512 tokens, a conversation longer than that, and a client
on the wire (every frame validated with the SDK's models, ``tests/realtime/conftest.py``).

- ``auto`` (the default, as OpenAI's): the response completes, reading only the newest messages
  that fit; every item stays in the conversation;
- a retention ratio: the first truncation keeps at most that share, and the next turn reads the
  same prefix again from the cache instead of truncating anew;
- ``disabled``: the response fails with the context's size in its error;
- bad values are refused and change nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.realtime.conftest import connect, run, text_item

from .test_demo_server import DemoServer, running_demo

CONTEXT = 512
MAX_OUTPUT = 8
REPLY_ROOM = MAX_OUTPUT  # reply_room(512, 8): under a quarter of the context
TEXT_ONLY = {"output_modalities": ["text"]}


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoServer]:
    with running_demo(tmp_path_factory, max_output_tokens=MAX_OUTPUT, max_slots=2, max_context=CONTEXT) as s:
        yield s


def exchange(i: int) -> list[dict[str, Any]]:
    """A user question and an assistant answer (about 40 tokens together)."""
    question = text_item(
        f"Question number {i}: what do you know about the number {i} and its friends?", f"q{i}"
    )
    answer = {
        "type": "message",
        "id": f"a{i}",
        "role": "assistant",
        "content": [{"type": "output_text", "text": f"The number {i} is a fine number with many friends."}],
    }
    return [question, answer]


async def fill(c, exchanges: int) -> None:
    for i in range(exchanges):
        for item in exchange(i):
            await c.send({"type": "conversation.item.create", "item": item})
            await c.until("conversation.item.done")


async def respond(c) -> dict[str, Any]:
    await c.send({"type": "response.create", "response": TEXT_ONLY})
    return (await c.until("response.done", timeout=120))[-1]["response"]


async def two_turns_over_the_context(c) -> tuple[dict[str, Any], dict[str, Any]]:
    """16 exchanges (about 640 tokens, over the 504 a prompt may hold), a question and its
    response; then one more question and its response."""
    await fill(c, 16)
    responses = []
    for question in ("And the last one?", "One more?"):
        await c.send({"type": "conversation.item.create", "item": text_item(question)})
        await c.until("conversation.item.done")
        responses.append(await respond(c))
    return responses[0], responses[1]


def test_auto_truncation_answers_from_the_newest_messages_and_keeps_every_item(demo: DemoServer) -> None:
    async def main() -> tuple[dict, dict, dict, dict]:
        async with connect(demo, manual=True) as c:  # type: ignore[arg-type]
            await c.send(
                {"type": "session.update", "session": {"type": "realtime", "instructions": "Be brief."}}
            )
            updated = (await c.until("session.updated"))[-1]["session"]
            first, second = await two_turns_over_the_context(c)
            await c.send({"type": "conversation.item.retrieve", "item_id": "q0"})
            oldest = (await c.until("conversation.item.retrieved"))[-1]
            return updated, first, second, oldest

    updated, first, second, oldest = run(main())
    assert updated["truncation"] == "auto"
    for response in (first, second):
        assert response["status"] in ("completed", "incomplete"), response  # incomplete: the 8 tokens
        assert 0 < response["usage"]["input_tokens"] <= CONTEXT - REPLY_ROOM
    assert oldest["item"]["id"] == "q0"  # left out of the model's context, not of the conversation


def test_a_retention_ratio_truncates_once_and_the_next_turn_reuses_the_cache(demo: DemoServer) -> None:
    async def main() -> tuple[dict, dict, dict]:
        async with connect(demo, manual=True) as c:  # type: ignore[arg-type]
            truncation = {"type": "retention_ratio", "retention_ratio": 0.5}
            await c.send(
                {"type": "session.update", "session": {"type": "realtime", "truncation": truncation}}
            )
            updated = (await c.until("session.updated"))[-1]["session"]
            first, second = await two_turns_over_the_context(c)
            return updated, first, second

    updated, first, second = run(main())
    assert updated["truncation"] == {"type": "retention_ratio", "retention_ratio": 0.5}
    assert {first["status"], second["status"]} <= {"completed", "incomplete"}
    read = first["usage"]["input_tokens"]
    assert read <= (CONTEXT - REPLY_ROOM) // 2 + 16  # half the room (and the reply's header)
    usage = second["usage"]
    # the same messages again, the reply and the new question after them: no new truncation, so
    # the prompt starts as the first one did and that prefix comes from the cache
    assert usage["input_tokens"] > read
    assert usage["input_token_details"]["cached_tokens"] >= read - 8


def test_disabled_truncation_fails_a_response_over_the_context(demo: DemoServer) -> None:
    async def main() -> dict:
        async with connect(demo, manual=True) as c:  # type: ignore[arg-type]
            await c.send(
                {"type": "session.update", "session": {"type": "realtime", "truncation": "disabled"}}
            )
            await c.until("session.updated")
            await fill(c, 16)
            return await respond(c)

    response = run(main())
    assert response["status"] == "failed"
    assert f"context is {CONTEXT} tokens" in response["status_details"]["error"]["message"]


@pytest.mark.parametrize(
    ("truncation", "param"),
    [
        ("sometimes", "session.truncation"),
        ({"type": "retention_ratio", "retention_ratio": 1.5}, "session.truncation.retention_ratio"),
        ({"type": "retention_ratio"}, "session.truncation.retention_ratio"),
        (
            {"type": "retention_ratio", "retention_ratio": 0.5, "token_limits": {"post_instructions": 0}},
            "session.truncation.token_limits.post_instructions",
        ),
    ],
)
def test_bad_truncation_is_refused_and_changes_nothing(demo: DemoServer, truncation: Any, param: str) -> None:
    async def main() -> tuple[dict, dict]:
        async with connect(demo, manual=True) as c:  # type: ignore[arg-type]
            await c.send(
                {"type": "session.update", "session": {"type": "realtime", "truncation": truncation}}
            )
            error = await c.error()
            await c.send({"type": "session.update", "session": {"type": "realtime"}})
            session = (await c.until("session.updated"))[-1]["session"]
            return error, session

    error, session = run(main())
    assert error["param"].startswith(param), error
    assert session["truncation"] == "auto"
