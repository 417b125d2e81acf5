"""Our MagCache against diffusers' (``diffusers.hooks.apply_mag_cache``, 0.42) on the same tiny Wan
transformer, ratios, thresholds, seed and prompts, both CFG branches (diffusers keeps a state per
``cache_context`` branch, as we do).

With the same step count and ``compute_last_step`` off, the skip decisions agree step for step
and branch for branch, and the final latents are bitwise the same. Where ours differs, by design:

1. the last step: ours computes it by default (diffusers may skip it);
2. ratios calibrated at another step count: diffusers picks the nearest step's ratio
   (``nearest_interp``), ours resamples the cumulative log-ratio (``resample_ratios``); each
   schedule is exactly the shared skip rule on its resampled ratios;
3. a threshold of 0: diffusers skips where a ratio is exactly 1 (``err <= 0``), ours never skips;
4. Z-Image: diffusers' hook cannot run on ``ZImageTransformerBlock`` (its registry names the
   hidden states ``hidden_states``, the block's argument is ``x``: ``KeyError`` or ``ValueError``);
   ours reads the state the split call holds, so it needs no per-block metadata;
5. precision: diffusers accumulates the ratio and error in float32 tensors (``mag_ratios`` is a
   tensor; reading the decision is a device sync per step on CUDA), ours in float64 on the host,
   so a step whose error lands within float32 rounding of the threshold may go either way (the
   thresholds here stay clear of that).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from omnirt.stages.diffusion.cache.calibration import CalibrationStore, MagCacheCalibration, fingerprint
from omnirt.stages.diffusion.cache.magcache import MagCacheParams, magcache_schedule, resample_ratios
from omnirt.stages.diffusion.cache.state import StepCaches
from omnirt.stages.diffusion.denoiser import Shape
from omnirt.stages.diffusion.pipeline import DiffusionPipeline
from omnirt.stages.diffusion.types import VideoRequest
from omnirt.stages.diffusion.wan import WanDenoiser
from omnirt.stages.diffusion.wan_demo import ensure_wan_demo
from omnirt.stages.diffusion.wan_loader import load_wan
from omnirt.stages.diffusion.zimage import ZImageDenoiser

STEPS, SCALE, SEED = 12, 5.0, 21
SHAPE = Shape(width=32, height=32, frames=5)
PROMPT, NEGATIVE = "a red kite over the sea", "blurry"
RATIOS = [1.0, 1.12, 1.05, 1.02, 1.01, 1.0, 0.995, 0.99, 0.985, 0.98, 0.99, 0.995]
Schedules = dict[str, list[bool]]


@pytest.fixture(scope="module")
def wan(tmp_path_factory: pytest.TempPathFactory) -> WanDenoiser:
    return load_wan(ensure_wan_demo(tmp_path_factory.mktemp("omnirt-cache")), device="cpu")


def diffusers_run(
    den: WanDenoiser, ratios: list[float], threshold: float, k: int, retention: float
) -> tuple[Schedules, torch.Tensor]:
    """The tiny Wan with diffusers' MagCache hooks, stepped as our runtime steps it: per branch the
    skip decisions (True: skipped), and the final latents."""
    from diffusers.hooks import MagCacheConfig, apply_mag_cache

    hooked = copy.copy(den)
    hooked.transformer = copy.deepcopy(den.transformer)
    config = MagCacheConfig(
        threshold=threshold, max_skip_steps=k, retention_ratio=retention, num_inference_steps=STEPS,
        mag_ratios=torch.tensor(ratios),
    )  # fmt: skip
    apply_mag_cache(hooked.transformer, config)
    states = (
        hooked.transformer.blocks[0]._diffusers_hook.get_hook("mag_cache_leader_block_hook").state_manager
    )
    latents = den.init_latents(SHAPE, [torch.Generator().manual_seed(SEED)])
    sampler = den.sampler(SHAPE, STEPS)
    encoded = den.encode([PROMPT, NEGATIVE])  # one encoder call, as the runtime makes it
    cond, uncond = encoded[:1], encoded[1:]
    skipped: Schedules = {"cond": [], "uncond": []}
    for i in range(STEPS):
        c = hooked.predict(latents, i, sampler, cond, "cond")
        skipped["cond"].append(not states._state_cache["cond"].should_compute)
        u = hooked.predict(latents, i, sampler, uncond, "uncond")
        skipped["uncond"].append(not states._state_cache["uncond"].should_compute)
        latents = sampler.step(den.guide(c, u, torch.tensor([SCALE])), i, latents)
    return skipped, latents


def ours(
    den: WanDenoiser, ratios: list[float], config: dict[str, Any]
) -> tuple[Schedules, torch.Tensor, int]:
    """Our runtime with the same ratios for both branches: the schedules it planned, the latents
    after the last step, and the calls it skipped. It runs on a deep copy of the transformer, as
    diffusers' hooks do (a deep copy alone moves the tiny Wan's results by ~1e-6)."""
    den = copy.copy(den)
    den.transformer = copy.deepcopy(den.transformer)
    fp = fingerprint(den.transformer)
    both = {"cond": tuple(ratios), "uncond": tuple(ratios)}
    cal = MagCacheCalibration(den.family, fp, "t", (len(ratios),), {len(ratios): both})
    p = DiffusionPipeline(den, step_cache=StepCaches(den, store=CalibrationStore([cal])))
    request = VideoRequest(
        "r", PROMPT, negative_prompt=NEGATIVE, width=SHAPE.width, height=SHAPE.height,
        num_frames=SHAPE.frames, num_inference_steps=STEPS, guidance_scale=SCALE, seed=SEED,
        cache_backend="magcache", cache_config=config,
    )  # fmt: skip
    prepared = p.prepare(request)
    assert prepared.cache is not None
    schedules = {b: prepared.cache.schedule(STEPS, b) or [] for b in ("cond", "uncond")}
    p.add(request, prepared)
    job = p._jobs["r"]
    while job.stage != "decode":
        p.step()
    assert job.latents is not None
    return schedules, job.latents, p.calls["transformer_skipped", 1]


def test_same_decisions_and_latents_as_diffusers_magcache(wan: WanDenoiser) -> None:
    theirs, their_latents = diffusers_run(wan, RATIOS, 0.057, 2, 0.2)
    config = {"threshold": 0.057, "max_skip_steps": 2, "retention_ratio": 0.2, "compute_last_step": False}
    schedules, our_latents, skipped = ours(wan, RATIOS, config)
    assert sum(theirs["cond"]) >= 3, theirs  # the comparison skips something
    assert schedules == theirs
    assert skipped == sum(theirs["cond"]) + sum(theirs["uncond"])
    assert torch.equal(our_latents, their_latents)


def test_where_ours_differs_last_step_resampling_and_threshold_zero(wan: WanDenoiser) -> None:
    base = MagCacheParams(0.057, 2, 0.2, compute_last_step=False)
    # 1. The last step: diffusers skips it here; ours computes it unless told not to.
    theirs, _ = diffusers_run(wan, RATIOS, 0.057, 2, 0.2)
    assert theirs["cond"][-1]
    mine = magcache_schedule(RATIOS, STEPS, MagCacheParams(0.057, 2, 0.2))
    assert mine[:-1] == theirs["cond"][:-1] and not mine[-1]
    # 2. Ratios calibrated at 7 steps, run at 12.
    from diffusers.hooks.mag_cache import nearest_interp

    short = [1.0, 1.1, 1.03, 1.0, 0.99, 0.98, 0.97]
    theirs, _ = diffusers_run(wan, short, 0.057, 2, 0.2)
    nearest = nearest_interp(torch.tensor(short), STEPS).tolist()
    assert theirs["cond"] == magcache_schedule(nearest, STEPS, base)  # the rule on nearest ratios
    config = {"threshold": 0.057, "max_skip_steps": 2, "retention_ratio": 0.2, "compute_last_step": False}
    schedules, _, _ = ours(wan, short, config)
    assert schedules["cond"] == magcache_schedule(resample_ratios(short, STEPS), STEPS, base)
    assert schedules["cond"] != theirs["cond"]  # the resampling is the whole difference
    assert np.prod(nearest) != pytest.approx(np.prod(short))  # nearest changes the total change
    assert np.prod(resample_ratios(short, STEPS)) == pytest.approx(np.prod(short))
    # 3. Threshold 0 with ratios of exactly 1: diffusers skips (err 0 <= 0), ours never does.
    ones = [1.0] * STEPS
    theirs, _ = diffusers_run(wan, ones, 0.0, 2, 0.2)
    assert any(theirs["cond"])
    assert not any(magcache_schedule(ones, STEPS, MagCacheParams(0.0, 2, 0.2, compute_last_step=False)))


def test_diffusers_magcache_cannot_run_on_zimage(denoiser: ZImageDenoiser, zimage_dir: Path) -> None:
    from diffusers.hooks import MagCacheConfig, apply_mag_cache

    transformer = copy.deepcopy(denoiser.transformer)
    apply_mag_cache(transformer, MagCacheConfig(num_inference_steps=4, mag_ratios=[1.0] * 4))
    hooked = copy.copy(denoiser)
    hooked.transformer = transformer
    shape = Shape(32, 32)
    latents = denoiser.init_latents(shape, [torch.Generator().manual_seed(0)])
    with pytest.raises((KeyError, ValueError), match="hidden_states"):
        hooked.predict(latents, 0, denoiser.sampler(shape, 4), denoiser.encode(["x"]), "cond")
