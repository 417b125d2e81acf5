"""Picks and loads the model pipeline the server runs (``--model``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from .pipeline import Pipeline

if TYPE_CHECKING:
    from .diffusion.pipeline import DiffusionPipeline

log = logging.getLogger(__name__)

DEMO_NAMES = (None, "", "demo")


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def build_pipeline(
    model: str | None,
    *,
    device: str | None = None,
    max_slots: int = 32,
    cuda_graphs: bool = True,
    load_format: str = "auto",
) -> Pipeline:
    """The speech pipeline for ``model``: None or ``"demo"`` for the embedded default (a tiny
    Qwen3-Omni with random weights, built into the cache on first use), else a local checkpoint
    folder in the published layout. A missing or unloadable folder raises ``ValueError``.
    ``cuda_graphs``, ``load_format`` (``"dummy"``: random weights from config.json alone): see
    :func:`.speech.loader.load_speech_pipeline`."""
    from .speech.demo import ensure_demo_checkpoint
    from .speech.loader import load_speech_pipeline

    device = device or _default_device()
    if model in DEMO_NAMES:
        path = ensure_demo_checkpoint()
        log.warning(
            "no --model given: serving the embedded demo Qwen3-Omni with RANDOM WEIGHTS (%s); "
            "its text and speech are noise. Pass --model PATH for a real checkpoint.",
            path,
        )
        # Random weights never say the end code: cap the babble at about 0.3 s per reply token.
        return load_speech_pipeline(
            path,
            device=device,
            max_slots=max_slots,
            model_id="demo-qwen3-omni",
            random_weights=True,
            audio_frames_per_token=4.0,
            cuda_graphs=cuda_graphs,
            warm_up=True,
            load_format=load_format,
        )
    path = Path(model).expanduser()  # type: ignore[arg-type]
    if not path.exists():
        raise ValueError(
            f"--model {model!r}: no such file or folder (nothing is downloaded; give a local path)"
        )
    return load_speech_pipeline(
        path,
        device=device,
        max_slots=max_slots,
        cuda_graphs=cuda_graphs,
        warm_up=True,
        load_format=load_format,
    )


def build_image_pipeline(
    model: str | None,
    *,
    device: str | None = None,
    load_format: str = "auto",
    max_rows: int = 8,
) -> DiffusionPipeline:
    """The image generation pipeline for ``model``: None or ``"demo"`` for the embedded default (a
    tiny Z-Image with random weights, built into the cache on first use), else a local diffusers
    folder whose ``model_index.json`` names ``ZImagePipeline``; with ``load_format="dummy"`` the
    folder's configs alone (or a components JSON file) give random weights at real size. A missing
    or unloadable model raises ``ValueError``."""
    from .diffusion.pipeline import DiffusionPipeline
    from .diffusion.zimage_demo import DEMO_ID, ensure_zimage_demo
    from .diffusion.zimage_loader import PIPELINE_CLASS, load_zimage, pipeline_class

    device = device or _default_device()
    if model in DEMO_NAMES:
        path = ensure_zimage_demo()
        log.warning(
            "no image model given: serving the embedded demo Z-Image with RANDOM WEIGHTS (%s); "
            "its images are noise. Pass a diffusers folder for a real model.",
            path,
        )
        denoiser = load_zimage(
            path, device=device, model_id=DEMO_ID, random_weights=True, load_format=load_format
        )
        return DiffusionPipeline(denoiser, max_rows=max_rows)
    path = Path(model).expanduser()  # type: ignore[arg-type]
    if not path.exists():
        raise ValueError(
            f"image model {model!r}: no such file or folder (nothing is downloaded; give a local path)"
        )
    if path.is_dir() and pipeline_class(path) != PIPELINE_CLASS:
        raise ValueError(
            f"image model {model!r}: not a diffusers {PIPELINE_CLASS} folder "
            f"(model_index.json names {pipeline_class(path)!r})"
        )
    return DiffusionPipeline(load_zimage(path, device=device, load_format=load_format), max_rows=max_rows)
