"""The server's step-cache settings applied to its diffusion pipelines (``omnirt serve
--step-cache BACKEND --step-cache-config JSON --step-cache-calibration FILE``)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .calibration import load
from .config import parse_options

log = logging.getLogger(__name__)


def configure_step_caches(
    pipelines: Iterable[Any],
    *,
    backend: str | None = None,
    config: Mapping[str, Any] | None = None,
    calibrations: Sequence[str | Path] = (),
) -> None:
    """Adds the calibration files to every diffusion pipeline's store (each model takes those of
    its fingerprint) and sets the default backend and settings; ``ValueError`` when the options
    are invalid, a file unreadable, or a model lacks the calibration the default backend needs."""
    defaults = parse_options(backend or "none", dict(config or {}))
    loaded = [load(Path(path)) for path in calibrations]
    for pipeline in pipelines:
        caches = getattr(pipeline, "step_cache", None)
        if caches is None:
            continue
        for cal in loaded:
            caches.store.add(cal)
        caches.defaults = defaults
        caches.check_defaults()
        if defaults.backend != "none":
            log.info(
                "%s: step cache %s by default (%s)",
                pipeline.info.id,
                defaults.backend,
                dict(defaults.config) or "calibrated settings",
            )
