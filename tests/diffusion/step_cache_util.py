"""Helpers of the step-cache tests: hand-made calibrations for a denoiser, a store of them, and a
driver of :class:`StepCaches` over hand-made probe trajectories (no model)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import torch
from omnirt.stages.diffusion.cache.calibration import (
    CalibrationStore,
    MagCacheCalibration,
    TeaCacheCalibration,
    fingerprint,
)
from omnirt.stages.diffusion.cache.state import CachePlan, JobCache, Member, StepCaches

#: rescale(x) = x on [0, 10]
IDENTITY = (0.0, 0.0, 0.0, 1.0, 0.0)


def store_for(
    den: Any, *, steps: int = 8, tea_threshold: float = 0.3, ratio: float = 0.99
) -> CalibrationStore:
    fp = fingerprint(den.transformer)
    ratios = {steps: {"cond": (1.0,) + (ratio,) * (steps - 1), "uncond": (1.0,) + (ratio,) * (steps - 1)}}
    return CalibrationStore(
        [
            TeaCacheCalibration(
                den.family, fp, "test", (steps,), IDENTITY, (0.0, 10.0), tea_threshold, 1.0, 1
            ),
            MagCacheCalibration(
                den.family, fp, "test", (steps,), ratios, threshold=0.1, max_skip_steps=2, retention_ratio=0.2
            ),
        ]
    )


def fake_caches() -> StepCaches:
    """StepCaches whose probe is the state's ``probe`` attribute (the trajectory is hand-made)."""
    den = SimpleNamespace(family="fake", info=SimpleNamespace(id="fake", source=None))
    caches = StepCaches(den)
    caches.probe = lambda state: state.probe
    return caches


class Driver:
    """Runs calls through ``caches`` over hand-made probes; the blocks are ``blocks(step, hidden)``."""

    def __init__(self, caches: StepCaches, blocks: Callable[[int, torch.Tensor], torch.Tensor] | None = None):
        self.caches = caches
        self.blocks = blocks or (lambda step, h: h * 2 + step)

    def call(
        self,
        jobs: Sequence[JobCache | None],
        rows: Sequence[int],
        branch: str,
        step: int,
        probe: torch.Tensor,
    ) -> tuple[bool, torch.Tensor]:
        members, at = [], 0
        for job, n in zip(jobs, rows, strict=True):
            members.append(Member(job, at, n))
            at += n
        hidden = torch.arange(at * 4, dtype=torch.float32).reshape(at, 2, 2) + step
        state = SimpleNamespace(hidden=hidden, probe=probe)
        call = self.caches.begin(members, branch, step, state)
        skip = call.resolve()
        if skip:
            call.apply(state)
        else:
            state.hidden = self.blocks(step, hidden)
            call.store(state)
        return skip, state.hidden


def tea_job(caches: StepCaches, tea: Any, rows: int = 1, steps: int = 8, rid: str = "r") -> JobCache:
    return caches.job(rid, CachePlan("teacache", tea=tea), rows, steps)


def probes(values: Sequence[float], rows: int = 1) -> list[torch.Tensor]:
    """A probe per step whose every element is ``values[step]`` (rel-L1 = |v_i - v_{i-1}| / |v_{i-1}|)."""
    return [torch.full((rows, 3, 2), float(v)) for v in values]
