"""Every kind of bad request gets the OpenAI error shape with the right status, param and code."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from omnirt.realtime.config import ServerConfig
from omnirt.realtime.http.errors import from_engine_error
from omnirt.stages.types import Finished, GenerationRequest, Output, Usage

from tests.fakes import EchoPipeline

from .conftest import MODEL, Server, run, running, user

B64_JUNK = base64.b64encode(b"this is not audio at all, just bytes").decode()


def audio_part(data: str, fmt: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "input_audio", "input_audio": {"data": data, "format": fmt}}],
            }
        ],
    }


def image_part(url: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
    }


def with_tools(*tools: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": user("x"), "tools": list(tools), **fields}


def function(name: str = "f", **fields: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, **fields}}


def schema_format(**spec: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": user("x"), "response_format": {"type": "json_schema", **spec}}


TOOL_ERRORS: dict[str, tuple[Any, str | None, str]] = {
    "tool_choice naming an unknown function": (
        with_tools(function("f"), tool_choice={"type": "function", "function": {"name": "g"}}),
        "tool_choice",
        "invalid_value",
    ),
    "tool_choice of an unknown mode": (
        with_tools(function(), tool_choice="always"),
        "tool_choice",
        "invalid_value",
    ),
    "allowed_tools naming an unknown function": (
        with_tools(
            function("f"),
            tool_choice={
                "type": "allowed_tools",
                "allowed_tools": {"mode": "required", "tools": [function("g")]},
            },
        ),
        "tool_choice.allowed_tools.tools[0].function.name",
        "invalid_value",
    ),
    "parameters that are not a JSON Schema": (
        with_tools(function("f", parameters={"type": "object", "properties": {"a": {"type": "strng"}}})),
        "tools[0].function.parameters",
        "invalid_value",
    ),
    "parameters that are not an object": (
        with_tools(function("f", parameters=["a"])),
        "tools[0].function.parameters",
        "invalid_type",
    ),
    "a function name with spaces": (
        with_tools(function("get weather")),
        "tools[0].function.name",
        "invalid_value",
    ),
    "two functions of one name": (
        with_tools(function("f"), function("f")),
        "tools[1].function.name",
        "invalid_value",
    ),
    "a function without a name": (
        with_tools({"type": "function", "function": {}}),
        "tools[0].function.name",
        "missing_required_parameter",
    ),
    "a custom tool": (
        with_tools({"type": "custom", "custom": {"name": "c"}}),
        "tools[0].type",
        "invalid_value",
    ),
    "legacy functions": (
        {"model": MODEL, "messages": user("x"), "functions": [{"name": "f"}]},
        "functions",
        "invalid_value",
    ),
    "json_schema without its spec": (
        schema_format(),
        "response_format.json_schema",
        "missing_required_parameter",
    ),
    "json_schema with a bad schema": (
        schema_format(json_schema={"name": "out", "schema": {"type": "object", "required": "a"}}),
        "response_format.json_schema.schema",
        "invalid_value",
    ),
    "json_schema with a bad name": (
        schema_format(json_schema={"name": "my format", "schema": {"type": "object"}}),
        "response_format.json_schema.name",
        "invalid_value",
    ),
    "unknown response_format type": (
        {"model": MODEL, "messages": user("x"), "response_format": {"type": "yaml"}},
        "response_format",
        "invalid_value",
    ),
    "tool message answering no call": (
        {
            "model": MODEL,
            "messages": [*user("x"), {"role": "tool", "tool_call_id": "call_nope", "content": "1"}],
        },
        "messages[1].tool_call_id",
        "invalid_value",
    ),
}

# (what is sent, expected param, expected code): each answered 400 invalid_request_error.
BAD_BODIES: dict[str, tuple[Any, str | None, str]] = {
    "body is not JSON": (b'{"model": "echo-test", ', None, "invalid_json"),
    "body is a JSON array": ([1, 2], None, "invalid_type"),
    "no messages": ({"model": MODEL}, "messages", "missing_required_parameter"),
    "no model": ({"messages": user("x")}, "model", "missing_required_parameter"),
    "empty messages": ({"model": MODEL, "messages": []}, "messages", "invalid_value"),
    "unknown role": (
        {"model": MODEL, "messages": [{"role": "function", "content": "x", "name": "f"}]},
        "messages[0]",
        "invalid_value",
    ),
    "content is a number": (
        {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
        "messages[0].content",
        "invalid_type",
    ),
    "text part without text": (
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
        "messages[0].content[0].text",
        "missing_required_parameter",
    ),
    "temperature above 2": (
        {"model": MODEL, "messages": user("x"), "temperature": 3},
        "temperature",
        "invalid_value",
    ),
    "max_tokens of 0": (
        {"model": MODEL, "messages": user("x"), "max_tokens": 0},
        "max_tokens",
        "invalid_value",
    ),
    "max_tokens as a string": (
        {"model": MODEL, "messages": user("x"), "max_tokens": "10"},
        "max_tokens",
        "invalid_type",
    ),
    "n of 2": ({"model": MODEL, "messages": user("x"), "n": 2}, "n", "invalid_value"),
    "audio output asked": (
        {
            "model": MODEL,
            "messages": user("x"),
            "modalities": ["text", "audio"],
            "audio": {"voice": "alloy", "format": "wav"},
        },
        "modalities",
        "invalid_value",
    ),
    "stream_options without stream": (
        {"model": MODEL, "messages": user("x"), "stream_options": {"include_usage": True}},
        "stream_options",
        "invalid_value",
    ),
    "logprobs": ({"model": MODEL, "messages": user("x"), "logprobs": True}, "logprobs", "invalid_value"),
    "required tool_choice without tools": (
        {"model": MODEL, "messages": user("x"), "tool_choice": "required"},
        "tool_choice",
        "invalid_value",
    ),
    **TOOL_ERRORS,
    "five stop sequences": (
        {"model": MODEL, "messages": user("x"), "stop": ["a", "b", "c", "d", "e"]},
        "stop",
        "invalid_value",
    ),
    "http image URL (nothing is fetched)": (
        image_part("https://example.com/cat.png"),
        "messages[0].content[0].image_url.url",
        "invalid_value",
    ),
    "image data URL that is not base64": (
        image_part("data:image/png;base64,@@@"),
        "messages[0].content[0].image_url.url",
        "invalid_value",
    ),
    "image data URL of text": (
        image_part("data:text/plain;base64,aGk="),
        "messages[0].content[0].image_url.url",
        "invalid_value",
    ),
    "audio that is not base64": (
        audio_part("%%%", "wav"),
        "messages[0].content[0].input_audio.data",
        "invalid_value",
    ),
    "wav that does not decode": (
        audio_part(B64_JUNK, "wav"),
        "messages[0].content[0].input_audio.data",
        "invalid_value",
    ),
    "pcm16 with an odd byte count": (
        audio_part(base64.b64encode(b"abc").decode(), "pcm16"),
        "messages[0].content[0].input_audio.data",
        "invalid_value",
    ),
    "unknown audio format": (
        audio_part(B64_JUNK, "aac"),
        "messages[0].content[0].input_audio.format",
        "invalid_value",
    ),
    "file part": (
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": [{"type": "file", "file": {"file_id": "file-1"}}]}],
        },
        "messages[0].content[0].type",
        "invalid_value",
    ),
    "assistant message with nothing in it": (
        {"model": MODEL, "messages": [{"role": "assistant"}, *user("x")]},
        "messages[0].content",
        "missing_required_parameter",
    ),
}


@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_bad_request_is_400_with_param_and_code(server: Server, case: str) -> None:
    body, param, code = BAD_BODIES[case]
    kwargs = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    with server.http() as http:
        response = http.post("/v1/chat/completions", **kwargs)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert (error["param"], error["code"]) == (param, code), error["message"]
    assert error["message"]


def test_sdk_raises_bad_request_and_the_server_goes_on(server: Server) -> None:
    async def go() -> str:
        async with server.openai() as client:
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(model=MODEL, messages=user("x"), n=3)
            assert info.value.param == "n"
            ok = await client.chat.completions.create(model=MODEL, messages=user("still here"))
            return ok.choices[0].message.content or ""

    assert run(go()) == "You said: still here."


def test_pipeline_rejection_is_400_with_its_message(server: Server) -> None:
    """RequestRejected from pipeline.add -> Finished('error', msg) -> 400 carrying msg."""
    with server.http() as http:
        plain = http.post("/v1/chat/completions", json={"model": MODEL, "messages": user("reject me")})
        streamed = http.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": user("reject me"), "stream": True}
        )
    for response in (plain, streamed):  # a stream is committed only after the engine accepted the request
        assert response.status_code == 400
        assert response.json()["error"]["message"] == "the echo pipeline rejects this input"


def test_wrong_model_is_404_model_not_found(server: Server) -> None:
    async def go() -> None:
        async with server.openai() as client:
            with pytest.raises(openai.NotFoundError) as info:
                await client.chat.completions.create(model="gpt-4o", messages=user("x"))
            assert info.value.code == "model_not_found"
            assert info.value.param == "model"
            with pytest.raises(openai.NotFoundError):
                await client.models.retrieve("gpt-4o")

    run(go())


def test_a_huge_quoted_value_is_elided_in_the_message(server: Server) -> None:
    """An error that quotes what the client sent stays small: a model name of 200 000 characters
    comes back with its middle elided (as a realtime error's does), the explanation kept."""
    with server.http() as http:
        response = http.post("/v1/chat/completions", json={"model": "m" * 200_000, "messages": user("x")})
    assert response.status_code == 404
    message = response.json()["error"]["message"]
    assert len(message) < 4200 and "characters elided" in message
    assert message.startswith("The model `mmm") and message.endswith("do not have access to it.")


def test_unknown_url_404_and_wrong_method_405_are_json(server: Server) -> None:
    with server.http() as http:
        missing = http.get("/v1/nothing-here")
        wrong = http.get("/v1/chat/completions")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "not_found"
    assert wrong.status_code == 405
    assert wrong.json()["error"]["type"] == "invalid_request_error"
    assert "POST" in wrong.headers["allow"]


def test_auth_401_without_or_with_wrong_key_and_success_with_key() -> None:
    with running(config=ServerConfig(api_keys=["k-one", "k-two"])) as server:

        async def go() -> None:
            async with server.openai(api_key="wrong") as client:
                with pytest.raises(openai.AuthenticationError) as info:
                    await client.chat.completions.create(model=MODEL, messages=user("x"))
                assert info.value.code == "invalid_api_key"
                with pytest.raises(openai.AuthenticationError):
                    await client.models.list()
            async with server.openai(api_key="k-two") as client:
                done = await client.chat.completions.create(model=MODEL, messages=user("let me in"))
                assert done.choices[0].message.content == "You said: let me in."
                assert [m.id async for m in client.models.list()] == [MODEL]

        run(go())
        with server.http() as http:  # health stays open for probes; metrics take the key (test_exposure)
            assert http.get("/health").status_code == 200
            bare = http.post("/v1/chat/completions", json={"model": MODEL, "messages": user("x")})  # no key
            basic = http.get("/v1/models", headers={"authorization": "Basic k-one"})  # not a bearer key
        for response in (bare, basic):
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"


def test_body_over_limit_is_413_declared_or_chunked() -> None:
    with running(config=ServerConfig(max_http_body_bytes=2000)) as server, server.http() as http:
        big = {"model": MODEL, "messages": user("x" * 5000)}
        declared = http.post("/v1/chat/completions", json=big)

        def chunks() -> Iterator[bytes]:
            yield b'{"model": "echo-test", "messages": [{"role": "user", "content": "'
            for _ in range(10):
                yield b"y" * 500
            yield b'"}]}'

        chunked = http.post(
            "/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"}
        )
        small = http.post("/v1/chat/completions", json={"model": MODEL, "messages": user("fits")})
    for response in (declared, chunked):
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "request_too_large"
    assert small.status_code == 200


class CrashingPipeline(EchoPipeline):
    """EchoPipeline whose step raises once a request asking for it has produced two words."""

    def step(self) -> list[tuple[str, Output]]:
        for a in self.active.values():
            if "crash" in a.words[-1] and a.sent >= 2:
                raise RuntimeError("boom")
        return super().step()


def test_engine_internal_error_is_500_or_a_stream_error_event() -> None:
    with running(CrashingPipeline()) as server:

        async def go() -> None:
            async with server.openai() as client:
                with pytest.raises(openai.InternalServerError) as info:
                    await client.chat.completions.create(model=MODEL, messages=user("crash"))
                assert info.value.status_code == 500
                assert info.value.type == "server_error"
                stream = await client.chat.completions.create(
                    model=MODEL, messages=user("crash"), stream=True
                )
                seen = []
                with pytest.raises(openai.APIError) as info2:
                    async for chunk in stream:
                        seen.append(chunk)
                assert "error" in str(info2.value).lower()
                assert seen and seen[0].choices[0].delta.role == "assistant"  # it had started
                ok = await client.chat.completions.create(model=MODEL, messages=user("fine"))
                assert ok.choices[0].message.content == "You said: fine."

        run(go())


def test_engine_queue_full_is_429_with_retry_after() -> None:
    with running(max_waiting=0) as server, server.http() as http:
        response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": user("x")})
    assert response.status_code == 429
    assert response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "rate_limit_exceeded"


@pytest.mark.parametrize(
    ("code", "status"),
    [("internal", 500), ("overloaded", 429), ("shutdown", 503), ("rejected", 400), (None, 500)],
)
def test_engine_error_codes_map_to_statuses(code: str | None, status: int) -> None:
    """The engine's ``Finished.code`` picks the status; only a rejection shows its message."""
    error = from_engine_error(Finished("error", Usage(), "audio is longer than the context", code))
    assert error.status == status
    assert ("audio is longer" in error.body()["error"]["message"]) == (code == "rejected")


def test_request_is_the_generation_request_it_should_be() -> None:
    """The mapping to GenerationRequest: text only, token limit capped by the server, stop as a list."""
    from omnirt.realtime.http.chat_input import generation_request
    from omnirt.realtime.http.chat_schema import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate_json(
        '{"model": "m", "messages": [{"role": "developer", "content": "d"},'
        ' {"role": "user", "content": "u"}],'
        ' "max_tokens": 100000, "stop": "END", "seed": 3}'
    )
    gen: GenerationRequest = generation_request(req, "chatcmpl-x", max_output_tokens=512)
    assert gen.output_audio is False
    assert gen.max_output_tokens == 512
    assert gen.stop == ["END"] and gen.seed == 3
    assert (gen.temperature, gen.top_p) == (1.0, 1.0)
    assert [m.role for m in gen.messages] == ["system", "user"]
