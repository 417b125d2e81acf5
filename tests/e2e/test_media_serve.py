"""``omnirt serve`` with no arguments, as a newcomer runs it: the real CLI in a process of its own,
serving the embedded speech, image (tiny Z-Image) and video (tiny Wan) models side by side, driven
with the official SDK: images plain and streamed with previews, a video job polled to completion
and downloaded as a playable MP4, and a voice-free chat reply from the same process."""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Iterator

import av
import numpy as np
import pytest
from openai import AsyncOpenAI, OpenAI
from PIL import Image

from tests.server import serve_cli


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("log") / "serve.log"
    args = ["--device", "cpu", "--max-sessions", "2"]
    with serve_cli(args, cache=tmp_path_factory.mktemp("cache"), log=log) as base:
        yield base
    text = log.read_text()
    assert "RANDOM WEIGHTS" in text and "Traceback" not in text, text[-3000:]


def _image(b64: str) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert image.format == "PNG"
    return image.convert("RGB")


def test_the_default_server_lists_speech_image_and_video_models(server: str) -> None:
    models = {m.id for m in OpenAI(api_key="k", base_url=server + "/v1", max_retries=0).models.list().data}
    assert {"demo-qwen3-omni", "demo-z-image", "demo-wan2.1-t2v"} <= models, models


def test_images_plain_and_streamed_with_previews(server: str) -> None:
    client = OpenAI(api_key="k", base_url=server + "/v1", max_retries=0)
    plain = client.images.generate(
        prompt="a lighthouse at dusk", n=2, size="64x64", extra_body={"seed": 5, "num_inference_steps": 3}
    )
    assert plain.data is not None and len(plain.data) == 2
    first, second = (np.asarray(_image(d.b64_json or "")) for d in plain.data)
    assert first.shape == (64, 64, 3) and not np.array_equal(first, second)  # seeds 5 and 6
    again = client.images.generate(
        prompt="a lighthouse at dusk", n=1, size="64x64", extra_body={"seed": 5, "num_inference_steps": 3}
    )
    assert np.array_equal(np.asarray(_image(again.data[0].b64_json or "")), first)  # type: ignore[index]

    events = list(
        client.images.generate(
            prompt="a lighthouse at dusk",
            size="64x64",
            stream=True,
            partial_images=2,
            extra_body={"seed": 5, "num_inference_steps": 4},
        )
    )
    kinds = [e.type for e in events]
    assert kinds == ["image_generation.partial_image"] * 2 + ["image_generation.completed"], kinds
    assert _image(events[-1].b64_json).size == (64, 64)  # type: ignore[union-attr]


def test_a_video_job_runs_to_a_playable_mp4_beside_a_chat_reply(server: str) -> None:
    async def main() -> tuple[object, bytes, str]:
        client = AsyncOpenAI(api_key="k", base_url=server + "/v1", max_retries=0)
        job = await client.videos.create(
            prompt="waves on a beach",
            size="64x64",  # type: ignore[arg-type]
            extra_body={"num_frames": 9, "num_inference_steps": 3, "seed": 2},
        )
        chat = await client.chat.completions.create(
            model="demo-qwen3-omni", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        done = await client.videos.poll(job.id, poll_interval_ms=200)
        content = await client.videos.download_content(done.id)
        return done, await content.aread(), chat.choices[0].message.content or ""

    done, mp4, reply = asyncio.run(main())
    assert done.status == "completed" and done.progress == 100, done  # type: ignore[attr-defined]
    assert reply
    with av.open(io.BytesIO(mp4)) as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
    assert stream.codec_context.name == "h264" and len(frames) == 9 and frames[0].shape == (64, 64, 3)
