"""Picks and loads the model pipelines the server runs (``--model``, given any number of times).

:func:`build_pipelines` decides each ``--model`` by its layout (:func:`model_family`): a folder
with ``model_index.json`` is a diffusers pipeline (image or video), a folder with a
``config.json`` of Qwen3-Omni is the speech model; with ``--load-format dummy`` a config file
alone stands for either. Speech is built by :func:`build_pipeline`, diffusion by
``omnirt.stages.diffusion.factory``. No ``--model`` (or only ``demo``) serves the embedded
default: the demo speech model and the embedded image and video pipelines. The duplex model
(``--duplex-model``) is built by :func:`build_duplex_pipeline`: the embedded tiny one with the
embedded default (or ``"demo"``), a local Moshi checkpoint for a path, none for ``"none"``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .pipeline import Pipeline

log = logging.getLogger(__name__)

DEMO_NAMES = (None, "", "demo")
#: ``model_type`` of the speech models served.
SPEECH_MODEL_TYPES = ("qwen3_omni_moe",)

ModelFamily = Literal["speech", "diffusion"]


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def build_pipeline(
    model: str | None,
    *,
    device: str | None = None,
    max_slots: int = 32,
    cuda_graphs: bool = True,
    prefill_chunk: int = 512,
    prefix_cache: bool = True,
    load_format: str = "auto",
    max_context: int | None = None,
) -> Pipeline:
    """The speech pipeline for ``model``: None or ``"demo"`` for the embedded default (a tiny
    Qwen3-Omni with random weights, built into the cache on first use), else a local checkpoint
    folder in the published layout. A missing or unloadable folder raises ``ValueError``.
    ``cuda_graphs``, ``prefill_chunk``, ``prefix_cache``, ``load_format`` (``"dummy"``: random weights from
    config.json alone), ``max_context``: see :func:`.speech.loader.load_speech_pipeline`."""
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
            prefill_chunk=prefill_chunk,
            prefix_cache=prefix_cache,
            warm_up=True,
            load_format=load_format,
            max_context=max_context,
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
        prefill_chunk=prefill_chunk,
        prefix_cache=prefix_cache,
        warm_up=True,
        load_format=load_format,
        max_context=max_context,
    )


def _read_json(path: Path, model: str) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--model {model!r}: {path} is not readable JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"--model {model!r}: {path} does not hold a JSON object")
    return value


def model_family(model: str) -> ModelFamily:
    """Which pipeline serves the local ``model`` path, by its layout; ``ValueError`` if none does.

    A folder: ``model_index.json`` (diffusers) -> diffusion; ``config.json`` of a speech model
    type -> speech. A file (a config alone, for ``--load-format dummy``): a diffusers
    ``model_index.json`` or component configs (``_class_name`` or a ``transformer`` entry) ->
    diffusion; a speech ``config.json`` -> speech."""
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(
            f"--model {model!r}: no such file or folder (nothing is downloaded; give a local path)"
        )
    if path.is_dir():
        if (path / "model_index.json").is_file():
            return "diffusion"
        if not (path / "config.json").is_file():
            raise ValueError(
                f"--model {model!r}: the folder has neither model_index.json (a diffusers pipeline) "
                "nor config.json (a speech checkpoint)"
            )
        config = _read_json(path / "config.json", model)
    else:
        config = _read_json(path, model)
        if "_class_name" in config or any(k == "transformer" or k.startswith("transformer_") for k in config):
            return "diffusion"
    if config.get("model_type") in SPEECH_MODEL_TYPES:
        return "speech"
    raise ValueError(
        f"--model {model!r} holds a {config.get('model_type')!r} model; served here: "
        f"{', '.join(SPEECH_MODEL_TYPES)} (speech) and diffusers pipelines (model_index.json)"
    )


def _check_diffusion_kinds(models: Sequence[str]) -> None:
    """Two image (or two video) models are refused before any of them loads: the engine serves one
    pipeline of each kind, and loading and warming up a real model takes minutes. (Without a
    diffusion runtime the builder says so instead.)"""
    try:
        from .diffusion.factory import diffusion_kind
    except ModuleNotFoundError as exc:
        if exc.name != f"{__package__}.diffusion.factory":
            raise
        return
    seen: dict[str, str] = {}
    for model in models:
        kind = diffusion_kind(Path(model).expanduser())
        if kind in seen:
            raise ValueError(f"one {kind} model per server, got two: {seen[kind]} and {model}")
        seen[kind] = model


def build_diffusion_pipeline(
    path: Path, *, device: str, load_format: str, quantization: str = "none", cuda_graphs: bool = True
) -> Pipeline:
    """The image or video pipeline of a diffusers folder (``omnirt.stages.diffusion.factory``)."""
    try:
        from .diffusion.factory import build_diffusion_pipeline as build
    except ModuleNotFoundError as exc:
        if exc.name != f"{__package__}.diffusion.factory":
            raise
        raise ValueError(
            f"--model {str(path)!r} is a diffusers pipeline, but this build has no diffusion runtime"
        ) from None
    return build(
        path, device=device, load_format=load_format, quantization=quantization, cuda_graphs=cuda_graphs
    )


def build_embedded_diffusion(
    *, device: str, quantization: str = "none", cuda_graphs: bool = True
) -> list[Pipeline]:
    """The embedded image and video pipelines (tiny, random weights) of the default server."""
    try:
        from .diffusion.factory import build_embedded_diffusion_pipelines as build
    except ModuleNotFoundError as exc:
        if exc.name != f"{__package__}.diffusion.factory":
            raise
        log.warning("this build has no diffusion runtime: the embedded default serves speech only")
        return []
    return build(device=device, quantization=quantization, cuda_graphs=cuda_graphs)


def build_duplex_pipeline(
    model: str,
    *,
    device: str,
    max_slots: int = 32,
    cuda_graphs: bool = True,
    kv_dtype: str = "auto",
    max_frames: int | None = None,
) -> Pipeline | None:
    """The duplex pipeline of ``model``: ``"demo"`` for the embedded tiny Moshi-architecture model
    (random weights; None, with a warning, in a build without it), else a local Moshi checkpoint
    folder with its tokenizer (``ValueError`` when it does not load; the LM in bfloat16 on CUDA,
    float32 on CPU: :func:`.duplex.loader.load_duplex`). ``kv_dtype`` (``auto`` or ``fp8``) and
    ``max_frames`` (the window; None: the model's) shape the LM's KV cache."""
    from .duplex.pipeline import DuplexPipeline
    from .types import ModelInfo

    if model in DEMO_NAMES:
        try:
            from .duplex.demo import demo_duplex
        except ModuleNotFoundError as exc:
            if exc.name != f"{__package__}.duplex.demo":
                raise
            log.warning("this build has no embedded duplex model: duplex=1 sessions are refused")
            return None
        lm, mimi, tokenizer = demo_duplex(
            max_slots, device, graphs=cuda_graphs, kv_dtype=kv_dtype, max_frames=max_frames
        )
        info = ModelInfo("demo-moshi", "moshi", random_weights=True, source="embedded")
        log.warning("serving the embedded demo duplex model (Moshi architecture) with RANDOM WEIGHTS")
    else:
        from .duplex.loader import load_duplex

        path = Path(model).expanduser()
        if not path.exists():
            raise ValueError(
                f"--duplex-model {model!r}: no such file or folder (nothing is downloaded; give a local path)"
            )
        lm, mimi, tokenizer = load_duplex(
            path,
            max_slots=max_slots,
            device=device,
            graphs=cuda_graphs,
            kv_dtype=kv_dtype,
            max_frames=max_frames,
        )
        info = ModelInfo(path.name, "moshi", random_weights=False, source=str(path))
    from .duplex.lm import DuplexSampling

    return DuplexPipeline(lm, mimi, tokenizer, info=info, sampling=DuplexSampling(), cuda_graphs=cuda_graphs)


@dataclass(frozen=True)
class Builders:
    """What :func:`build_pipelines` calls for each family (tests give fakes)."""

    speech: Callable[..., Pipeline] = build_pipeline
    diffusion: Callable[..., Pipeline] = build_diffusion_pipeline
    embedded_diffusion: Callable[..., list[Pipeline]] = build_embedded_diffusion
    duplex: Callable[..., Pipeline | None] = build_duplex_pipeline


def build_pipelines(
    models: Sequence[str | None],
    *,
    device: str | None = None,
    max_slots: int = 32,
    cuda_graphs: bool = True,
    prefill_chunk: int = 512,
    prefix_cache: bool = True,
    load_format: str = "auto",
    max_context: int | None = None,
    quantization: str = "none",
    duplex_model: str | None = None,
    duplex_kv_dtype: str = "auto",
    duplex_max_frames: int | None = None,
    builders: Builders = Builders(),
) -> list[Pipeline]:
    """The pipelines of ``--model`` (each given path or ``"demo"``), the speech one first.

    No models, or only ``"demo"``: the embedded default (demo speech, embedded image and video
    pipelines). Otherwise each path is built by its family (:func:`model_family`); ``"demo"``
    stands for the demo speech model. At most one speech model. ``quantization`` applies to the
    diffusion models (W8A8 DiT linear layers); speech models load as they are. ``ValueError``
    says what is wrong (a path no pipeline serves, two speech models, a model that does not
    load). ``max_context``: the speech slots' context (None: the loader's plan). ``duplex_model``:
    see :func:`build_duplex_pipeline`; None serves the embedded duplex model with the embedded
    default and none otherwise; ``"none"``: none. ``duplex_kv_dtype`` and ``duplex_max_frames``:
    its KV cache (:func:`build_duplex_pipeline`)."""
    device = device or _default_device()
    speech: list[str | None] = []
    diffusion: list[str] = []
    for model in models:
        if model in DEMO_NAMES or model_family(model) == "speech":  # type: ignore[arg-type]
            speech.append(model)
        else:
            diffusion.append(model)  # type: ignore[arg-type]
    if len(speech) > 1:
        raise ValueError(f"one speech model per server, got {len(speech)}: {', '.join(map(str, speech))}")
    embedded = not diffusion and all(m in DEMO_NAMES for m in speech)
    _check_diffusion_kinds(diffusion)
    if quantization != "none" and not diffusion and not embedded:
        raise ValueError(
            f"--quantization {quantization} quantizes image and video transformers; no image or video "
            "model is served (speech models load as they are)"
        )
    pipelines: list[Pipeline] = []
    if speech or embedded:
        model = speech[0] if speech else None
        pipelines.append(
            builders.speech(
                model,
                device=device,
                max_slots=max_slots,
                cuda_graphs=cuda_graphs,
                prefill_chunk=prefill_chunk,
                prefix_cache=prefix_cache,
                load_format=load_format,
                max_context=max_context,
            )
        )
    if embedded:
        pipelines += builders.embedded_diffusion(
            device=device, quantization=quantization, cuda_graphs=cuda_graphs
        )
    for model in diffusion:
        pipelines.append(
            builders.diffusion(
                Path(model).expanduser(),
                device=device,
                load_format=load_format,
                quantization=quantization,
                cuda_graphs=cuda_graphs,
            )
        )
    duplex = duplex_model if duplex_model is not None else ("demo" if embedded else "none")
    if duplex != "none":
        built = builders.duplex(
            duplex,
            device=device,
            max_slots=max_slots,
            cuda_graphs=cuda_graphs,
            kv_dtype=duplex_kv_dtype,
            max_frames=duplex_max_frames,
        )
        if built is not None:
            pipelines.append(built)
    return pipelines


def configure_host_threads(pipelines: Sequence[Any]) -> None:
    """On CUDA, torch's CPU ops (the few a prompt pass runs on the host) get one thread unless
    ``OMP_NUM_THREADS`` says otherwise: with a pool of one per core, each such op waits for
    every pool thread, and while a PNG or MP4 is encoded beside the engine (libx264 starts about
    1.5 threads a core) some are always descheduled: prompt ticks took 4x as long on the H200
    (docs/benchmarks.md, issue 10). On CPU the models' own work needs the pool."""
    import torch

    def device(p: Any) -> Any:
        return getattr(p, "device", None) or getattr(getattr(p, "denoiser", None), "device", None)

    on_cuda = any(getattr(device(p), "type", None) == "cuda" for p in pipelines)
    if on_cuda and "OMP_NUM_THREADS" not in os.environ and torch.get_num_threads() != 1:
        log.info("torch CPU threads: 1 (was %d; the models run on CUDA)", torch.get_num_threads())
        torch.set_num_threads(1)
