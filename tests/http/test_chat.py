"""Chat completions through the official openai SDK against a real server (EchoPipeline)."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import soundfile
from omnirt.stages.pipeline import RequestRejected
from omnirt.stages.types import GenerationRequest

from tests.fakes import EchoPipeline

from .conftest import MODEL, Server, run, running, user


def test_plain_completion_has_the_openai_shape(server: Server) -> None:
    async def go() -> Any:
        async with server.openai() as client:
            return await client.chat.completions.create(model=MODEL, messages=user("hello there"))

    completion = run(go())
    assert completion.id.startswith("chatcmpl-") and len(completion.id) <= 40
    assert completion.object == "chat.completion"
    assert completion.model == MODEL
    assert len(completion.choices) == 1
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == "You said: hello there."
    assert choice.finish_reason == "stop"
    assert completion.usage is not None
    # EchoPipeline: one input token per part, one output token per word.
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (1, 4)
    assert completion.usage.total_tokens == 5


def test_max_tokens_ends_with_length(server: Server) -> None:
    async def go() -> Any:
        async with server.openai() as client:
            old = await client.chat.completions.create(model=MODEL, messages=user("a b c d"), max_tokens=2)
            new = await client.chat.completions.create(
                model=MODEL, messages=user("a b c d"), max_completion_tokens=3, max_tokens=100
            )
            return old, new

    old, new = run(go())
    assert (old.choices[0].message.content, old.choices[0].finish_reason) == ("You said:", "length")
    assert old.usage.completion_tokens == 2
    # max_completion_tokens wins over the deprecated max_tokens.
    assert (new.choices[0].message.content, new.choices[0].finish_reason) == ("You said: a", "length")


def test_stream_with_usage(server: Server) -> None:
    async def go() -> list[Any]:
        async with server.openai() as client:
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "system", "content": "be brief"}, *user("stream me")],
                stream=True,
                stream_options={"include_usage": True},
            )
            return [chunk async for chunk in stream]

    chunks = run(go())
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "You said: stream me."
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert [c.choices[0].finish_reason for c in finals] == ["stop"]
    # The usage chunk comes last, with no choices; every other chunk carries usage null.
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (2, 4)
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_raw_sse_ends_with_done_and_has_no_usage_unless_asked(server: Server) -> None:
    body = {"model": MODEL, "messages": user("raw"), "stream": True}
    with server.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    assert not any('"usage"' in e for e in events)


def _wav(seconds: float, rate: int, channels: int = 1) -> str:
    t = np.arange(int(seconds * rate)) / rate
    tone = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    data = np.stack([tone] * channels, axis=1) if channels > 1 else tone
    buf = io.BytesIO()
    soundfile.write(buf, data, rate, format="WAV", subtype="PCM_16")
    return base64.b64encode(buf.getvalue()).decode()


# The pipeline gets the bytes as sent; EchoPipeline does not look inside.
PNG_1PX = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(32)).decode()


def test_multimodal_user_content_wav_is_resampled_to_24k(server: Server) -> None:
    """A 16 kHz stereo WAV of 0.5 s reaches the pipeline as 12 000 samples at 24 kHz (500 ms)."""
    content = [
        {"type": "text", "text": "what is in these?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG_1PX}", "detail": "low"}},
        {"type": "input_audio", "input_audio": {"data": _wav(0.5, 16_000, channels=2), "format": "wav"}},
    ]

    async def go() -> Any:
        async with server.openai() as client:
            return await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": content}]
            )

    completion = run(go())
    assert completion.choices[0].message.content == "You said: 500 ms of audio."
    assert completion.usage.prompt_tokens == 3 + 500 // 40  # parts + EchoPipeline's audio tokens


def test_pcm16_input_audio(server: Server) -> None:
    pcm = base64.b64encode(np.zeros(24_000 // 4, dtype="<i2").tobytes()).decode()
    body = {
        "model": MODEL,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "input_audio", "input_audio": {"data": pcm, "format": "pcm16"}}],
            }
        ],
    }
    with server.http() as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "You said: 250 ms of audio."


def test_every_role_and_ignored_fields_are_accepted(server: Server) -> None:
    """developer/assistant/tool messages and OpenAI fields this server does not use still answer 200."""
    body = {
        "model": MODEL,
        "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "rules"}]},
            {"role": "user", "content": "first"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "42"},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
            {"role": "user", "content": "second", "name": "bob"},
        ],
        "user": "someone",
        "metadata": {"a": "b"},
        "store": False,
        "frequency_penalty": 0.5,
        "some_future_field": {"x": 1},
        "temperature": 0.2,
        "top_p": 0.9,
        "seed": 7,
        "stop": ["\n\n"],
        "n": 1,
        "modalities": ["text"],
        "tool_choice": "auto",
        "response_format": {"type": "text"},
    }
    with server.http() as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "You said: second."


class SamplingEchoPipeline(EchoPipeline):
    """Echo that checks the sampling parameters as the speech pipeline does and keeps them."""

    def __init__(self) -> None:
        super().__init__()
        self.sampling: list[tuple[float, float]] = []

    def prepare(self, request: GenerationRequest) -> Any:
        if request.temperature < 0 or not 0 < request.top_p <= 1:  # SpeechPipeline.prepare's rule
            raise RequestRejected("temperature must be >= 0 and top_p in (0, 1]")
        self.sampling.append((request.temperature, request.top_p))
        return super().prepare(request)


def test_top_p_zero_is_taken_as_openai_takes_it_greedy() -> None:
    """OpenAI accepts ``top_p`` from 0 to 1; 0 keeps only the most likely token (greedy)."""
    pipeline = SamplingEchoPipeline()
    with running(pipeline) as s, s.http() as http:
        zero = http.post("/v1/chat/completions", json={"model": MODEL, "messages": user("hi"), "top_p": 0})
        both = http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": user("hi"), "top_p": 0, "temperature": 1.5},
        )
        usual = http.post("/v1/chat/completions", json={"model": MODEL, "messages": user("hi"), "top_p": 0.5})
    for response in (zero, both, usual):
        assert response.status_code == 200, response.text
    assert pipeline.sampling == [(0.0, 1.0), (0.0, 1.0), (1.0, 0.5)]
