"""Step caches on CUDA: no host sync in the cache's own work (every call of it runs under
``torch.cuda.set_sync_debug_mode("error")``), threshold 0 still bitwise the uncached output, and
skipping on the tiny Z-Image in bfloat16 with split calls (the server's CUDA default)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from omnirt.stages.diffusion.cache.state import CachedCall, StepCaches
from omnirt.stages.diffusion.pipeline import DiffusionPipeline
from omnirt.stages.diffusion.types import GeneratedImage, ImageRequest
from omnirt.stages.diffusion.zimage_loader import load_zimage

from .conftest import pixels, run_to_end
from .step_cache_util import store_for

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _strict(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    return wrapper


@pytest.fixture
def strict_cache(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every method of the cache the runtime calls raises on a synchronising CUDA call."""
    monkeypatch.setattr(StepCaches, "begin", _strict(StepCaches.begin))
    for name in ("known", "resolve", "apply", "store", "keep"):
        monkeypatch.setattr(CachedCall, name, _strict(getattr(CachedCall, name)))
    yield


def test_the_cache_never_syncs_and_threshold_zero_stays_exact(zimage_dir: Path, strict_cache: None) -> None:
    den = load_zimage(zimage_dir, device="cuda")
    store = store_for(den)

    def images(
        backend: str | None, config: dict | None, split: bool = True
    ) -> tuple[list, DiffusionPipeline]:
        p = DiffusionPipeline(den, split_calls=split, step_cache=StepCaches(den, store=store))
        request = ImageRequest(
            "r", "a boat", n=2, width=64, height=64, num_inference_steps=8, guidance_scale=2.0, seed=3,
            cache_backend=backend, cache_config=config,
        )  # fmt: skip
        out = run_to_end(p, [request])["r"]
        return [pixels(o.png) for o in out if isinstance(o, GeneratedImage)], p

    plain, _ = images(None, None)
    for backend in ("teacache", "magcache"):
        zero, p = images(backend, {"threshold": 0})
        assert all((a == b).all() for a, b in zip(zero, plain, strict=True)), backend
        assert p.calls["transformer_skipped", 2] == 0
        _, p = images(backend, {"threshold": 10.0} if backend == "teacache" else {"threshold": 0.5})
        assert p.calls["transformer_skipped", 2] > 0, backend
        _, p = images(
            backend, {"threshold": 10.0} if backend == "teacache" else {"threshold": 0.5}, split=False
        )
        assert p.calls["transformer_skipped", 2] > 0, backend
    # The flags travel through pinned memory behind an event.
    _, p = images("teacache", {"threshold": 10.0})
    print(f"[gpu] step cache: {dict(p.calls)}")
