"""``omnirt serve --model DIR --load-format dummy`` as a user runs it: the real CLI in a process
of its own on loopback, a config-only folder (a shrunken copy of the published Qwen3-Omni
config, every token id as published), the official SDK as client."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI

from tests.server import serve_cli
from tests.speech.test_dummy_load import config_folder, published_tiny

PREFILL_CHUNK = 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = config_folder(tmp_path_factory.mktemp("qwen3-omni-dummy"), published_tiny())
    args = ["--model", str(folder), "--load-format", "dummy", "--device", "cpu", "--max-sessions", "2"]
    args += ["--prefill-chunk", str(PREFILL_CHUNK)]
    log = tmp_path_factory.mktemp("log") / "serve.log"
    with serve_cli(args, cache=tmp_path_factory.mktemp("cache"), log=log, start_timeout=120) as base:
        yield base
    assert "RANDOM WEIGHTS (--load-format dummy" in log.read_text()


def test_a_config_only_folder_serves_chat_and_says_its_weights_are_random(server: str) -> None:
    client = OpenAI(api_key="k", base_url=server + "/v1", max_retries=0)
    models = client.models.list().data
    assert len(models) == 1
    assert json.loads(httpx.get(server + "/health").text)["random_weights"] is True
    reply = client.chat.completions.create(
        model=models[0].id, messages=[{"role": "user", "content": "hello"}], max_tokens=5, temperature=0.7,
        seed=3,
    )
    assert reply.choices[0].message.content and reply.usage.completion_tokens == 5
    again = client.chat.completions.create(
        model=models[0].id, messages=[{"role": "user", "content": "hello"}], max_tokens=5, temperature=0.7,
        seed=3,
    )
    assert again.choices[0].message.content == reply.choices[0].message.content  # seeded draws


def test_the_published_vocabulary_is_served(server: str) -> None:
    """Prompt tokens are counted with the published ids' tokenizer (the chat template's tokens
    exist at 151644 and on), and /metrics shows the thinker's model calls by rows."""
    client = OpenAI(api_key="k", base_url=server + "/v1", max_retries=0)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "hi"}]
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=2)
    assert reply.usage.prompt_tokens > 3
    metrics = httpx.get(server + "/metrics").text
    prefills = re.search(r'^omnirt_model_calls_total\{call="thinker_prefill",kind="speech",rows="1"\} (\S+)$',
                         metrics, re.M)
    assert prefills is not None and float(prefills.group(1)) >= 1, metrics


def test_a_prompt_longer_than_the_prefill_chunk_is_read_in_pieces_and_answered(server: str) -> None:
    """``--prefill-chunk 64``: a prompt of several pieces (read over several ticks) gets its
    seeded reply, the same one twice."""
    client = OpenAI(api_key="k", base_url=server + "/v1", max_retries=0)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": " ".join(f"word{i}" for i in range(120))}]
    replies = [
        client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0.7, seed=5)
        for _ in range(2)
    ]
    assert replies[0].usage.prompt_tokens > 3 * PREFILL_CHUNK
    assert replies[0].usage.completion_tokens == 4
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
    # The second read only the prompt's last position: the rest was the first one's.
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in replies]
    assert cached[0] < PREFILL_CHUNK and cached[1] == replies[1].usage.prompt_tokens - 1
    metrics = httpx.get(server + "/metrics").text
    counted = re.findall(r'^omnirt_prompt_tokens_total\{kind="speech",source="(\w+)"\} (\S+)$', metrics, re.M)
    tokens = {source: float(n) for source, n in counted}
    assert tokens["cached"] >= cached[1] and tokens["read"] >= replies[0].usage.prompt_tokens - cached[0]
