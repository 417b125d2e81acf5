"""A tiny random-weight Z-Image in the diffusers layout (the embedded default's recipe), built
once per test session, and helpers to run the diffusion pipeline to completion."""

from __future__ import annotations

import collections
import io
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from omnirt.stages.diffusion.pipeline import DiffusionPipeline
from omnirt.stages.diffusion.zimage import ZImageDenoiser
from omnirt.stages.diffusion.zimage_demo import build_tiny_zimage
from omnirt.stages.diffusion.zimage_loader import load_zimage
from omnirt.stages.engine import Engine
from omnirt.stages.types import Finished

from tests.stages.pipelines import FakeClock


@pytest.fixture(scope="session")
def zimage_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("zimage") / "tiny-z-image"
    build_tiny_zimage(path)
    return path


@pytest.fixture(scope="session")
def denoiser(zimage_dir: Path) -> ZImageDenoiser:
    return load_zimage(zimage_dir, device="cpu")


def pixels(png: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def run_to_end(pipeline: DiffusionPipeline, requests, max_steps: int = 1000) -> dict[str, list]:  # type: ignore[no-untyped-def]
    """Admits ``requests`` and steps until each has finished; the outputs per request id."""
    out: dict[str, list] = {}
    for request in requests:
        pipeline.add(request, pipeline.prepare(request))
        out[request.request_id] = []
    for _ in range(max_steps):
        if not pipeline.has_work():
            if not pipeline.media.busy():
                break
            time.sleep(0.001)  # an encoding thread is still at it (the server's pipelines)
            continue
        for rid, output in pipeline.step():
            out[rid].append(output)
    assert all(isinstance(o[-1], Finished) for o in out.values()), "a request never finished"
    return out


class Timed:
    """A denoiser whose calls spend simulated time (``costs``: seconds per call, by method name)."""

    def __init__(self, inner: Any, clock: FakeClock, **costs: float) -> None:
        self._inner, self._clock, self._costs = inner, clock, costs

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        cost = self._costs.get(name)
        if cost is None:
            return value

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._clock.spend(cost)
            return value(*args, **kwargs)

        return timed


def run_in_engine(
    engine: Engine,
    requests: Sequence[Any],
    on_output: Callable[[str, object], None] | None = None,
    timeout: float = 60,
) -> dict[str, list]:
    """Starts ``engine``, submits ``requests``, waits until each has finished and stops it; the
    outputs per request id. ``on_output(rid, output)`` is called from the engine's thread."""
    outputs: dict[str, list] = collections.defaultdict(list)
    ended: dict[str, threading.Event] = collections.defaultdict(threading.Event)

    def sink_for(rid: str) -> Callable[[object], None]:
        def sink(output: object) -> None:
            outputs[rid].append(output)
            if on_output is not None:
                on_output(rid, output)
            if isinstance(output, Finished):
                ended[rid].set()

        return sink

    engine.start()
    try:
        for request in requests:
            engine.submit(request, sink_for(request.request_id))
        for request in requests:
            assert ended[request.request_id].wait(timeout), f"{request.request_id} never finished"
    finally:
        engine.stop()
    return outputs
