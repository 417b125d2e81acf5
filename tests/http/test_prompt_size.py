"""A prompt that cannot fit the model's context is refused before tokenising: fast, with OpenAI's
``context_length_exceeded``, while another client's request runs on undisturbed."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest
from omnirt.stages.prompt_size import max_prompt_chars

from .conftest import MODEL, Server, run, user


def test_a_huge_prompt_is_refused_at_once_while_another_request_completes(server: Server) -> None:
    huge = "word " * (6 * 1024 * 1024 // 5)  # 6 MiB of text

    async def other() -> str:
        stream = await server.openai().chat.completions.create(
            model=MODEL, messages=user("hello there friend"), stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def refused() -> tuple[openai.BadRequestError, float]:
        t0 = time.perf_counter()
        with pytest.raises(openai.BadRequestError) as info:
            await server.openai().chat.completions.create(model=MODEL, messages=user(huge))
        return info.value, time.perf_counter() - t0

    async def main() -> tuple[str, tuple[openai.BadRequestError, float]]:
        return await asyncio.gather(other(), refused())

    text, (error, seconds) = run(main())
    assert text == "You said: hello there friend."
    assert error.status_code == 400
    assert error.body == {
        "message": error.body["message"],  # type: ignore[index]
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    }
    assert "maximum context length is 4096 tokens" in error.message
    assert seconds < 1.0, seconds


def test_the_bound_is_on_all_messages_and_tools_and_a_prompt_under_it_runs(server: Server) -> None:
    limit = max_prompt_chars(server.engine.info.max_context_tokens)
    half = "x" * (limit // 2)
    with pytest.raises(openai.BadRequestError) as info:
        run(
            server.openai().chat.completions.create(
                model=MODEL, messages=[*user(half), {"role": "assistant", "content": half}, *user("more")]
            )
        )
    assert info.value.code == "context_length_exceeded"
    tool = {"type": "function", "function": {"name": "f", "description": half, "parameters": {}}}
    with pytest.raises(openai.BadRequestError) as info:
        run(server.openai().chat.completions.create(model=MODEL, messages=user(half), tools=[tool]))
    assert info.value.code == "context_length_exceeded"
    fits = run(server.openai().chat.completions.create(model=MODEL, messages=user("ok " * 100)))
    assert fits.choices[0].finish_reason in ("stop", "length")
