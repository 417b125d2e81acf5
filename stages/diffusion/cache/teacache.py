"""TeaCache (Liu et al., 2024): skip a step's transformer blocks while the accumulated, rescaled
change of the first block's modulated input stays under a threshold.

Per step ``i`` and row, with ``x`` the relative L1 distance between this step's probe (the
modulated input of the first main block, :mod:`.probes`) and the previous step's:

- the first step is computed; the last too when ``compute_last_step`` (the default);
- otherwise ``acc += max(poly(clamp(x, low, high)), 0)`` with the model's calibrated polynomial
  (degree 4, highest power first as ``numpy.polyfit``) and its calibrated input range
  ``[low, high]``; the step is skipped while ``acc < threshold``, and a computed step resets
  ``acc`` to 0. A threshold of 0 (or less) never skips.

A polynomial only holds where it was fitted: outside the range it may cross zero (and then the
largest changes would be skipped), so the input is clamped to the range, the output at zero, and a
row whose input left the range is flagged (the runtime warns once per request).

Everything here runs on the device, without reading it back: the runtime copies the flags to
pinned host memory behind an event (:mod:`.state`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TeaCacheParams:
    coefficients: tuple[float, ...]  # highest power first
    low: float
    high: float
    threshold: float
    compute_last_step: bool = True


def rel_l1(current: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """``mean|current - previous| / mean|previous|`` per row (float32 ``[rows]``). Rows of
    different token counts (a batch padded differently) compare their common leading tokens."""
    if current.dim() > 2 and current.shape[1] != previous.shape[1]:
        n = min(current.shape[1], previous.shape[1])
        current, previous = current[:, :n], previous[:, :n]
    c = current.flatten(1)
    p = previous.flatten(1)
    # Sums of |.| accumulated in float32 without float32 copies of the (large) operands; the ratio
    # of the sums is the ratio of the means.
    change = torch.linalg.vector_norm(c - p, 1, dim=1, dtype=torch.float32)
    size = torch.linalg.vector_norm(p, 1, dim=1, dtype=torch.float32)
    return change / size.clamp_min(1e-12 * p.shape[1])


def polyval(coefficients: Sequence[float], x: torch.Tensor) -> torch.Tensor:
    """``numpy.polyval`` on a tensor (Horner's rule)."""
    out = torch.zeros_like(x)
    for c in coefficients:
        out = out * x + c
    return out


def rescale(
    x: torch.Tensor, coefficients: Sequence[float], low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rescaled distance ``max(poly(clamp(x, low, high)), 0)`` and whether ``x`` was outside
    ``[low, high]`` (bool), per row."""
    outside = (x < low) | (x > high)
    y = polyval(coefficients, x.clamp(low, high)).clamp_min(0.0)
    return y, outside


def accumulate(
    acc: torch.Tensor, distance: torch.Tensor, threshold: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidate accumulator ``acc + distance`` and whether each row may skip (``< threshold``,
    never for a threshold of 0 or less)."""
    candidate = acc + distance
    return candidate, (candidate < threshold) & (threshold > 0)
