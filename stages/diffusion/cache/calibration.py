"""Calibration files of the step caches: format, load/save, lookup by model.

One JSON file per backend and model::

    {"format": "omnirt-step-cache-calibration", "version": 1, "backend": "teacache" | "magcache",
     "family": "z-image" | "wan", "fingerprint": "<16 hex>", "model": "<id, informational>",
     "steps": [25, 50], ...}

- TeaCache: ``coefficients`` (5 numbers, highest power first as ``numpy.polyfit``),
  ``input_range`` ``[low, high]``, ``threshold`` (the default), ``r2`` (the fit's), ``samples``;
- MagCache: ``ratios`` and ``std``: ``{"<steps>": {"cond": [...], "uncond": [...]}}`` (one number
  per step, the first 1.0), ``threshold``, ``max_skip_steps``, ``retention_ratio`` (the defaults).

A model is identified by its family and the fingerprint of its transformer's config (a hash of the
config's values): calibrations carry over between checkpoints of one architecture only as far as
their weights agree, so a fine-tune should be recalibrated. The server reads
``--step-cache-calibration FILE`` (repeatable), ``<model folder>/omnirt-calibration/*.json`` and the
files shipped for the embedded demo models (``calibrations/`` beside this module).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ...pipeline import RequestRejected

log = logging.getLogger(__name__)

FORMAT = "omnirt-step-cache-calibration"
VERSION = 1
#: Calibration files inside a model folder.
CALIBRATION_DIR = "omnirt-calibration"
#: The shipped calibrations of the embedded demo models.
SHIPPED_DIR = Path(__file__).with_name("calibrations")
POLY_DEGREE = 4

CacheBackend = Literal["teacache", "magcache"]


@dataclass(frozen=True)
class TeaCacheCalibration:
    family: str
    fingerprint: str
    model: str
    steps: tuple[int, ...]
    coefficients: tuple[float, ...]
    input_range: tuple[float, float]
    threshold: float
    r2: float
    samples: int
    backend: Literal["teacache"] = "teacache"


@dataclass(frozen=True)
class MagCacheCalibration:
    family: str
    fingerprint: str
    model: str
    steps: tuple[int, ...]
    #: Per calibrated step count, per branch: the ratio at each step (the first 1.0).
    ratios: Mapping[int, Mapping[str, tuple[float, ...]]]
    std: Mapping[int, Mapping[str, tuple[float, ...]]] = field(default_factory=dict)
    threshold: float = 0.06
    max_skip_steps: int = 3
    retention_ratio: float = 0.2
    backend: Literal["magcache"] = "magcache"

    def ratios_for(self, branch: str, steps: int) -> tuple[tuple[float, ...], int]:
        """The ratios to resample for a run of ``steps``: those calibrated at that step count,
        else at the largest one; a branch never calibrated (a model calibrated without guidance)
        takes the ``cond`` branch's. Returns them and the step count they were calibrated at."""
        at = steps if steps in self.ratios else max(self.ratios)
        by_branch = self.ratios[at]
        return by_branch.get(branch) or by_branch["cond"], at


Calibration = TeaCacheCalibration | MagCacheCalibration


def fingerprint(transformer: Any) -> str:
    """16 hex digits identifying a transformer's architecture: its class and its config's values."""
    config = getattr(transformer, "config", None)
    if config is None:
        raise ValueError("the transformer has no config to fingerprint")
    items = {k: v for k, v in dict(config).items() if not k.startswith("_")}
    text = json.dumps([type(transformer).__name__, items], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def calibrate_command(backend: str, model: str = "PATH") -> str:
    return f"omnirt calibrate {backend} --model {model} --prompts FILE --steps 25,50"


class UnknownModel(RequestRejected):
    """No calibration of this backend for the model (HTTP 400, naming the command that makes one)."""


# -- JSON ---------------------------------------------------------------------------------------------


def to_json(cal: Calibration) -> dict[str, Any]:
    head = {
        "format": FORMAT,
        "version": VERSION,
        "backend": cal.backend,
        "family": cal.family,
        "fingerprint": cal.fingerprint,
        "model": cal.model,
        "steps": list(cal.steps),
    }
    if isinstance(cal, TeaCacheCalibration):
        return {
            **head,
            "coefficients": list(cal.coefficients),
            "input_range": list(cal.input_range),
            "threshold": cal.threshold,
            "r2": cal.r2,
            "samples": cal.samples,
        }
    return {
        **head,
        "ratios": {str(s): {b: list(r) for b, r in v.items()} for s, v in sorted(cal.ratios.items())},
        "std": {str(s): {b: list(r) for b, r in v.items()} for s, v in sorted(cal.std.items())},
        "threshold": cal.threshold,
        "max_skip_steps": cal.max_skip_steps,
        "retention_ratio": cal.retention_ratio,
    }


def _numbers(value: Any, what: str, length: int | None = None) -> tuple[float, ...]:
    if not isinstance(value, list) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in value
    ):
        raise ValueError(f"{what} must be a list of finite numbers")
    if length is not None and len(value) != length:
        raise ValueError(f"{what} must have {length} numbers, has {len(value)}")
    return tuple(float(v) for v in value)


def _per_steps(value: Any, what: str) -> dict[int, dict[str, tuple[float, ...]]]:
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be an object keyed by step count")
    out: dict[int, dict[str, tuple[float, ...]]] = {}
    for key, branches in value.items():
        if not str(key).isdigit() or int(key) < 1 or not isinstance(branches, dict):
            raise ValueError(f"{what}: bad entry {key!r}")
        steps = int(key)
        out[steps] = {}
        for branch, numbers in branches.items():
            if branch not in ("cond", "uncond"):
                raise ValueError(f"{what}[{key}]: unknown branch {branch!r}")
            out[steps][branch] = _numbers(numbers, f"{what}[{key}][{branch}]", steps)
    return out


def from_json(data: Any) -> Calibration:
    """A calibration from its JSON object; ``ValueError`` naming what is wrong."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f'not a step-cache calibration (no "format": "{FORMAT}")')
    if data.get("version") != VERSION:
        raise ValueError(f"calibration version {data.get('version')!r} (this server reads {VERSION})")
    try:
        family, fp, model = str(data["family"]), str(data["fingerprint"]), str(data.get("model", ""))
        steps = tuple(int(s) for s in data["steps"])
        backend = data["backend"]
        if backend == "teacache":
            low, high = _numbers(data["input_range"], "input_range", 2)
            if not low <= high:
                raise ValueError("input_range must be [low, high] with low <= high")
            return TeaCacheCalibration(
                family=family,
                fingerprint=fp,
                model=model,
                steps=steps,
                coefficients=_numbers(data["coefficients"], "coefficients", POLY_DEGREE + 1),
                input_range=(low, high),
                threshold=float(data["threshold"]),
                r2=float(data.get("r2", float("nan"))),
                samples=int(data.get("samples", 0)),
            )
        if backend == "magcache":
            ratios = _per_steps(data["ratios"], "ratios")
            if not ratios or any("cond" not in v for v in ratios.values()):
                raise ValueError("ratios must hold a 'cond' array for every step count")
            for v in ratios.values():
                for r in v.values():
                    if any(x <= 0 for x in r):
                        raise ValueError("ratios must be positive")
            return MagCacheCalibration(
                family=family,
                fingerprint=fp,
                model=model,
                steps=steps,
                ratios=ratios,
                std=_per_steps(data.get("std", {}), "std"),
                threshold=float(data["threshold"]),
                max_skip_steps=int(data["max_skip_steps"]),
                retention_ratio=float(data["retention_ratio"]),
            )
    except KeyError as exc:
        raise ValueError(f"calibration lacks {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bad calibration: {exc}") from None
    raise ValueError(f"unknown backend {data.get('backend')!r} (teacache or magcache)")


def save(cal: Calibration, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_json(cal), indent=1) + "\n")


def load(path: Path) -> Calibration:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{str(path)!r}: not readable JSON ({exc})") from None
    try:
        return from_json(data)
    except ValueError as exc:
        raise ValueError(f"{str(path)!r}: {exc}") from None


# -- lookup ---------------------------------------------------------------------------------------------


class CalibrationStore:
    """Calibrations by (backend, family, fingerprint); a later one replaces an earlier one."""

    def __init__(self, calibrations: Iterable[Calibration] = ()) -> None:
        self._by_key: dict[tuple[str, str, str], Calibration] = {}
        for cal in calibrations:
            self.add(cal)

    def add(self, cal: Calibration) -> None:
        self._by_key[(cal.backend, cal.family, cal.fingerprint)] = cal

    def add_file(self, path: Path, level: int = logging.INFO) -> Calibration:
        """The calibration of ``path``, logged at ``level``."""
        cal = load(path)
        self.add(cal)
        log.log(
            level,
            "step-cache calibration: %s for %s (%s) from %s",
            cal.backend,
            cal.model,
            cal.fingerprint,
            path,
        )
        return cal

    def add_dir(self, directory: Path, level: int = logging.INFO) -> int:
        """Every ``*.json`` of ``directory`` (none when it does not exist), each logged at ``level``;
        unreadable ones are logged and skipped (a folder may hold other files)."""
        count = 0
        if not directory.is_dir():
            return 0
        for path in sorted(directory.glob("*.json")):
            try:
                self.add_file(path, level)
                count += 1
            except ValueError as exc:
                log.warning("skipping %s: %s", path, exc)
        return count

    def find(self, backend: str, family: str, fp: str) -> Calibration | None:
        return self._by_key.get((backend, family, fp))

    def require(
        self, backend: str, family: str, fp: str, model: str, source: str | None = None
    ) -> Calibration:
        cal = self.find(backend, family, fp)
        if cal is None:
            raise UnknownModel(
                f"cache_backend {backend!r}: model {model!r} ({family}, transformer fingerprint {fp}) has no "
                f"{backend} calibration. Make one with `{calibrate_command(backend, source or 'PATH')}` and "
                f"give it to the server with --step-cache-calibration FILE (or put it in "
                f"<model folder>/{CALIBRATION_DIR}/)."
            )
        return cal

    def __len__(self) -> int:
        return len(self._by_key)


def default_store(source: str | None, files: Sequence[Path] = ()) -> CalibrationStore:
    """The shipped calibrations, then ``<source>/omnirt-calibration/*.json``, then ``files`` (the
    shipped ones, read for every pipeline, logged at DEBUG; the operator's at INFO)."""
    store = CalibrationStore()
    store.add_dir(SHIPPED_DIR, logging.DEBUG)
    if source:
        folder = Path(source)
        if folder.is_dir():
            store.add_dir(folder / CALIBRATION_DIR)
    for path in files:
        store.add_file(Path(path))
    return store
