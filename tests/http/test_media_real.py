"""``/v1/images/generations`` and ``/v1/videos`` on the real diffusion runtime (the embedded demo's
tiny random-weight Z-Image and Wan, as ``omnirt serve`` runs them) through a real server on
loopback: what the fakes of the other tests cannot show (the usage the model's encoder counts, the
seeds its generators take)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from omnirt.realtime.app import create_app
from omnirt.realtime.config import ServerConfig
from omnirt.stages.diffusion.pipeline import DiffusionPipeline
from omnirt.stages.diffusion.wan import WanDenoiser
from omnirt.stages.diffusion.wan_demo import ensure_wan_demo
from omnirt.stages.diffusion.wan_loader import load_wan
from omnirt.stages.diffusion.zimage import ZImageDenoiser
from omnirt.stages.diffusion.zimage_demo import build_tiny_zimage
from omnirt.stages.diffusion.zimage_loader import load_zimage
from omnirt.stages.engine import Engine, EngineClient

from tests.fakes import EchoPipeline
from tests.server import serve

from .conftest import wait_for

SIZE = "32x32"


@dataclass
class Real:
    http: httpx.Client
    image: ZImageDenoiser
    video: WanDenoiser


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Real]:
    folder: Path = tmp_path_factory.mktemp("demo-models")
    build_tiny_zimage(folder / "z-image")
    image = load_zimage(folder / "z-image", device="cpu")
    video = load_wan(ensure_wan_demo(folder / "cache"), device="cpu")
    engine = Engine([EchoPipeline(), DiffusionPipeline(image), DiffusionPipeline(video)])
    app = create_app(EngineClient(engine), ServerConfig(vad_preload=False))
    with serve(app) as base_url, httpx.Client(base_url=base_url, timeout=60) as http:
        yield Real(http, image, video)


def _image(real: Real, **fields: object) -> httpx.Response:
    body = {"prompt": "a red kite over the sea", "size": SIZE, "num_inference_steps": 1, **fields}
    return real.http.post("/v1/images/generations", json=body)


def test_image_usage_counts_the_prompt_tokens_the_encoder_read(real: Real) -> None:
    short, long = "a kite", "a red kite over the sea at dawn, seen from a small boat"
    plain = _image(real, prompt=short)
    longer = _image(real, prompt=long, n=2)
    streamed = _image(real, prompt=long, stream=True, partial_images=1)
    assert plain.status_code == longer.status_code == streamed.status_code == 200, plain.text
    expected = real.image.count_tokens([short, long])
    assert 0 < expected[0] < expected[1]
    for response, tokens in ((plain, expected[0]), (longer, expected[1])):
        usage = response.json()["usage"]
        assert usage["input_tokens"] == usage["input_tokens_details"]["text_tokens"] == tokens
        assert usage["total_tokens"] == tokens and usage["output_tokens"] == 0
    events = [json.loads(block.split("data: ", 1)[1]) for block in streamed.text.strip().split("\n\n")]
    done = [e for e in events if e["type"] == "image_generation.completed"]
    assert len(done) == 1 and done[0]["usage"]["input_tokens"] == expected[1]


def test_the_documented_largest_seed_is_served(real: Real) -> None:
    """docs/http.md: ``seed`` 0 to 2^64 - 1 (``torch.Generator``'s range); the rows of ``n`` images
    take ``seed + i`` wrapping past the top."""
    top = 2**64 - 1
    images = _image(real, seed=top, n=2)
    again = _image(real, seed=top, n=2)
    wrapped = _image(real, seed=0)  # row 1 of the above: seed top + 1 = 0
    assert images.status_code == again.status_code == wrapped.status_code == 200, images.text
    first, second = (d["b64_json"] for d in images.json()["data"])
    assert first != second and [d["b64_json"] for d in again.json()["data"]] == [first, second]
    assert wrapped.json()["data"][0]["b64_json"] == second
    created = real.http.post(
        "/v1/videos",
        json={"prompt": "waves", "size": SIZE, "num_inference_steps": 1, "num_frames": 5, "seed": top},
    )
    assert created.status_code == 200, created.text
    video_id = created.json()["id"]
    assert wait_for(lambda: real.http.get(f"/v1/videos/{video_id}").json()["status"] == "completed", 60)
