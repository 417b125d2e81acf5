"""MagCache (Ma et al., 2025): skip a step's transformer blocks while the accumulated change of the
residual's magnitude, predicted from calibrated per-step ratios, stays under a threshold.

The ratios do not depend on the prompt (they are calibrated per model), so a request's whole skip
schedule is known on the host at admission: nothing here reads the device. Per step ``i`` (of
``steps``), with ``r`` the branch's ratios resampled to ``steps``:

- steps before ``retention_step = int(retention_ratio * steps + 0.5)`` are computed;
- the last step is computed when ``compute_last_step`` (the default);
- otherwise ``ratio *= r[i]``, ``skips += 1``, ``err += |1 - ratio|``; the step is skipped when a
  residual is cached, ``err <= threshold`` and ``skips <= max_skip_steps``, else computed, and a
  computed step resets ``ratio, err, skips`` to ``1, 0, 0``.

That is diffusers' ``MagCacheHeadHook`` (0.42) but for three deliberate differences: the last step
is computed by default, a threshold of 0 (or less) never skips (so it gives the uncached output
bitwise, even where a ratio is exactly 1), and ratios calibrated at another step count are
resampled by their cumulative log-ratio (:func:`resample_ratios`), where diffusers picks the
nearest step's ratio (which changes the total magnitude change the ratios describe).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class MagCacheParams:
    threshold: float
    max_skip_steps: int
    retention_ratio: float
    compute_last_step: bool = True


def resample_ratios(ratios: Sequence[float], steps: int) -> list[float]:
    """``ratios`` (one per step, the first 1.0: the change from the previous step's residual
    magnitude) resampled to ``steps`` steps: the cumulative log-ratio, a function of the step's
    position in ``[0, 1]``, is interpolated linearly at the new positions and differenced, so the
    total change of magnitude over the run is kept."""
    n = len(ratios)
    if n == 0:
        raise ValueError("no ratios to resample")
    if any(not (r > 0 and math.isfinite(r)) for r in ratios):
        raise ValueError("magnitude ratios must be positive and finite")
    if steps < 1:
        raise ValueError(f"steps must be positive, got {steps}")
    if steps == n:
        return [float(r) for r in ratios]
    cumulative = [0.0]
    for r in ratios[1:]:
        cumulative.append(cumulative[-1] + math.log(r))
    if n == 1 or steps == 1:
        return [1.0] * steps

    def at(u: float) -> float:  # u in [0, 1]
        x = u * (n - 1)
        i = min(int(x), n - 2)
        frac = x - i
        return cumulative[i] + frac * (cumulative[i + 1] - cumulative[i])

    values = [at(j / (steps - 1)) for j in range(steps)]
    return [1.0] + [math.exp(values[j] - values[j - 1]) for j in range(1, steps)]


class MagCacheBranch:
    """The accumulators of one CFG branch of one request (its rows share them: the schedule does
    not depend on the prompt). :meth:`propose` says whether step ``index`` may skip; the runtime
    then :meth:`commit`\\ s what the batch did (a batch computes when any member needs it)."""

    def __init__(self, ratios: Sequence[float], steps: int, params: MagCacheParams) -> None:
        self.ratios = resample_ratios(ratios, steps)
        self.steps = steps
        self.params = params
        self.retention_step = int(params.retention_ratio * steps + 0.5)
        self.ratio, self.err, self.skips = 1.0, 0.0, 0
        self.has_residual = False
        self._proposed: tuple[float, float, int] | None = None

    def propose(self, index: int) -> bool:
        """Whether step ``index`` may skip the blocks (no state changes until :meth:`commit`)."""
        p = self.params
        self._proposed = None
        if p.threshold <= 0 or index < self.retention_step:
            return False
        if p.compute_last_step and index >= self.steps - 1:
            return False
        ratio = self.ratio * (self.ratios[index] if index < len(self.ratios) else 1.0)
        skips = self.skips + 1
        err = self.err + abs(1.0 - ratio)
        self._proposed = (ratio, err, skips)
        return self.has_residual and err <= p.threshold and skips <= p.max_skip_steps

    def commit(self, skipped: bool) -> None:
        """What the step did: skipped (the proposed accumulators stand) or computed (reset)."""
        if skipped:
            assert self._proposed is not None, "a skip must follow a proposal that allowed it"
            self.ratio, self.err, self.skips = self._proposed
        else:
            self.ratio, self.err, self.skips = 1.0, 0.0, 0
            self.has_residual = True
        self._proposed = None


def magcache_schedule(ratios: Sequence[float], steps: int, params: MagCacheParams) -> list[bool]:
    """Per step, whether one request alone skips it (True: skipped), from the ratios alone."""
    branch = MagCacheBranch(ratios, steps, params)
    out = []
    for i in range(steps):
        skip = branch.propose(i)
        branch.commit(skip)
        out.append(skip)
    return out
