"""Step caches through a real server on loopback: ``cache_backend`` / ``cache_config`` on
``/v1/images/generations`` (the tiny Z-Image) and ``/v1/videos`` (validation), the 400s, and the
server defaults of ``omnirt serve`` (``--step-cache``)."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import pytest
from omnirt.realtime.app import create_app
from omnirt.realtime.build import _configure_step_caches
from omnirt.realtime.cli import STEP_CACHES, build_parser, config_from_args
from omnirt.realtime.config import ServerConfig
from omnirt.stages.diffusion.cache.calibration import CalibrationStore, save
from omnirt.stages.diffusion.cache.config import BACKENDS
from omnirt.stages.diffusion.cache.state import StepCaches
from omnirt.stages.diffusion.pipeline import DiffusionPipeline
from omnirt.stages.diffusion.zimage import ZImageDenoiser
from omnirt.stages.engine import Engine, EngineClient
from PIL import Image

from tests.diffusion_fakes import FakeVideoPipeline
from tests.fakes import EchoPipeline
from tests.server import serve

from .step_cache_util import store_for


@dataclass
class Served:
    http: httpx.Client
    image: DiffusionPipeline


@pytest.fixture(scope="module")
def served(denoiser: ZImageDenoiser) -> Iterator[Served]:
    full = store_for(denoiser)
    only_mag = CalibrationStore([c for c in [full.find("magcache", denoiser.family, _fp(denoiser))] if c])
    image = DiffusionPipeline(denoiser, step_cache=StepCaches(denoiser, store=only_mag))
    engine = Engine([EchoPipeline(), image, FakeVideoPipeline()])
    app = create_app(EngineClient(engine), ServerConfig(vad_preload=False))
    with serve(app) as base_url, httpx.Client(base_url=base_url, timeout=60) as http:
        yield Served(http, image)


def _fp(den: Any) -> str:
    from omnirt.stages.diffusion.cache.calibration import fingerprint

    return fingerprint(den.transformer)


def _generate(s: Served, **extra: Any) -> httpx.Response:
    body = {"prompt": "a blue kite", "size": "64x64", "num_inference_steps": 8, "seed": 5, **extra}
    return s.http.post("/v1/images/generations", json=body)


def _pixels(response: httpx.Response) -> np.ndarray:
    data = base64.b64decode(response.json()["data"][0]["b64_json"])
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def test_images_with_magcache_skip_steps_and_threshold_zero_changes_nothing(served: Served) -> None:
    plain = _generate(served)
    assert plain.status_code == 200, plain.text
    before = served.image.calls["transformer_skipped", 1]
    cached = _generate(served, cache_backend="magcache", cache_config={"threshold": 0.5, "max_skip_steps": 2})
    assert cached.status_code == 200, cached.text
    assert served.image.calls["transformer_skipped", 1] - before == 4  # steps 2, 3, 5, 6 of 8
    zero = _generate(served, cache_backend="magcache", cache_config={"threshold": 0})
    np.testing.assert_array_equal(_pixels(zero), _pixels(plain))
    assert served.image.calls["transformer_skipped", 1] - before == 4


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"cache_backend": "fast"}, "cache_backend", "Input should be 'none', 'teacache' or 'magcache'"),
        (
            {"cache_backend": "magcache", "cache_config": {"max_skip": 1}},
            "cache_config",
            "not a magcache setting",
        ),
        ({"cache_backend": "magcache", "cache_config": {"threshold": -1}}, "cache_config", "from 0 to"),
        ({"cache_backend": "magcache", "cache_config": "x"}, "cache_config", "should be an object"),
        ({"cache_backend": "teacache"}, None, "omnirt calibrate teacache --model"),
    ],
)
def test_bad_cache_options_are_400s(served: Served, extra: dict, param: str | None, message: str) -> None:
    response = _generate(served, **extra)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"]
    if param is not None:
        assert error["param"] == param


def test_videos_take_cache_options_from_forms_and_json(served: Served) -> None:
    form = {"prompt": "waves", "cache_backend": "magcache", "cache_config": '{"max_skip_steps": -1}'}
    response = served.http.post("/v1/videos", data=form)
    assert response.status_code == 400 and response.json()["error"]["param"] == "cache_config"
    response = served.http.post("/v1/videos", data={**form, "cache_config": "{not json"})
    assert response.status_code == 400 and "JSON object" in response.json()["error"]["message"]
    response = served.http.post("/v1/videos", json={"prompt": "waves", "cache_backend": "teacache"})
    assert response.status_code == 200, response.text  # the fake video model takes any options


def test_serve_options_set_the_defaults_and_load_calibration_files(
    denoiser: ZImageDenoiser, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    assert STEP_CACHES == BACKENDS
    store = store_for(denoiser)
    path = tmp_path / "tea.json"
    save(store.find("teacache", denoiser.family, _fp(denoiser)), path)  # type: ignore[arg-type]
    argv = ["serve", "--step-cache", "teacache", "--step-cache-config", '{"threshold": 0.2}']
    pipeline = DiffusionPipeline(denoiser, step_cache=StepCaches(denoiser, store=CalibrationStore()))
    with pytest.raises(ValueError, match="no teacache calibration"):
        _configure_step_caches([pipeline], config_from_args(build_parser().parse_args(argv), {}))
    config = config_from_args(build_parser().parse_args([*argv, "--step-cache-calibration", str(path)]), {})
    _configure_step_caches([pipeline], config)
    prep = pipeline.prepare(pipeline._request_type("r", "a cat", width=32, height=32))
    assert prep.cache is not None and prep.cache.tea is not None and prep.cache.tea.threshold == 0.2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--step-cache-config", "[1]"])
