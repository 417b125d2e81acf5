"""The Wan2.1 T2V denoiser against diffusers' WanPipeline on the tiny embedded demo folder.

The loop in :func:`run` is what the shared runtime does with a denoiser: encode, init_latents,
for every step the conditional (and, when guided, unconditional) prediction, guide, sampler.step,
then decode.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import json  # noqa: E402
import math  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from omnirt.stages.diffusion.denoiser import Shape  # noqa: E402
from omnirt.stages.diffusion.types import ImageRequest, VideoRequest  # noqa: E402
from omnirt.stages.diffusion.wan import WanDenoiser, WanLimits  # noqa: E402
from omnirt.stages.diffusion.wan_demo import (  # noqa: E402
    TEXT_ENCODER_CONFIG,
    TRANSFORMER_CONFIG,
    VAE_CONFIG,
    build_wan_demo,
    ensure_wan_demo,
)
from omnirt.stages.diffusion.wan_loader import WanLoadError, load_wan  # noqa: E402
from omnirt.stages.pipeline import RequestRejected  # noqa: E402

torch.set_num_threads(1)

SIZE = {"width": 32, "height": 32, "num_frames": 5}
#: The published Wan2.1 T2V component configs (copied from ``shared/models`` into the repository).
PUBLISHED = Path(__file__).resolve().parents[2] / "benchmarks/models/wan2.1-t2v/wan2.1-t2v.components.json"
STEPS = 3


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_wan_demo(tmp_path_factory.mktemp("omnirt-cache"))


@pytest.fixture(scope="module")
def denoiser(wan_dir: Path) -> WanDenoiser:
    return load_wan(wan_dir, device="cpu")


@pytest.fixture(scope="module")
def reference(wan_dir: Path):
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(wan_dir))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def gens(seeds: Sequence[int]) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(s) for s in seeds]


def run(
    den: WanDenoiser,
    prompts: Sequence[str],
    negatives: Sequence[str],
    scales: Sequence[float],
    seeds: Sequence[int],
    steps: int = STEPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The runtime's loop over one batch of rows: (final latents, uint8 frames)."""
    shape = den.check(VideoRequest(request_id="r", prompt=prompts[0], num_inference_steps=steps, **SIZE))
    guided = [den.uses_guidance(s) for s in scales]
    assert len(set(guided)) == 1, "a batch is all guided or all not"
    cond = den.encode(prompts)
    uncond = den.encode(negatives) if guided[0] else None
    latents = den.init_latents(shape, gens(seeds))
    sampler = den.sampler(shape, steps)
    for i in range(len(sampler.timesteps)):
        pred = den.predict(latents, i, sampler, cond, "cond")
        if uncond is not None:
            pred_u = den.predict(latents, i, sampler, uncond, "uncond")
            pred = den.guide(pred, pred_u, torch.tensor(scales, dtype=torch.float32))
        latents = sampler.step(pred, i, latents)
    return latents, den.decode(latents)


def diffusers_run(pipe, prompts, negative, scale, seeds, steps: int = STEPS):
    kwargs = dict(
        prompt=list(prompts),
        negative_prompt=negative,
        num_inference_steps=steps,
        guidance_scale=scale,
        **SIZE,
    )
    latents = pipe(generator=gens(seeds), output_type="latent", **kwargs).frames
    frames = pipe(generator=gens(seeds), output_type="np", **kwargs).frames
    return latents, frames


@pytest.mark.parametrize("scale", [1.0, 5.0], ids=["no-cfg", "cfg"])
@pytest.mark.parametrize("prompts", [["a red cat walking"], ["a red cat walking", "the blue sea, at night"]])
def test_parity_with_wan_pipeline(denoiser: WanDenoiser, reference, prompts: list[str], scale: float) -> None:
    negative = "blurry, static"
    seeds = [7 + i for i in range(len(prompts))]
    latents, frames = run(denoiser, prompts, [negative] * len(prompts), [scale] * len(prompts), seeds)
    ref_latents, ref_frames = diffusers_run(reference, prompts, negative, scale, seeds)
    assert latents.shape == ref_latents.shape == (len(prompts), 16, 2, 4, 4)
    torch.testing.assert_close(latents, ref_latents, rtol=1e-5, atol=1e-5)
    assert frames.dtype == torch.uint8 and frames.shape == (len(prompts), 5, 32, 32, 3)
    ours = frames.numpy().astype(np.int16)
    theirs = np.round(ref_frames * 255).astype(np.int16)
    assert np.abs(ours - theirs).max() <= 1
    assert ours.std() > 5, "the frames are not flat"
    if len(prompts) == 2:
        assert not np.array_equal(ours[0], ours[1])


def test_guidance_changes_the_result_and_negative_prompt_matters(denoiser: WanDenoiser) -> None:
    plain, _ = run(denoiser, ["a cat"], [""], [1.0], [3])
    guided, _ = run(denoiser, ["a cat"], [""], [5.0], [3])
    other_neg, _ = run(denoiser, ["a cat"], ["a dog"], [5.0], [3])
    assert not torch.allclose(plain, guided)
    assert not torch.allclose(guided, other_neg)


def test_rows_with_different_scales_match_their_single_runs(denoiser: WanDenoiser, reference) -> None:
    prompts, scales, seeds = ["a cat", "a dog"], [5.0, 2.5], [11, 12]
    latents, _ = run(denoiser, prompts, ["", ""], scales, seeds)
    for i in range(2):
        single, _ = diffusers_run(reference, [prompts[i]], "", scales[i], [seeds[i]])
        torch.testing.assert_close(latents[i : i + 1], single, rtol=1e-4, atol=1e-4)


def test_uses_guidance_follows_the_pipeline(denoiser: WanDenoiser) -> None:
    assert not denoiser.uses_guidance(0.0)
    assert not denoiser.uses_guidance(1.0)
    assert denoiser.uses_guidance(1.5)


def test_sampler_is_per_batch_and_steps_in_order(denoiser: WanDenoiser) -> None:
    shape = Shape(width=32, height=32, frames=5)
    a, b = denoiser.sampler(shape, 3), denoiser.sampler(shape, 3)
    assert a.scheduler is not b.scheduler
    torch.testing.assert_close(a.timesteps, b.timesteps)
    latents = denoiser.init_latents(shape, gens([0]))
    pred = torch.zeros_like(latents)
    with pytest.raises(ValueError, match="step 0"):
        a.step(pred, 1, latents)
    a.step(pred, 0, latents)
    with pytest.raises(ValueError, match="step 1"):
        a.step(pred, 0, latents)
    assert b.scheduler.step_index is None  # untouched by a's steps


def test_init_latents_draw_each_row_from_its_generator(denoiser: WanDenoiser) -> None:
    shape = Shape(width=32, height=48, frames=9)
    both = denoiser.init_latents(shape, gens([1, 2]))
    assert both.shape == (2, 16, 3, 6, 4) and both.dtype == torch.float32
    torch.testing.assert_close(both[1:], denoiser.init_latents(shape, gens([2])), rtol=0, atol=0)


def test_encode_zeroes_past_the_prompt(denoiser: WanDenoiser) -> None:
    short, long = denoiser.encode(["cat", "a cat  and   a dog on the sea"])
    assert short.shape == long.shape == (512, 32)
    n_short = int((short.abs().sum(-1) > 0).sum())
    n_long = int((long.abs().sum(-1) > 0).sum())
    assert 1 < n_short < n_long < 20
    assert short[n_short:].abs().sum() == 0
    # The pipeline's cleaning: whitespace runs collapse, HTML entities unescape.
    torch.testing.assert_close(denoiser.encode(["  a &amp; b  "])[0], denoiser.encode(["a & b"])[0])


def test_preview_is_the_first_frame(denoiser: WanDenoiser) -> None:
    shape = Shape(width=32, height=32, frames=9)
    latents = denoiser.init_latents(shape, gens([5]))
    preview = denoiser.preview(latents)
    assert preview.shape == (1, 1, 32, 32, 3) and preview.dtype == torch.uint8
    assert torch.equal(preview[:, 0], denoiser.decode(latents)[:, 0])


def video(**kw) -> VideoRequest:
    return VideoRequest(request_id="r", prompt=kw.pop("prompt", "a cat"), **kw)


def test_check_fills_defaults_and_rounds_frames_as_diffusers(denoiser: WanDenoiser) -> None:
    d = denoiser.defaults
    assert denoiser.check(video()) == Shape(width=d.width, height=d.height, frames=d.num_frames)
    assert (d.width, d.height, d.num_frames, d.fps) == (64, 64, 17, 16)
    for asked, made in [(1, 1), (5, 5), (8, 9), (10, 9), (12, 13), (17, 17)]:
        assert denoiser.check(video(num_frames=asked)).frames == made
        assert denoiser.round_frames(asked) == made
    assert denoiser.check(video(width=48, height=16)) == Shape(width=48, height=16, frames=17)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"width": 30}, "width must be a positive multiple of 16"),
        ({"height": 0}, "height must be a positive multiple of 16"),
        ({"width": 512}, "over this server's limit of 256"),
        ({"width": "32"}, "width must be an integer"),
        ({"num_frames": 0}, "num_frames must be at least 1"),
        ({"num_frames": 69}, "num_frames 69 is over this server's limit of 65"),
        ({"num_inference_steps": 0}, "num_inference_steps must be between 1 and 50"),
        ({"num_inference_steps": 51}, "num_inference_steps must be between 1 and 50"),
        ({"guidance_scale": -1.0}, "guidance_scale must be between 0 and 30"),
        ({"guidance_scale": math.nan}, "guidance_scale must be a number"),
        ({"fps": 0}, "fps must be between 1 and 60"),
        ({"prompt": "   "}, "prompt must be a non-empty string"),
        ({"negative_prompt": 3}, "negative_prompt must be a string"),
    ],
)
def test_bad_requests_are_rejected(denoiser: WanDenoiser, fields: dict, message: str) -> None:
    with pytest.raises(RequestRejected, match=message):
        denoiser.check(video(**fields))


def test_images_and_out_of_range_positions_are_rejected(
    denoiser: WanDenoiser, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(RequestRejected, match="generates videos, not images"):
        denoiser.check(ImageRequest(request_id="r", prompt="a cat"))
    monkeypatch.setattr(denoiser, "limits", WanLimits(max_width=4096))
    with pytest.raises(RequestRejected, match="beyond the model's position range"):
        denoiser.check(video(width=2048, height=32))


def test_demo_is_deterministic_and_marked(tmp_path: Path, wan_dir: Path) -> None:
    build_wan_demo(tmp_path / "again")
    for path in sorted(p for p in wan_dir.rglob("*") if p.is_file()):
        assert path.read_bytes() == (tmp_path / "again" / path.relative_to(wan_dir)).read_bytes(), path
    marker = json.loads((wan_dir / "omnirt_demo.json").read_text())
    assert marker["random_weights"] is True
    index = json.loads((wan_dir / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline"
    assert index["scheduler"] == ["diffusers", "UniPCMultistepScheduler"]
    assert ensure_wan_demo(wan_dir.parent) == wan_dir  # cached: found, not rebuilt


def test_loaded_info(denoiser: WanDenoiser, wan_dir: Path) -> None:
    assert denoiser.family == "wan" and denoiser.output == "video"
    assert denoiser.info.architecture == "WanPipeline"
    assert denoiser.info.random_weights is True
    assert denoiser.info.source == str(wan_dir)
    assert denoiser.dtype == torch.float32 and denoiser.device.type == "cpu"


def tiny_components(path: Path) -> Path:
    """A components file shaped like the published ``wan2.1-t2v.components.json``, at toy size."""
    data = {
        "transformer_tiny": {"_class_name": "WanTransformer3DModel", **TRANSFORMER_CONFIG},
        "text_encoder": TEXT_ENCODER_CONFIG,
        "vae": {"_class_name": "AutoencoderKLWan", **VAE_CONFIG},
        "defaults": {"num_inference_steps": 2, "guidance_scale": 4.0, "size": "48x32", "num_frames": 5},
    }
    path.write_text(json.dumps(data))
    return path


def test_dummy_load_from_a_components_file(tmp_path: Path) -> None:
    path = tiny_components(tmp_path / "wan.components.json")
    den = load_wan(path, load_format="dummy", device="cpu", seed=3)
    again = load_wan(path, load_format="dummy", device="cpu", seed=3)
    other = load_wan(path, load_format="dummy", device="cpu", seed=4)
    assert den.info.random_weights is True and den.info.id == "wan.components"
    assert (den.defaults.width, den.defaults.height, den.defaults.num_frames) == (48, 32, 5)
    assert den.defaults.num_inference_steps == 2 and den.defaults.guidance_scale == 4.0
    assert den.scheduler_config["_class_name"] == "UniPCMultistepScheduler"
    w = den.transformer.blocks[0].attn1.to_q.weight
    assert torch.equal(w, again.transformer.blocks[0].attn1.to_q.weight)
    assert not torch.equal(w, other.transformer.blocks[0].attn1.to_q.weight)
    _, frames = run(den, ["a cat"], [""], [4.0], [0], steps=2)
    assert frames.shape == (1, 5, 32, 32, 3)
    with pytest.raises(WanLoadError, match="no 'transformer_14b'"):
        load_wan(path, load_format="dummy", device="cpu", variant="14b")


def test_dummy_load_from_a_folder_ignores_its_weights(wan_dir: Path, denoiser: WanDenoiser) -> None:
    den = load_wan(wan_dir, load_format="dummy", device="cpu", seed=1)
    ours = den.transformer.blocks[0].attn1.to_q.weight
    assert ours.shape == denoiser.transformer.blocks[0].attn1.to_q.weight.shape
    assert not torch.equal(ours, denoiser.transformer.blocks[0].attn1.to_q.weight)
    assert den.defaults == denoiser.defaults  # the demo marker's


def test_published_components_file_parses() -> None:
    from omnirt.stages.diffusion.wan_loader import _components_file

    if not PUBLISHED.is_file():
        pytest.skip("the published components file is not on this machine")
    configs, defaults = _components_file(PUBLISHED, "1.3b")
    assert configs["transformer"]["num_layers"] == 30 and configs["text_encoder"]["d_model"] == 4096
    assert (defaults.width, defaults.height, defaults.num_frames, defaults.num_inference_steps) == (
        832,
        480,
        81,
        50,
    )
    configs, _ = _components_file(PUBLISHED, "14b")
    assert configs["transformer"]["num_layers"] == 40


def test_load_errors(tmp_path: Path, wan_dir: Path) -> None:
    with pytest.raises(WanLoadError, match="no model_index.json"):
        load_wan(tmp_path, device="cpu")
    with pytest.raises(WanLoadError, match="unknown load format"):
        load_wan(wan_dir, load_format="pt", device="cpu")
    other = tmp_path / "other"
    other.mkdir()
    (other / "model_index.json").write_text(json.dumps({"_class_name": "ZImagePipeline"}))
    with pytest.raises(WanLoadError, match="not a WanPipeline"):
        load_wan(other, device="cpu")
    (other / "model_index.json").write_text(
        json.dumps({"_class_name": "WanPipeline", "transformer_2": ["diffusers", "WanTransformer3DModel"]})
    )
    with pytest.raises(WanLoadError, match="Wan2.2"):
        load_wan(other, device="cpu")


def test_demo_video_encodes_to_mp4(denoiser: WanDenoiser) -> None:
    import io

    import av
    from omnirt.stages.diffusion.video_io import encode_mp4

    _, frames = run(denoiser, ["a cat"], [""], [1.0], [0], steps=2)
    data = encode_mp4(frames[0], denoiser.defaults.fps)
    with av.open(io.BytesIO(data)) as container:
        decoded = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(decoded) == 5 and decoded[0].shape == (32, 32, 3)
