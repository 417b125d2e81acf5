"""The step-cache options of a request (``cache_backend``, ``cache_config``) and of the server
(``--step-cache``, ``--step-cache-config``), validated.

``cache_backend`` is ``none``, ``teacache`` or ``magcache``; ``cache_config`` an object with:

- ``threshold`` (both; a number >= 0; 0 never skips): the model's calibrated default when left out;
- ``compute_last_step`` (both; bool, default true);
- ``max_skip_steps`` (magcache; integer >= 0) and ``retention_ratio`` (magcache; 0 to 1): the
  calibrated defaults when left out.

A request that leaves ``cache_backend`` out gets the server's backend; its ``cache_config`` (when
given) replaces the server's, else the server's applies when the backends agree.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Backend = Literal["none", "teacache", "magcache"]
BACKENDS: tuple[str, ...] = ("none", "teacache", "magcache")
MAX_THRESHOLD = 100.0
MAX_SKIP_STEPS = 100

_KEYS: dict[str, tuple[str, ...]] = {
    "none": (),
    "teacache": ("threshold", "compute_last_step"),
    "magcache": ("threshold", "max_skip_steps", "retention_ratio", "compute_last_step"),
}


@dataclass(frozen=True)
class StepCacheOptions:
    """Validated options: the backend and the settings given (others: the calibrated defaults)."""

    backend: Backend = "none"
    config: Mapping[str, Any] = field(default_factory=dict)


def _number(name: str, value: Any, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"cache_config.{name} must be a number, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"cache_config.{name} must be a number, got {value!r}")
    # An int is compared as it is: one past a float's range (a JSON 1e400 written out in digits)
    # would raise OverflowError in float().
    if not low <= value <= high:
        shown = repr(value) if len(str(value)) <= 24 else f"{str(value)[:12]}... ({len(str(value))} digits)"
        raise ValueError(f"cache_config.{name} must be from {low:g} to {high:g}, got {shown}")
    return float(value)


def parse_options(backend: Any, config: Any) -> StepCacheOptions:
    """``cache_backend`` and ``cache_config`` checked (``ValueError`` naming what is wrong)."""
    if backend is None:
        backend = "none"
    if backend not in BACKENDS:
        raise ValueError(f"cache_backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if config is None:
        config = {}
    if not isinstance(config, Mapping):
        raise ValueError(f"cache_config must be an object, got {type(config).__name__}")
    allowed = _KEYS[backend]
    out: dict[str, Any] = {}
    for key, value in config.items():
        if key not in allowed:
            known = ", ".join(allowed) or "none"
            raise ValueError(
                f"cache_config.{key} is not a {backend} setting (settings of {backend}: {known})"
            )
        if key == "threshold":
            out[key] = _number(key, value, 0.0, MAX_THRESHOLD)
        elif key == "retention_ratio":
            out[key] = _number(key, value, 0.0, 1.0)
        elif key == "max_skip_steps":
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SKIP_STEPS:
                raise ValueError(
                    f"cache_config.{key} must be an integer from 0 to {MAX_SKIP_STEPS}, got {value!r}"
                )
            out[key] = value
        elif key == "compute_last_step":
            if not isinstance(value, bool):
                raise ValueError(f"cache_config.{key} must be true or false, got {value!r}")
            out[key] = value
    return StepCacheOptions(backend, out)  # type: ignore[arg-type]


def parse_config_json(text: str | None) -> dict[str, Any]:
    """``--step-cache-config`` (a JSON object) as a dict; ``ValueError`` otherwise."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--step-cache-config is not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError("--step-cache-config must be a JSON object")
    return value


def choose(backend: Any, config: Any, defaults: StepCacheOptions) -> StepCacheOptions:
    """A request's options over the server's ``defaults`` (see the module docstring)."""
    if backend is None:
        backend = defaults.backend
    if config is None and backend == defaults.backend:
        return defaults
    return parse_options(backend, config)
