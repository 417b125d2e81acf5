"""Our Z-Image denoiser in the runtime against diffusers' ZImagePipeline on the same tiny weights,
seeds and inputs: the final images agree to within uint8 rounding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from omnirt.stages.diffusion.pipeline import DiffusionPipeline
from omnirt.stages.diffusion.types import GeneratedImage, ImageRequest, Progress
from omnirt.stages.diffusion.zimage import ZImageDenoiser

from .conftest import pixels, run_to_end

SIZE = 64
STEPS = 3


@pytest.fixture(scope="module")
def reference(zimage_dir: Path):  # type: ignore[no-untyped-def]
    from diffusers import ZImagePipeline

    return ZImagePipeline.from_pretrained(str(zimage_dir))


def _diffusers(reference, prompts, seeds, guidance, negative=None, n=1, size=SIZE):  # type: ignore[no-untyped-def]
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    out = reference(
        prompts,
        height=size,
        width=size,
        num_inference_steps=STEPS,
        guidance_scale=guidance,
        negative_prompt=negative,
        num_images_per_prompt=n,
        generator=generators,
        output_type="np",
    )
    return out.images  # float [rows, H, W, 3] in [0, 1]


def _ours(pipeline: DiffusionPipeline, requests: list[ImageRequest]) -> dict[str, np.ndarray]:
    out = run_to_end(pipeline, requests)
    images = {}
    for rid, outputs in out.items():
        progress = [o.done for o in outputs if isinstance(o, Progress)]
        assert progress == list(range(1, STEPS + 1))
        got = [o for o in outputs if isinstance(o, GeneratedImage)]
        assert [g.index for g in got] == list(range(len(got)))
        assert all((g.width, g.height) == (SIZE, SIZE) for g in got)
        images[rid] = np.stack([pixels(g.png) for g in got]).astype(np.float32) / 255
    return images


def _close(ours: np.ndarray, theirs: np.ndarray) -> None:
    assert ours.shape == theirs.shape
    # uint8 rounding is 0.5/255; the rest is float noise (batch padding, separate CFG calls).
    np.testing.assert_allclose(ours, theirs, atol=1.01 / 255, rtol=0)


@pytest.mark.parametrize("guidance", [0.0, 4.0])
def test_one_image_matches_diffusers(denoiser: ZImageDenoiser, reference, guidance: float) -> None:  # type: ignore[no-untyped-def]
    request = ImageRequest(
        "a",
        "a red fox in snow",
        width=SIZE,
        height=SIZE,
        num_inference_steps=STEPS,
        guidance_scale=guidance,
        seed=7,
        negative_prompt="blurry" if guidance else None,
    )
    ours = _ours(DiffusionPipeline(denoiser), [request])["a"]
    theirs = _diffusers(
        reference, "a red fox in snow", [7], guidance, negative="blurry" if guidance else None
    )
    _close(ours, theirs)
    # The comparison can fail: another seed gives another image.
    other = _diffusers(reference, "a red fox in snow", [8], guidance, negative="blurry" if guidance else None)
    assert np.abs(other - theirs).max() > 0.05


def test_guidance_changes_the_image(denoiser: ZImageDenoiser) -> None:
    base = dict(prompt="a boat", width=SIZE, height=SIZE, num_inference_steps=STEPS, seed=3)
    images = _ours(
        DiffusionPipeline(denoiser),
        [ImageRequest("plain", guidance_scale=0.0, **base), ImageRequest("cfg", guidance_scale=5.0, **base)],
    )
    assert np.abs(images["plain"] - images["cfg"]).max() > 0.05


def test_n_images_match_diffusers_with_a_generator_per_image(denoiser: ZImageDenoiser, reference) -> None:  # type: ignore[no-untyped-def]
    request = ImageRequest(
        "n", "two cats", n=2, width=SIZE, height=SIZE, num_inference_steps=STEPS, guidance_scale=3.0, seed=11
    )
    pipeline = DiffusionPipeline(denoiser)
    ours = _ours(pipeline, [request])["n"]
    theirs = _diffusers(reference, "two cats", [11, 12], 3.0, n=2)
    _close(ours, theirs)
    # Both images ran in one call per branch: 2 rows cond, 2 rows uncond, each step.
    assert pipeline.calls["transformer", 2] == 2 * STEPS


def test_two_requests_share_transformer_calls_and_match_diffusers(
    denoiser: ZImageDenoiser, reference
) -> None:  # type: ignore[no-untyped-def]
    prompts = ["a lighthouse at dusk", "an orange"]
    requests = [
        ImageRequest(
            f"r{i}", p, width=SIZE, height=SIZE, num_inference_steps=STEPS, guidance_scale=2.0, seed=20 + i
        )
        for i, p in enumerate(prompts)
    ]
    pipeline = DiffusionPipeline(denoiser)
    ours = _ours(pipeline, requests)
    theirs = _diffusers(reference, prompts, [20, 21], 2.0)
    _close(np.concatenate([ours["r0"], ours["r1"]]), theirs)
    assert pipeline.calls["transformer", 2] == 2 * STEPS  # both prompts in every call
    assert sum(n for (name, _), n in pipeline.calls.items() if name == "transformer") == 2 * STEPS
    assert pipeline.calls["text_encoder", 3] == 1  # two prompts and the shared empty negative, once


def test_mixed_guidance_only_guided_rows_take_the_uncond_branch(denoiser: ZImageDenoiser, reference) -> None:  # type: ignore[no-untyped-def]
    base = dict(width=SIZE, height=SIZE, num_inference_steps=STEPS, seed=5)
    requests = [ImageRequest("g", "a tree", guidance_scale=4.0, **base), ImageRequest("u", "a tree", **base)]
    pipeline = DiffusionPipeline(denoiser)
    ours = _ours(pipeline, requests)
    assert pipeline.calls["transformer", 2] == STEPS and pipeline.calls["transformer", 1] == STEPS
    _close(ours["g"], _diffusers(reference, "a tree", [5], 4.0))
    _close(ours["u"], _diffusers(reference, "a tree", [5], 0.0))
