"""``omnirt calibrate teacache|magcache --model PATH --prompts FILE --steps 25,50 [--out FILE]``.

Runs full-compute trajectories of the prompts (one a line, seeds 0, 1, ...) at each step count
through the serving runtime (:class:`~..pipeline.DiffusionPipeline`, batched as served), with a
recording cache (:class:`~.state.Recorder`) that computes on the device, per call and row, the
probe's relative L1 change, the block-stack residual's relative L1 change and the mean per-token
ratio of the residual's norm to the previous step's; nothing but those numbers is kept. Then:

- TeaCache: a degree-4 polynomial from the probe's change to the residual's (``numpy.polyfit``),
  pooled over prompts, branches and step counts; its R², its input range, and a default threshold:
  the one at which TeaCache run on the recorded trajectories skips ``1 - 1/target_speedup`` of
  the calls (1.5x by default);
- MagCache: per step count and branch, the mean ratio per step (the first 1.0) and its standard
  deviation over prompts; the default threshold, maximum consecutive skips and retention ratio
  are diffusers' (0.06, 3, 0.2) unless given.

It prints the fit and writes the file (default ``<model folder>/omnirt-calibration/<backend>.json``,
which the server reads). ``--model demo-z-image`` / ``demo-wan2.1-t2v`` calibrate the embedded
models (the shipped files in ``calibrations/`` were made so: see its README).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .calibration import (
    CALIBRATION_DIR,
    POLY_DEGREE,
    Calibration,
    MagCacheCalibration,
    TeaCacheCalibration,
    fingerprint,
    save,
)
from .state import Recorder

log = logging.getLogger(__name__)

DEMO_IMAGE, DEMO_VIDEO = "demo-z-image", "demo-wan2.1-t2v"
TARGET_SPEEDUP = 1.5
#: A row of :meth:`Recorder.rows`: (request, branch, step, steps, row, x, y, ratio).
Row = tuple[str, str, int, int, int, float, float, float]


def load_pipeline(model: str, *, device: str, load_format: str = "auto") -> Any:
    """The serving pipeline of ``model`` (a diffusers folder, or an embedded demo's id), not warmed up."""
    from ..factory import _embedded_image, build_diffusion_pipeline
    from ..pipeline import DiffusionPipeline

    if model == DEMO_IMAGE:
        return _embedded_image(device, max_rows=8)
    if model == DEMO_VIDEO:
        from ..factory import WAN_DEMO_ID
        from ..wan_demo import ensure_wan_demo
        from ..wan_loader import load_wan

        return DiffusionPipeline(load_wan(ensure_wan_demo(), device=device, model_id=WAN_DEMO_ID), max_rows=8)
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"--model {model!r}: no such folder (or {DEMO_IMAGE}, {DEMO_VIDEO})")
    return build_diffusion_pipeline(path, device=device, load_format=load_format, warm_up=False)


def record(
    pipeline: Any,
    prompts: Sequence[str],
    steps: Sequence[int],
    *,
    size: tuple[int, int] | None = None,
    frames: int | None = None,
    guidance_scale: float | None = None,
    max_batch: int = 4,
) -> list[Row]:
    """Full-compute trajectories of ``prompts`` at each step count (seed = the prompt's index),
    ``max_batch`` requests at a time."""
    recorder = Recorder()
    width, height = size or (None, None)
    extra: dict[str, Any] = {"num_frames": frames} if pipeline.kind == "video" and frames else {}
    for n in steps:
        for first in range(0, len(prompts), max_batch):
            for i in range(first, min(first + max_batch, len(prompts))):
                request = pipeline._request_type(
                    request_id=f"calibrate-{n}-{i}",
                    prompt=prompts[i],
                    width=width,
                    height=height,
                    num_inference_steps=n,
                    guidance_scale=guidance_scale,
                    seed=i,
                    **extra,
                )
                prepared = pipeline.prepare(request)
                plan = pipeline.step_cache.plan(None, None, n, recorder=recorder)
                pipeline.add(request, dataclasses.replace(prepared, cache=plan))
            while pipeline.has_work() or pipeline.media.busy():
                if pipeline.has_work():
                    pipeline.step()
                else:
                    time.sleep(0.001)
    return recorder.rows()


def _r2(x: np.ndarray, y: np.ndarray, coefficients: np.ndarray) -> float:
    residual = y - np.polyval(coefficients, x)
    total = ((y - y.mean()) ** 2).sum()
    return float(1 - (residual**2).sum() / total) if total > 0 else 1.0


def simulate_teacache(
    trajectories: Sequence[Sequence[float]],
    coefficients: Sequence[float],
    low: float,
    high: float,
    threshold: float,
) -> float:
    """The fraction of calls TeaCache skips on recorded trajectories (each: the probe's change
    at steps 1, 2, ...; step 0 and the last computed)."""
    skipped = total = 0
    for xs in trajectories:
        steps = len(xs) + 1
        total += steps
        acc = 0.0
        for i, x in enumerate(xs, start=1):
            if i == steps - 1:
                break
            acc += max(float(np.polyval(coefficients, min(max(x, low), high))), 0.0)
            if threshold > 0 and acc < threshold:
                skipped += 1
            else:
                acc = 0.0
    return skipped / max(total, 1)


def _trajectories(rows: Sequence[Row]) -> list[list[float]]:
    by: dict[tuple, dict[int, float]] = collections.defaultdict(dict)
    for rid, branch, index, steps, row, x, _, _ in rows:
        by[(rid, branch, row, steps)][index] = x
    return [[xs[i] for i in sorted(xs)] for xs in by.values()]


def fit_teacache(
    rows: Sequence[Row], *, family: str, fp: str, model: str, steps: Sequence[int], target_speedup: float
) -> TeaCacheCalibration:
    x = np.array([r[5] for r in rows], dtype=np.float64)
    y = np.array([r[6] for r in rows], dtype=np.float64)
    if len(x) < 2 * (POLY_DEGREE + 1):
        raise ValueError(
            f"{len(x)} samples are too few to fit a degree-{POLY_DEGREE} polynomial: more prompts or steps"
        )
    coefficients = np.polyfit(x, y, POLY_DEGREE)
    low, high = float(x.min()), float(x.max())
    target = 1 - 1 / target_speedup
    trajectories = _trajectories(rows)
    lo, hi = (
        0.0,
        max(sum(max(float(np.polyval(coefficients, v)), 0.0) for v in t) for t in trajectories) + 1e-9,
    )
    for _ in range(60):  # the skipped fraction grows with the threshold
        mid = (lo + hi) / 2
        if simulate_teacache(trajectories, coefficients, low, high, mid) < target:
            lo = mid
        else:
            hi = mid
    return TeaCacheCalibration(
        family=family,
        fingerprint=fp,
        model=model,
        steps=tuple(steps),
        coefficients=tuple(float(c) for c in coefficients),
        input_range=(low, high),
        threshold=float(f"{hi:.6g}"),
        r2=_r2(x, y, coefficients),
        samples=len(x),
    )


def fit_magcache(
    rows: Sequence[Row],
    *,
    family: str,
    fp: str,
    model: str,
    steps: Sequence[int],
    threshold: float,
    max_skip_steps: int,
    retention_ratio: float,
) -> MagCacheCalibration:
    values: dict[tuple[int, str, int], list[float]] = collections.defaultdict(list)
    for _, branch, index, n, _, _, _, ratio in rows:
        values[(n, branch, index)].append(ratio)
    ratios: dict[int, dict[str, tuple[float, ...]]] = {}
    std: dict[int, dict[str, tuple[float, ...]]] = {}
    for n in steps:
        for branch in ("cond", "uncond"):
            if not any((n, branch, i) in values for i in range(1, n)):
                continue
            means, devs = [1.0], [0.0]
            for i in range(1, n):
                v = values.get((n, branch, i))
                if not v:
                    raise ValueError(f"no ratio recorded at step {i} of {n} ({branch})")
                means.append(float(np.mean(v)))
                devs.append(float(np.std(v)))
            ratios.setdefault(n, {})[branch] = tuple(means)
            std.setdefault(n, {})[branch] = tuple(devs)
    if not ratios:
        raise ValueError("no ratios recorded: steps must be at least 2")
    return MagCacheCalibration(
        family=family,
        fingerprint=fp,
        model=model,
        steps=tuple(steps),
        ratios=ratios,
        std=std,
        threshold=threshold,
        max_skip_steps=max_skip_steps,
        retention_ratio=retention_ratio,
    )


def calibrate(
    backend: str,
    pipeline: Any,
    prompts: Sequence[str],
    steps: Sequence[int],
    *,
    size: tuple[int, int] | None = None,
    frames: int | None = None,
    guidance_scale: float | None = None,
    target_speedup: float = TARGET_SPEEDUP,
    threshold: float | None = None,
    max_skip_steps: int = 3,
    retention_ratio: float = 0.2,
) -> Calibration:
    if backend not in ("teacache", "magcache"):
        raise ValueError(f"backend must be teacache or magcache, not {backend!r}")
    if not prompts:
        raise ValueError("no prompts")
    if not steps or min(steps) < 2:
        raise ValueError("every step count must be at least 2")
    rows = record(pipeline, prompts, steps, size=size, frames=frames, guidance_scale=guidance_scale)
    den = pipeline.denoiser
    head = {"family": den.family, "fp": fingerprint(den.transformer), "model": den.info.id, "steps": steps}
    if backend == "teacache":
        cal: Calibration = fit_teacache(rows, target_speedup=target_speedup, **head)
        if threshold is not None:
            cal = dataclasses.replace(cal, threshold=threshold)
        return cal
    return fit_magcache(
        rows,
        threshold=0.06 if threshold is None else threshold,
        max_skip_steps=max_skip_steps,
        retention_ratio=retention_ratio,
        **head,
    )


def describe(cal: Calibration) -> str:
    if isinstance(cal, TeaCacheCalibration):
        poly = ", ".join(f"{c:.6g}" for c in cal.coefficients)
        low, high = cal.input_range
        return (
            f"teacache for {cal.model} ({cal.family}, {cal.fingerprint}), steps {list(cal.steps)}: "
            f"{cal.samples} samples, R^2 {cal.r2:.4f}, input range [{low:.6g}, {high:.6g}], "
            f"coefficients [{poly}], default threshold {cal.threshold:g}"
        )
    lines = [f"magcache for {cal.model} ({cal.family}, {cal.fingerprint}), steps {list(cal.steps)}:"]
    for n, branches in sorted(cal.ratios.items()):
        for branch, r in branches.items():
            spread = max(cal.std.get(n, {}).get(branch, (0.0,)))
            lines.append(
                f"  {n} steps {branch}: ratios {min(r):.4f} to {max(r):.4f} (max std {spread:.4f}): "
                + " ".join(f"{v:.4f}" for v in r)
            )
    lines.append(
        f"  defaults: threshold {cal.threshold:g}, max_skip_steps {cal.max_skip_steps}, "
        f"retention_ratio {cal.retention_ratio:g}"
    )
    return "\n".join(lines)


# -- the command (its arguments: realtime/cli.py) ---------------------------------------------------


def run(args: argparse.Namespace) -> int:
    import torch

    try:
        steps = [int(s) for s in str(args.steps).split(",") if s.strip()]
        prompts = [line.strip() for line in args.prompts.read_text().splitlines() if line.strip()]
        size = None
        if args.size:
            w, _, h = args.size.partition("x")
            size = (int(w), int(h))
    except (OSError, ValueError) as exc:
        log.error("calibrate: %s", exc)
        return 2
    out = args.out
    if out is None:
        if args.model in (DEMO_IMAGE, DEMO_VIDEO):
            log.error("calibrate: give --out for an embedded model")
            return 2
        out = Path(args.model).expanduser() / CALIBRATION_DIR / f"{args.backend}.json"
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        pipeline = load_pipeline(args.model, device=device, load_format=args.load_format)
        start = time.perf_counter()
        cal = calibrate(
            args.backend,
            pipeline,
            prompts,
            steps,
            size=size,
            frames=args.frames,
            guidance_scale=args.guidance_scale,
            target_speedup=args.target_speedup,
            threshold=args.threshold,
            max_skip_steps=args.max_skip_steps,
            retention_ratio=args.retention_ratio,
        )
    except ValueError as exc:
        log.error("calibrate: %s", exc)
        return 1
    print(describe(cal))
    save(cal, out)
    print(f"wrote {out} ({time.perf_counter() - start:.1f} s)")
    return 0
