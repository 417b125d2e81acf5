"""``POST /v1/images/generations`` through the official SDK (plain and streamed) and raw HTTP,
against the real app and Engine with the fake image pipeline."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import pytest
from openai import BadRequestError, NotFoundError
from PIL import Image

from tests.diffusion_fakes import FakeImagePipeline, image_colour

from .conftest import MediaServer, run, running_media, wait_for


@pytest.fixture(scope="module")
def media() -> Iterator[MediaServer]:
    with running_media() as s:
        yield s


def decode(b64: str) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert image.format == "PNG"
    return image.convert("RGB")


def colour(b64: str) -> tuple[int, int, int]:
    return decode(b64).getpixel((0, 0))  # type: ignore[return-value]


def test_generate_returns_pngs_as_the_sdk_parses_them(media: MediaServer) -> None:
    async def go() -> Any:
        async with media.openai() as client:
            return await client.images.generate(
                prompt="a red square",
                n=2,
                size="32x16",
                response_format="b64_json",
                quality="high",
                style="vivid",
                moderation="low",
                user="tester",
                extra_body={
                    "seed": 7,
                    "num_inference_steps": 3,
                    "guidance_scale": 2.5,
                    "negative_prompt": "blue",
                },
            )

    response = run(go())
    assert response.data is not None and len(response.data) == 2
    for i, image in enumerate(response.data):
        assert image.url is None and image.b64_json
        assert decode(image.b64_json).size == (32, 16)
        assert colour(image.b64_json) == image_colour(7, i)
    assert response.size == "32x16" and response.output_format == "png"
    assert response.usage is not None and response.usage.input_tokens == 3  # the fake: prompt words
    assert response.usage.input_tokens_details.text_tokens == 3
    # What reached the pipeline: the model resolved, the extras passed on, no previews.
    seen = media.image.seen[-1]
    assert (seen.model, seen.n, seen.width, seen.height) == ("image-test", 2, 32, 16)
    assert (seen.seed, seen.num_inference_steps, seen.guidance_scale) == (7, 3, 2.5)
    assert (seen.negative_prompt, seen.partial_images) == ("blue", 0)


def test_defaults_model_size_and_seed(media: MediaServer) -> None:
    async def go() -> Any:
        async with media.openai() as client:
            first = await client.images.generate(prompt="x", model="image-test", extra_body={"seed": 1})
            again = await client.images.generate(prompt="x", extra_body={"seed": 1})
            other = await client.images.generate(prompt="x", size="auto", extra_body={"seed": 2})
            return first, again, other

    first, again, other = run(go())
    assert first.size == "64x48"  # the model's default
    assert colour(first.data[0].b64_json) == colour(again.data[0].b64_json) == image_colour(1, 0)
    assert colour(other.data[0].b64_json) == image_colour(2, 0)


def test_stream_sends_partial_images_then_completed(media: MediaServer) -> None:
    async def go() -> list[Any]:
        async with media.openai() as client:
            stream = await client.images.generate(
                prompt="stream me", stream=True, partial_images=2, size="16x16", extra_body={"seed": 5}
            )
            return [event async for event in stream]

    events = run(go())
    assert [e.type for e in events] == [
        "image_generation.partial_image",
        "image_generation.partial_image",
        "image_generation.completed",
    ]
    partials, done = events[:2], events[2]
    assert [e.partial_image_index for e in partials] == [0, 1]
    final = image_colour(5, 0)
    # Previews after steps 2 and 3 of 4: the colour scaled by the fraction done.
    assert [colour(e.b64_json) for e in partials] == [tuple(c * k // 4 for c in final) for k in (2, 3)]
    assert colour(done.b64_json) == final
    for e in events:
        assert (e.size, e.output_format, e.background, e.quality) == ("16x16", "png", "opaque", "auto")
        assert e.created_at > 0
    assert done.usage.input_tokens == 2 and done.usage.total_tokens == 2
    assert media.image.seen[-1].partial_images == 2


def test_stream_with_n_names_each_image_and_no_partials(media: MediaServer) -> None:
    async def go() -> list[Any]:
        async with media.openai() as client:
            stream = await client.images.generate(prompt="two", stream=True, n=2, extra_body={"seed": 9})
            return [event async for event in stream]

    events = run(go())
    assert [e.type for e in events] == ["image_generation.completed"] * 2
    assert [e.index for e in events] == [0, 1]  # type: ignore[attr-defined]
    assert [colour(e.b64_json) for e in events] == [image_colour(9, 0), image_colour(9, 1)]


def test_raw_sse_names_each_event(media: MediaServer) -> None:
    body = {"prompt": "raw", "stream": True, "partial_images": 1}
    with media.http() as http, http.stream("POST", "/v1/images/generations", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line.startswith("event:")]
    assert lines == ["event: image_generation.partial_image", "event: image_generation.completed"]


def test_model_rejection_is_a_400_plain_and_streamed(media: MediaServer) -> None:
    async def go(stream: bool) -> BadRequestError:
        async with media.openai() as client:
            with pytest.raises(BadRequestError) as info:
                await client.images.generate(prompt="x", size="40x40", stream=stream)  # type: ignore[call-overload]
            return info.value

    for stream in (False, True):
        error = run(go(stream))
        assert "multiples of 16, got 40x40" in error.message
        assert error.code == "invalid_value"


def test_sdk_sees_unknown_model_as_not_found(media: MediaServer) -> None:
    async def go() -> NotFoundError:
        async with media.openai() as client:
            with pytest.raises(NotFoundError) as info:
                await client.images.generate(prompt="x", model="dall-e-3")
            return info.value

    error = run(go())
    assert error.code == "model_not_found" and "dall-e-3" in error.message


BAD = [
    ({}, "prompt", "missing_required_parameter", "Missing required parameter: 'prompt'"),
    ({"prompt": 5}, "prompt", "invalid_type", "Invalid value for 'prompt'"),
    ({"prompt": "   "}, "prompt", "invalid_value", "the prompt is empty"),
    ({"prompt": "x" * 32_001}, "prompt", "invalid_value", "at most 32000 characters"),
    ({"negative_prompt": "x" * 32_001}, "negative_prompt", "invalid_value", "at most 32000 characters"),
    ({"n": 0}, "n", "invalid_value", "between 1 and 4, got 0"),
    ({"n": 5}, "n", "invalid_value", "between 1 and 4, got 5"),
    ({"n": "2"}, "n", "invalid_type", "Invalid value for 'n'"),
    ({"size": "big"}, "size", "invalid_value", "expected 'WIDTHxHEIGHT'"),
    ({"size": "512x"}, "size", "invalid_value", "expected 'WIDTHxHEIGHT'"),
    ({"size": "0x512"}, "size", "invalid_value", "between 1 and 4096"),
    ({"size": "8192x512"}, "size", "invalid_value", "between 1 and 4096"),
    ({"num_inference_steps": 0}, "num_inference_steps", "invalid_value", "between 1 and 200, got 0"),
    ({"num_inference_steps": 201}, "num_inference_steps", "invalid_value", "between 1 and 200"),
    ({"num_inference_steps": 2.5}, "num_inference_steps", "invalid_type", "Invalid value"),
    ({"guidance_scale": -1}, "guidance_scale", "invalid_value", "greater than or equal to 0"),
    ({"seed": -1}, "seed", "invalid_value", "greater than or equal to 0"),
    ({"partial_images": 4}, "partial_images", "invalid_value", "less than or equal to 3"),
    ({"response_format": "url"}, "response_format", "unsupported_value", "use 'b64_json'"),
    ({"response_format": "gif"}, "response_format", "invalid_value", "Invalid value for 'response_format'"),
    ({"output_format": "jpeg"}, "output_format", "unsupported_value", "PNG only"),
    ({"output_compression": 50}, "output_compression", "unsupported_value", "jpeg and webp"),
    ({"background": "transparent"}, "background", "unsupported_value", "opaque"),
    ({"frame_count": 4}, "frame_count", "unsupported_value", "GIF or SVG"),
    ({"model": "echo-test"}, "model", "invalid_value", "does not do image generation"),
    # JSON integers past a float's range (no OverflowError, no 500)
    (
        {"cache_backend": "teacache", "cache_config": {"threshold": 10**400}},
        "cache_config",
        "invalid_value",
        "threshold must be from 0 to 100",
    ),
    (
        {"cache_backend": "magcache", "cache_config": {"retention_ratio": -(10**400)}},
        "cache_config",
        "invalid_value",
        "retention_ratio must be from 0 to 1",
    ),
]


@pytest.mark.parametrize(("fields", "param", "code", "message"), BAD, ids=[b[0].__repr__()[:40] for b in BAD])
def test_bad_input_is_a_400_naming_the_parameter(
    media: MediaServer, fields: dict[str, Any], param: str, code: str, message: str
) -> None:
    body = {"prompt": "a cat", **fields}
    if fields == {}:
        body = {}
    submitted = len(media.image.seen)
    with media.http() as http:
        response = http.post("/v1/images/generations", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
    assert message in error["message"]
    assert len(media.image.seen) == submitted  # nothing reached the engine


def test_pipeline_limits_and_bad_json_are_400s(media: MediaServer) -> None:
    with media.http() as http:
        steps = http.post("/v1/images/generations", json={"prompt": "x", "num_inference_steps": 51})
        rejected = http.post("/v1/images/generations", json={"prompt": "reject me"})
        garbage = http.post(
            "/v1/images/generations", content=b"{nope", headers={"content-type": "application/json"}
        )
    assert steps.status_code == 400 and "at most 50" in steps.json()["error"]["message"]
    assert rejected.status_code == 400 and "rejects this prompt" in rejected.json()["error"]["message"]
    assert garbage.status_code == 400 and garbage.json()["error"]["code"] == "invalid_json"


def test_no_image_model_is_a_404() -> None:
    from tests.http.conftest import running

    with running() as server, server.http() as http:
        response = http.post("/v1/images/generations", json={"prompt": "x"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
    assert "no image generation model" in response.json()["error"]["message"]


def test_client_going_away_cancels_the_generation() -> None:
    slow = FakeImagePipeline(step_seconds=0.05, default_steps=200)
    slow.max_steps = 1000
    with running_media(image=slow) as media:
        with (
            media.http() as http,
            http.stream("POST", "/v1/images/generations", json={"prompt": "x", "stream": True}),
        ):
            assert wait_for(lambda: bool(slow.active))
        # The stream was closed before any event: the request leaves the pipeline.
        assert wait_for(lambda: not slow.active)
        assert media.engine.stats.requests_cancelled >= 1
