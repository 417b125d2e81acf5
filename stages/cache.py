"""The embedded default's models, built once into the cache (``OMNIRT_CACHE``, else
``~/.cache/omnirt``) and reused: one folder per recipe key, completed atomically."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

#: Written last into every built folder: a folder without it is not complete.
MARKER = "omnirt_demo.json"


def default_cache_root() -> Path:
    root = os.environ.get("OMNIRT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "omnirt")
    return Path(root)


def ensure_built(name: str, build: Callable[[Path], None], cache_root: Path | None = None) -> Path:
    """``cache_root / name``, made by ``build(folder)`` on first use: built in a temporary folder
    beside it, then renamed into place, so a reader never sees half a model and two processes
    building at once both end with the complete one. ``build`` must write :data:`MARKER`."""
    root = cache_root or default_cache_root()
    target = root / name
    if (target / MARKER).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        build(tmp / "model")
        if not (tmp / "model" / MARKER).is_file():
            raise RuntimeError(f"building {name} did not write {MARKER}")
        try:
            os.rename(tmp / "model", target)
        except OSError:
            if not (target / MARKER).is_file():
                raise  # someone else won the race only if the target is complete
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("built %s (random weights) at %s", name, target)
    return target
