"""Calibration of the step caches: the fits on synthetic data, the file format, ``omnirt calibrate``
on the tiny Z-Image (deterministic; the file is found in the model folder, loaded and used), and
the shipped calibrations of the embedded models."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from omnirt.realtime.cli import main
from omnirt.stages.diffusion.cache.calibrate import calibrate, fit_teacache, simulate_teacache
from omnirt.stages.diffusion.cache.calibration import (
    SHIPPED_DIR,
    default_store,
    fingerprint,
    from_json,
    load,
    save,
    to_json,
)
from omnirt.stages.diffusion.cache.server import configure_step_caches
from omnirt.stages.diffusion.cache.state import StepCaches
from omnirt.stages.diffusion.pipeline import DiffusionPipeline
from omnirt.stages.diffusion.types import ImageRequest
from omnirt.stages.diffusion.zimage import ZImageDenoiser

from .conftest import run_to_end

PROMPTS = ["a red fox in snow", "a lighthouse in a storm", "a bowl of soup"]


def test_teacache_fit_recovers_a_polynomial_and_aims_its_threshold() -> None:
    rng = np.random.default_rng(0)
    true = [2.0, -1.0, 0.5, 1.5, 0.01]
    rows = []
    for t in range(6):
        for i in range(1, 20):
            x = float(rng.uniform(0.05, 0.5))
            rows.append((f"r{t}", "cond", i, 20, 0, x, float(np.polyval(true, x)), 1.0))
    cal = fit_teacache(rows, family="z-image", fp="f", model="m", steps=[20], target_speedup=1.5)
    np.testing.assert_allclose(cal.coefficients, true, atol=1e-6)
    assert cal.r2 == pytest.approx(1.0) and cal.samples == 6 * 19
    xs = [r[5] for r in rows]
    assert cal.input_range == (min(xs), max(xs))
    trajectories = [[r[5] for r in rows if r[0] == f"r{t}"] for t in range(6)]
    skipped = simulate_teacache(trajectories, cal.coefficients, *cal.input_range, cal.threshold)
    assert skipped == pytest.approx(1 / 3, abs=0.06)


def test_calibration_files_are_checked() -> None:
    cal = fit_teacache(
        [("r", "cond", i, 12, 0, 0.1 * i, 0.2 * i, 1.0) for i in range(1, 12)],
        family="wan",
        fp="f",
        model="m",
        steps=[12],
        target_speedup=1.5,
    )
    assert from_json(json.loads(json.dumps(to_json(cal)))) == cal
    data = to_json(cal)
    for broken, message in (
        ({**data, "coefficients": [1, 2]}, "coefficients must have 5 numbers"),
        ({**data, "input_range": [1, 0]}, "low <= high"),
        ({k: v for k, v in data.items() if k != "threshold"}, "lacks 'threshold'"),
        ({**data, "format": "x"}, "not a step-cache calibration"),
        ({**data, "backend": "fastcache"}, "unknown backend"),
    ):
        with pytest.raises(ValueError, match=message):
            from_json(broken)


def test_calibrate_round_trips_on_the_tiny_model(
    zimage_dir: Path, denoiser: ZImageDenoiser, tmp_path: Path
) -> None:
    pipeline = DiffusionPipeline(denoiser, step_cache=StepCaches(denoiser))
    mag = calibrate("magcache", pipeline, PROMPTS, [4, 6], size=(32, 32))
    again = calibrate("magcache", DiffusionPipeline(denoiser), PROMPTS, [4, 6], size=(32, 32))
    assert to_json(mag) == to_json(again)  # deterministic
    assert set(mag.ratios) == {4, 6} and set(mag.ratios[6]) == {"cond"}  # the demo's default: unguided
    assert all(len(mag.ratios[n]["cond"]) == n and mag.ratios[n]["cond"][0] == 1.0 for n in (4, 6))
    tea = calibrate("teacache", pipeline, PROMPTS, [4, 6], size=(32, 32), guidance_scale=2.0)
    assert tea.samples == 2 * 3 * (3 + 5)  # both branches, 3 prompts, steps 1.. of each run
    assert tea.input_range[0] < tea.input_range[1] and np.isfinite(tea.r2)
    assert tea.fingerprint == fingerprint(denoiser.transformer)
    # A model folder's omnirt-calibration/ is read by the pipeline a server builds.
    folder = tmp_path / "model"
    save(tea, folder / "omnirt-calibration" / "teacache.json")
    save(mag, tmp_path / "mag.json")
    store = default_store(str(folder))
    served = DiffusionPipeline(denoiser, step_cache=StepCaches(denoiser, store=store))
    configure_step_caches([served], backend="magcache", calibrations=[tmp_path / "mag.json"])
    request = ImageRequest("m", "a boat", width=32, height=32, num_inference_steps=8, seed=4)
    run_to_end(served, [request])
    schedule = served.prepare(request).cache.schedule(8)  # type: ignore[union-attr]
    assert served.calls["transformer_skipped", 1] == sum(schedule)
    tea_request = ImageRequest(
        "t", "a boat", width=32, height=32, num_inference_steps=8, seed=4, cache_backend="teacache"
    )
    assert served.prepare(tea_request).cache.tea.coefficients == tea.coefficients  # type: ignore[union-attr]
    run_to_end(served, [tea_request])


def test_the_calibrate_command_writes_into_the_model_folder(
    zimage_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "z"
    shutil.copytree(zimage_dir, model)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    argv = ["calibrate", "magcache", "--model", str(model), "--prompts", str(prompts), "--steps", "4,6"]
    assert main([*argv, "--size", "32x32", "--device", "cpu", "--log-level", "warning"]) == 0
    out = capsys.readouterr().out
    assert "magcache for z (z-image" in out and "6 steps cond: ratios" in out
    cal = load(model / "omnirt-calibration" / "magcache.json")
    assert cal.steps == (4, 6)
    assert main(["calibrate", "teacache", "--model", str(tmp_path / "none"), "--prompts", str(prompts)]) == 1


def test_the_embedded_models_ship_calibrations(denoiser: ZImageDenoiser, tmp_path_factory) -> None:  # type: ignore[no-untyped-def]
    from omnirt.stages.diffusion.wan_demo import ensure_wan_demo
    from omnirt.stages.diffusion.wan_loader import load_wan

    wan = load_wan(ensure_wan_demo(tmp_path_factory.mktemp("omnirt-cache")), device="cpu")
    store = default_store(None)
    for den in (denoiser, wan):
        for backend in ("teacache", "magcache"):
            cal = store.find(backend, den.family, fingerprint(den.transformer))
            assert cal is not None, (den.family, backend)
    assert sorted(p.name for p in SHIPPED_DIR.glob("*.json")) == [
        "demo-wan2.1-t2v.magcache.json",
        "demo-wan2.1-t2v.teacache.json",
        "demo-z-image.magcache.json",
        "demo-z-image.teacache.json",
    ]
