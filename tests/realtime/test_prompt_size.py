"""Text that cannot fit the model's context is refused before tokenising, with
``context_length_exceeded``: an item alone, and with ``truncation: disabled`` an item with the
conversation's text and a response's out-of-band input. The conversation is unchanged, and
another session's turn runs on meanwhile. (With truncation, the default, a conversation over the
context leaves its oldest messages out instead: ``tests/e2e/test_truncation_demo.py``.)"""

from __future__ import annotations

import time

from omnirt.stages.prompt_size import max_prompt_chars

from .conftest import Server, connect, run, text_item

LIMIT = max_prompt_chars(4096)  # the echo pipeline's context


def test_text_over_the_context_is_refused_and_the_conversation_kept(server: Server) -> None:
    async def main() -> tuple[list[dict], float, dict]:
        async with connect(server, manual=True) as c, connect(server, manual=True) as other:
            await c.send(
                {"type": "session.update", "session": {"type": "realtime", "truncation": "disabled"}}
            )
            await c.until("session.updated")
            errors = []
            t0 = time.perf_counter()
            await c.send({"type": "conversation.item.create", "item": text_item("x" * (LIMIT + 1))})
            errors.append(await c.error())
            seconds = time.perf_counter() - t0
            await c.send({"type": "conversation.item.create", "item": text_item("y" * (LIMIT // 2), "a")})
            await c.until("conversation.item.done")
            await c.send({"type": "conversation.item.create", "item": text_item("z" * (LIMIT // 2 + 1))})
            errors.append(await c.error())
            out_of_band = {
                "conversation": "none",
                "input": [text_item("w" * (LIMIT // 2 + 1)), {"type": "item_reference", "id": "a"}],
            }
            await c.send({"type": "response.create", "response": out_of_band})
            errors.append(await c.error())
            # meanwhile another session's turn completes normally
            await other.send({"type": "conversation.item.create", "item": text_item("hello")})
            await other.send({"type": "response.create", "response": {"output_modalities": ["text"]}})
            done = (await other.until("response.done"))[-1]
            await c.send({"type": "conversation.item.retrieve", "item_id": "a"})
            kept = (await c.until("conversation.item.retrieved"))[-1]
            await c.send({"type": "conversation.item.create", "item": text_item("short")})
            await c.until("conversation.item.done")
            return errors, seconds, {"done": done, "kept": kept}

    errors, seconds, got = run(main())
    assert [e["code"] for e in errors] == ["context_length_exceeded"] * 3
    assert [e["param"] for e in errors] == ["item", "item", "response"]
    assert "4096 tokens" in errors[0]["message"] and "delete some items" in errors[1]["message"]
    assert seconds < 1.0
    assert got["done"]["response"]["status"] == "completed"
    assert len(got["kept"]["item"]["content"][0]["text"]) == LIMIT // 2
