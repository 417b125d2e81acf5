"""Step caches (TeaCache, MagCache): the skip rules on hand-made trajectories, per-branch and
per-row state, options and calibration lookup, and the runtime on the tiny Z-Image (threshold 0
gives the uncached output bitwise; a batch computes when any member needs it)."""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import pytest
import torch
from omnirt.stages.diffusion.cache.calibration import CalibrationStore, UnknownModel
from omnirt.stages.diffusion.cache.config import StepCacheOptions, choose, parse_options
from omnirt.stages.diffusion.cache.magcache import MagCacheParams, magcache_schedule, resample_ratios
from omnirt.stages.diffusion.cache.state import CachePlan, StepCaches
from omnirt.stages.diffusion.cache.teacache import TeaCacheParams, rescale
from omnirt.stages.diffusion.pipeline import DiffusionPipeline
from omnirt.stages.diffusion.types import GeneratedImage, ImageRequest
from omnirt.stages.diffusion.zimage import ZImageDenoiser
from omnirt.stages.pipeline import RequestRejected

from .conftest import run_to_end
from .step_cache_util import IDENTITY, Driver, fake_caches, probes, store_for, tea_job


def reference_teacache(xs: list[float], threshold: float, steps: int, last: bool = True) -> list[bool]:
    """TeaCache's published loop (x: the rescaled distance per step; step 0's unused)."""
    acc, out = 0.0, []
    for i in range(steps):
        if i == 0 or (last and i == steps - 1):
            acc, skip = 0.0, False
        else:
            acc += xs[i]
            skip = acc < threshold
            if not skip:
                acc = 0.0
        out.append(skip)
    return out


# -- TeaCache ------------------------------------------------------------------------------------------


def test_teacache_accumulates_and_resets_as_the_formula() -> None:
    caches = fake_caches()
    tea = TeaCacheParams(IDENTITY, 0.0, 10.0, threshold=0.25)
    job = tea_job(caches, tea)
    values = [1.0]
    for x in (0.1, 0.1, 0.1, 0.1, 0.05, 0.3, 0.1):  # rel-L1 of consecutive probes
        values.append(values[-1] * (1 + x))
    drive = Driver(caches)
    got = [drive.call([job], [1], "cond", i, p)[0] for i, p in enumerate(probes(values))]
    xs = [0.0] + [abs(values[i] - values[i - 1]) / values[i - 1] for i in range(1, 8)]
    assert got == reference_teacache(xs, 0.25, 8)
    assert got == [False, True, True, False, True, True, False, False]
    assert job.skipped == {"cond": 4} and job.computed == {"cond": 4}


def test_teacache_random_trajectories_follow_the_formula() -> None:
    rng = np.random.default_rng(0)
    for trial in range(5):
        steps = 12
        values = np.cumprod(1 + rng.uniform(0.0, 0.3, steps))
        for last in (True, False):
            caches = fake_caches()
            job = tea_job(caches, TeaCacheParams(IDENTITY, 0.0, 10.0, 0.4, last), steps=steps)
            drive = Driver(caches)
            got = [drive.call([job], [1], "cond", i, p)[0] for i, p in enumerate(probes(values))]
            xs = [0.0] + [abs(values[i] - values[i - 1]) / values[i - 1] for i in range(1, steps)]
            assert got == reference_teacache(xs, 0.4, steps, last), (trial, last)


def test_a_skipped_step_applies_each_rows_cached_residual() -> None:
    caches = fake_caches()
    job = tea_job(caches, TeaCacheParams(IDENTITY, 0.0, 10.0, 10.0), rows=2)
    drive = Driver(caches, blocks=lambda step, h: h * 3 + torch.tensor([[[1.0]], [[5.0]]]))
    values = probes([1.0, 1.01, 1.02], rows=2)
    skip, out0 = drive.call([job], [2], "cond", 0, values[0])
    assert not skip
    hidden0 = torch.arange(8, dtype=torch.float32).reshape(2, 2, 2)
    residual = out0 - hidden0  # per row: 2 * h + row constant
    skip, out1 = drive.call([job], [2], "cond", 1, values[1])
    assert skip
    torch.testing.assert_close(out1, hidden0 + 1 + residual, rtol=0, atol=0)


def test_rescale_clamps_input_to_the_range_and_output_at_zero() -> None:
    coeffs = (0.0, 0.0, -1.0, 1.0, 0.0)  # x - x^2: negative above 1
    y, outside = rescale(torch.tensor([-0.5, 0.1, 0.4, 2.0]), coeffs, 0.05, 0.5)
    torch.testing.assert_close(y, torch.tensor([0.05 - 0.0025, 0.09, 0.24, 0.25]))
    assert outside.tolist() == [True, False, False, True]
    # Inside the range a negative value is clamped at zero: it never lowers the accumulator.
    y, _ = rescale(torch.tensor([0.9]), (0.0, 0.0, 0.0, 1.0, -1.0), 0.0, 1.0)
    assert y.tolist() == [0.0]


def test_out_of_range_inputs_are_clamped_and_warned_once(caplog: pytest.LogCaptureFixture) -> None:
    caches = fake_caches()
    tea = TeaCacheParams((0.0, 0.0, -1.0, 1.0, 0.0), 0.0, 0.5, threshold=0.6)
    job = tea_job(caches, tea, rid="far")
    drive = Driver(caches)
    # Distance 1.0 each step: unclamped, x - x^2 = 0 (the step would skip forever); clamped: 0.25.
    with caplog.at_level(logging.WARNING):
        got = [
            drive.call([job], [1], "cond", i, p)[0] for i, p in enumerate(probes([2.0**i for i in range(8)]))
        ]
    assert got == reference_teacache([0.25] * 8, 0.6, 8)
    assert got == [False, True, True, False, True, True, False, False]
    warnings = [r for r in caplog.records if "outside the calibrated range" in r.getMessage()]
    assert len(warnings) == 1 and "far" in warnings[0].getMessage()


def test_threshold_zero_never_skips() -> None:
    caches = fake_caches()
    job = tea_job(caches, TeaCacheParams(IDENTITY, 0.0, 10.0, 0.0))
    drive = Driver(caches)
    assert not any(drive.call([job], [1], "cond", i, p)[0] for i, p in enumerate(probes([1.0] * 8)))
    params = MagCacheParams(0.0, 5, 0.0)
    assert not any(magcache_schedule([1.0] * 8, 8, params))


def test_cfg_branches_keep_separate_state() -> None:
    caches = fake_caches()
    tea = TeaCacheParams(IDENTITY, 0.0, 10.0, 0.25)
    job = tea_job(caches, tea)
    cond = [1.0, 1.1, 1.21, 1.331, 1.4641, 1.61, 1.77, 1.95]  # about 0.1 a step
    uncond = [1.0, 1.3, 1.69, 2.2, 2.86, 3.7, 4.8, 6.3]  # about 0.3 a step: always computed
    drive = Driver(caches)
    got: dict[str, list[bool]] = {"cond": [], "uncond": []}
    for i in range(8):  # interleaved, as the runtime runs them
        got["cond"].append(drive.call([job], [1], "cond", i, probes(cond)[i])[0])
        got["uncond"].append(drive.call([job], [1], "uncond", i, probes(uncond)[i])[0])
    alone = Driver(fake_caches())
    job2 = tea_job(alone.caches, tea)
    assert got["cond"] == [alone.call([job2], [1], "cond", i, p)[0] for i, p in enumerate(probes(cond))]
    assert got["cond"] == [False, True, True, False, True, True, False, False]
    assert got["uncond"] == [False] * 8


def test_a_batch_computes_when_any_member_needs_it_and_each_row_keeps_its_state() -> None:
    caches = fake_caches()
    tea = TeaCacheParams(IDENTITY, 0.0, 10.0, 0.25)
    calm, busy = tea_job(caches, tea, rid="calm"), tea_job(caches, tea, rows=2, rid="busy")
    drive = Driver(caches)
    calm_values = [1.0 + 0.01 * i for i in range(8)]
    for i in range(8):
        # busy: row 0 calm, row 1 changes by 0.5 a step (never may skip): the batch computes.
        p = torch.cat([probes(calm_values)[i], probes(calm_values)[i], torch.full((1, 3, 2), 1.5**i)])
        skip, _ = drive.call([calm, busy], [1, 2], "cond", i, p)
        assert not skip
    # Computed with the batch: every accumulator reset (the calm rows too).
    assert calm.branches["cond"].acc.tolist() == [0.0]
    assert busy.branches["cond"].acc.tolist() == [0.0, 0.0]
    # Alone, the calm request skips.
    alone = fake_caches()
    job = tea_job(alone, tea)
    got = [Driver(alone).call([job], [1], "cond", i, p)[0] for i, p in enumerate(probes(calm_values))]
    assert any(got)


def test_a_request_without_cache_makes_its_batch_compute() -> None:
    caches = fake_caches()
    job = tea_job(caches, TeaCacheParams(IDENTITY, 0.0, 10.0, 10.0))
    drive = Driver(caches)
    for i in range(4):
        skip, _ = drive.call([job, None], [1, 1], "cond", i, torch.ones(2, 3, 2))
        assert not skip


# -- MagCache ------------------------------------------------------------------------------------------


def reference_magcache(
    ratios: list[float], steps: int, thr: float, k: int, retention: float, last: bool
) -> list[bool]:
    ratio, err, n, out, have = 1.0, 0.0, 0, [], False
    start = int(retention * steps + 0.5)
    for i in range(steps):
        skip = False
        if i >= start and not (last and i == steps - 1):
            ratio *= ratios[i]
            n += 1
            err += abs(1 - ratio)
            skip = have and err <= thr and n <= k
        if not skip:
            ratio, err, n, have = 1.0, 0.0, 0, True
        out.append(skip)
    return out


def test_magcache_schedule_follows_the_formula() -> None:
    ratios = [1.0, 1.2, 1.05, 1.01, 0.99, 1.0, 0.98, 0.97, 0.95, 0.9]
    got = magcache_schedule(ratios, 10, MagCacheParams(0.06, 2, 0.2))
    # threshold .06; retention: steps 0, 1 computed; 2: err .05 skip; 3: ratio 1.0605, err .1105 compute;
    # 4: .99 skip; 5: .99 err .02 skip; 6: 3 skips > 2 compute; 7: .97 skip; 8: .9215 err .1085 compute;
    # 9: the last, computed.
    assert got == [False, False, True, False, True, True, False, True, False, False]
    assert got == reference_magcache(ratios, 10, 0.06, 2, 0.2, True)
    rng = np.random.default_rng(1)
    for _ in range(20):
        r = [1.0] + list(rng.uniform(0.9, 1.1, 19))
        thr, k, ret = float(rng.uniform(0.01, 0.3)), int(rng.integers(1, 4)), float(rng.uniform(0, 0.4))
        for last in (True, False):
            assert magcache_schedule(r, 20, MagCacheParams(thr, k, ret, last)) == reference_magcache(
                r, 20, thr, k, ret, last
            )


def test_magcache_max_skips_and_retention() -> None:
    flat = [1.0] * 12
    assert magcache_schedule(flat, 12, MagCacheParams(1.0, 3, 0.0)) == [False, True, True, True] * 2 + [
        False, True, True, False
    ]  # fmt: skip
    assert magcache_schedule(flat, 12, MagCacheParams(1.0, 3, 0.5))[:6] == [False] * 6


def test_ratios_resample_by_cumulative_log_ratio() -> None:
    ratios = [1.0, 1.1, 1.05, 1.0, 0.97, 0.9]
    assert resample_ratios(ratios, 6) == ratios
    for steps in (3, 11, 50):
        out = resample_ratios(ratios, steps)
        assert len(out) == steps and out[0] == 1.0
        assert math.isclose(math.prod(out), math.prod(ratios), rel_tol=1e-9)  # the total change kept
    # A constant ratio r over 10 steps is r^(9/19) over 20 steps (nearest neighbour would keep r).
    out = resample_ratios([1.0] + [1.1] * 9, 20)
    assert all(math.isclose(v, 1.1 ** (9 / 19)) for v in out[1:])


def test_magcache_branches_and_batches_commit_what_the_batch_did() -> None:
    caches = fake_caches()
    from omnirt.stages.diffusion.cache.calibration import MagCacheCalibration

    cal = MagCacheCalibration(
        "fake", "x", "m", (8,), {8: {"cond": (1.0,) * 8, "uncond": (1.0,) + (1.6,) * 7}}
    )
    plan = CachePlan("magcache", mag=MagCacheParams(0.5, 6, 0.0), mag_calibration=cal)
    a = caches.job("a", plan, 1, 8)
    drive = Driver(caches)
    cond = [drive.call([a], [1], "cond", i, torch.ones(1, 1))[0] for i in range(8)]
    assert cond == plan.schedule(8, "cond") == [False] + [True] * 6 + [False]
    # The uncond ratios change by 1.6 a step: never skipped; its state is its own.
    b = caches.job("b", plan, 1, 8)
    uncond = [drive.call([b], [1], "uncond", i, torch.ones(1, 1))[0] for i in range(8)]
    assert uncond == [False] * 8
    # Batched with a request without cache: computed, and its accumulators reset each step.
    c = caches.job("c", plan, 1, 8)
    for i in range(4):
        assert not drive.call([c, None], [1, 1], "cond", i, torch.ones(2, 1))[0]
        assert c.branches["cond"].mag.skips == 0  # type: ignore[union-attr]


# -- options and calibration lookup -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("backend", "config", "message"),
    [
        ("fast", None, "cache_backend must be one of none, teacache, magcache"),
        ("teacache", {"max_skip_steps": 2}, "cache_config.max_skip_steps is not a teacache setting"),
        ("magcache", {"threshold": -1}, "cache_config.threshold must be from 0"),
        ("magcache", {"threshold": "high"}, "cache_config.threshold must be a number"),
        ("magcache", {"max_skip_steps": 1.5}, "cache_config.max_skip_steps must be an integer"),
        ("magcache", {"retention_ratio": 2}, "cache_config.retention_ratio must be from 0 to 1"),
        ("teacache", {"compute_last_step": "yes"}, "cache_config.compute_last_step must be true or false"),
        ("teacache", [1], "cache_config must be an object"),
        ("none", {"threshold": 1}, "not a none setting"),
    ],
)
def test_bad_options_are_refused_by_name(backend: Any, config: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_options(backend, config)


def test_request_options_over_server_defaults() -> None:
    server = parse_options("magcache", {"threshold": 0.2})
    assert choose(None, None, server) == server
    assert choose("magcache", {"max_skip_steps": 1}, server).config == {"max_skip_steps": 1}
    assert choose("teacache", None, server) == StepCacheOptions("teacache", {})
    assert choose("none", None, server).backend == "none"


def test_an_unknown_model_names_the_calibration_command(denoiser: ZImageDenoiser) -> None:
    caches = StepCaches(denoiser, store=CalibrationStore())
    for backend in ("teacache", "magcache"):
        with pytest.raises(UnknownModel, match=f"omnirt calibrate {backend} --model .* --prompts FILE"):
            caches.plan(backend, None, 8)
    p = DiffusionPipeline(denoiser, step_cache=caches)
    with pytest.raises(RequestRejected, match="has no teacache calibration"):
        p.prepare(ImageRequest("x", "a cat", width=32, height=32, cache_backend="teacache"))
    assert p.prepare(ImageRequest("y", "a cat", width=32, height=32)).cache is None
    with pytest.raises(ValueError, match="--step-cache for"):
        StepCaches(denoiser, defaults=StepCacheOptions("magcache"), store=CalibrationStore()).check_defaults()


# -- the runtime on the tiny Z-Image -------------------------------------------------------------------


def _images(p: DiffusionPipeline, requests: list[ImageRequest]) -> dict[str, list[bytes]]:
    out = run_to_end(p, requests)
    return {rid: [o.png for o in outs if isinstance(o, GeneratedImage)] for rid, outs in out.items()}


def _req(rid: str, backend: str | None = None, config: dict | None = None, **kw: Any) -> ImageRequest:
    base: dict[str, Any] = dict(width=64, height=64, num_inference_steps=8, seed=3, guidance_scale=2.0, n=2)
    base.update(kw)
    return ImageRequest(rid, "a red boat", cache_backend=backend, cache_config=config, **base)


@pytest.mark.parametrize("split", [False, True])
def test_threshold_zero_is_bitwise_the_uncached_output(denoiser: ZImageDenoiser, split: bool) -> None:
    store = store_for(denoiser)
    plain = _images(DiffusionPipeline(denoiser, split_calls=split), [_req("a")])["a"]
    for backend in ("teacache", "magcache"):
        p = DiffusionPipeline(denoiser, split_calls=split, step_cache=StepCaches(denoiser, store=store))
        cached = _images(p, [_req("a", backend, {"threshold": 0})])["a"]
        assert cached == plain, backend
        assert p.calls["transformer_skipped", 2] == 0
    # With a threshold, steps are skipped (both branches) and the images differ.
    p = DiffusionPipeline(denoiser, split_calls=split, step_cache=StepCaches(denoiser, store=store))
    assert _images(p, [_req("a", "magcache")])["a"] != plain
    assert p.calls["transformer_skipped", 2] == 8  # 4 steps x 2 branches (ratios 0.99, K 2)


def test_a_batch_with_a_threshold_zero_member_computes_every_step(denoiser: ZImageDenoiser) -> None:
    store = store_for(denoiser)
    plain = _images(DiffusionPipeline(denoiser), [_req("a"), _req("b", n=1, seed=9)])
    p = DiffusionPipeline(denoiser, step_cache=StepCaches(denoiser, store=store))
    eager = _req("b", "teacache", {"threshold": 100.0}, n=1, seed=9)
    both = _images(p, [_req("a", "teacache", {"threshold": 0}), eager])
    assert p.calls["transformer", 3] == 16 and p.calls["transformer_skipped", 3] == 0  # batched, none skipped
    assert both == plain
    # Alone, the eager request skips every step it may.
    p = DiffusionPipeline(denoiser, step_cache=StepCaches(denoiser, store=store))
    _images(p, [eager])
    assert p.calls["transformer_skipped", 1] == 12  # steps 1-6, both branches


def test_server_default_backend_applies_when_the_request_leaves_it_out(denoiser: ZImageDenoiser) -> None:
    caches = StepCaches(
        denoiser, defaults=parse_options("magcache", {"threshold": 0.5}), store=store_for(denoiser)
    )
    p = DiffusionPipeline(denoiser, step_cache=caches)
    prep = p.prepare(_req("a"))
    assert prep.cache is not None and prep.cache.mag is not None and prep.cache.mag.threshold == 0.5
    assert p.prepare(_req("b", "none")).cache is None


def test_removing_a_request_mid_call_keeps_the_others_cache_rows(denoiser: ZImageDenoiser) -> None:
    caches = StepCaches(denoiser, store=store_for(denoiser))
    p = DiffusionPipeline(denoiser, split_calls=True, max_step_seconds=1e-9, step_cache=caches)
    a, b = _req("a", "magcache", {"threshold": 0.5}, n=1), _req("b", "magcache", {"threshold": 0.5}, seed=4)
    for r in (a, b):
        p.add(r, p.prepare(r))
    removed = False
    outputs: list = []
    for _ in range(500):
        if not p.has_work():
            break
        call = p._call
        if not removed and call is not None and call.cache is not None and call.index == 3 and call.done == 0:
            p.remove("a")
            removed = True
            assert call.cache is not None and [m.rows for m in call.cache.members] == [2]
            assert call.cache.hidden_in.shape[0] == 2
        outputs += p.step()
    assert removed
    images = [o for rid, o in outputs if rid == "b" and isinstance(o, GeneratedImage)]
    assert len(images) == 2 and p.calls["transformer_skipped", 2] > 0
