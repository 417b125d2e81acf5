"""Loading Z-Image: the embedded default through the factory, ``load_format="dummy"`` from
component configs alone, and folders that are not Z-Image."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from omnirt.stages.diffusion.factory import build_image_pipeline
from omnirt.stages.diffusion.pipeline import DiffusionPipeline
from omnirt.stages.diffusion.types import GeneratedImage, ImageRequest
from omnirt.stages.diffusion.wan_demo import ensure_wan_demo
from omnirt.stages.diffusion.zimage_demo import (
    SCHEDULER_CONFIG,
    TRANSFORMER_CONFIG,
    VAE_CONFIG,
    text_encoder_config,
)
from omnirt.stages.diffusion.zimage_loader import load_zimage

from .conftest import pixels, run_to_end


def _one_image(pipeline: DiffusionPipeline, size: int = 32) -> bytes:
    request = ImageRequest("x", "a lamp", width=size, height=size, num_inference_steps=2, seed=0)
    out = run_to_end(pipeline, [request])["x"]
    return next(o.png for o in out if isinstance(o, GeneratedImage))


def test_the_embedded_default_is_built_once_and_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMNIRT_CACHE", str(tmp_path))
    pipeline = build_image_pipeline(None, device="cpu")
    assert pipeline.kind == "image"
    assert pipeline.info.id == "demo-z-image" and pipeline.info.random_weights
    (folder,) = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert json.loads((folder / "model_index.json").read_text())["_class_name"] == "ZImagePipeline"
    stamp = os.stat(folder / "omnirt_demo.json").st_mtime_ns
    again = build_image_pipeline("demo", device="cpu")
    assert os.stat(folder / "omnirt_demo.json").st_mtime_ns == stamp  # reused, not rebuilt
    assert pixels(_one_image(again)).shape == (32, 32, 3)
    assert (again.denoiser.defaults.width, again.denoiser.defaults.num_inference_steps) == (256, 8)


def _components(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.components.json"
    path.write_text(
        json.dumps(
            {
                "transformer": {"_class_name": "ZImageTransformer2DModel", **TRANSFORMER_CONFIG},
                "text_encoder": {"architectures": ["Qwen3ForCausalLM"], **text_encoder_config(300)},
                "vae": {"_class_name": "AutoencoderKL", **VAE_CONFIG},
                "scheduler": {"_class_name": "FlowMatchEulerDiscreteScheduler", **SCHEDULER_CONFIG},
                "defaults": {"num_inference_steps": 4, "guidance_scale": 0.0, "size": "64x48"},
            }
        )
    )
    return path


def test_dummy_weights_from_component_configs_are_seeded(tmp_path: Path) -> None:
    path = _components(tmp_path)
    first = load_zimage(path, load_format="dummy", seed=3)
    same = load_zimage(path, load_format="dummy", seed=3)
    other = load_zimage(path, load_format="dummy", seed=4)
    w = [d.transformer.layers[0].attention.to_q.weight for d in (first, same, other)]
    assert torch.equal(w[0], w[1]) and not torch.equal(w[0], w[2])
    assert first.info.random_weights
    d = first.defaults
    assert (d.width, d.height, d.num_inference_steps) == (64, 48, 4)
    png_first = _one_image(DiffusionPipeline(first))
    assert png_first == _one_image(DiffusionPipeline(same))
    with pytest.raises(ValueError, match="load_format='dummy'"):
        load_zimage(path)


def test_folders_that_are_not_z_image_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such file or folder"):
        build_image_pipeline(str(tmp_path / "missing"), device="cpu")
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    with pytest.raises(
        ValueError, match="holds a 'FluxPipeline' pipeline; served here: ZImagePipeline, WanPipeline"
    ):
        build_image_pipeline(str(tmp_path), device="cpu")
    with pytest.raises(ValueError, match="makes videos"):
        build_image_pipeline(str(ensure_wan_demo()), device="cpu")
    with pytest.raises(ValueError, match="unknown load format"):
        load_zimage(tmp_path, load_format="gguf")


MODELS = Path(__file__).resolve().parents[2] / "benchmarks" / "models"
PUBLISHED = MODELS / "z-image-turbo" / "z-image-turbo.components.json"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_size_random_z_image_turbo_on_the_gpu() -> None:
    path = Path(os.environ.get("OMNIRT_ZIMAGE_COMPONENTS", PUBLISHED))
    if not path.is_file():
        pytest.skip(f"no published component configs at {path}")
    pipeline = build_image_pipeline(str(path), device="cuda", load_format="dummy")
    request = ImageRequest("big", "a city at night", num_inference_steps=8, seed=0)
    out = run_to_end(pipeline, [request])["big"]
    image = next(o for o in out if isinstance(o, GeneratedImage))
    assert (image.width, image.height) == (1024, 1024)
    assert pixels(image.png).shape == (1024, 1024, 3)
