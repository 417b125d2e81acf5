"""``omnirt serve --quantization int8``: the real CLI in a process of its own, its embedded image
and video transformers W8A8 (``stages/diffusion/quant.py``), reported per model in ``/v1/models``
and generating through the official SDK."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from openai import OpenAI
from PIL import Image

from tests.server import serve_cli


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("log") / "serve.log"
    args = ["--device", "cpu", "--max-sessions", "1", "--quantization", "int8"]
    with serve_cli(args, cache=tmp_path_factory.mktemp("cache"), log=log) as base:
        yield base
    text = log.read_text()
    assert "linear layers in int8" in text and "Traceback" not in text, text[-3000:]


def test_models_report_their_quantization_and_images_come_out(server: str) -> None:
    listed = httpx.get(server + "/v1/models", headers={"Authorization": "Bearer k"}).json()["data"]
    quantization = {m["id"]: m["quantization"] for m in listed}
    assert quantization == {
        "demo-qwen3-omni": "none",
        "demo-moshi": "none",  # --quantization is for the diffusion transformers
        "demo-z-image": "int8",
        "demo-wan2.1-t2v": "int8",
    }
    client = OpenAI(api_key="k", base_url=server + "/v1", max_retries=0)
    out = client.images.generate(
        prompt="a lighthouse at dusk", size="64x64", extra_body={"seed": 5, "num_inference_steps": 2}
    )
    image = Image.open(io.BytesIO(base64.b64decode(out.data[0].b64_json or "")))  # type: ignore[index]
    assert np.asarray(image.convert("RGB")).shape == (64, 64, 3)
