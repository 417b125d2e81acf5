"""What one ``omnirt serve`` process builds: the model pipelines, the engine and the app.

:func:`build_app` is shared by the single-process server (``realtime/cli.py``, which runs the app
on uvicorn) and by each replica of ``omnirt serve --replicas N`` (``realtime/replicas/``, where
Ray Serve runs it behind its HTTP proxy), so both serve exactly the same thing for the same
options. A bad option (a model that cannot load, an unknown voice alias, a step cache without a
diffusion model) raises :class:`BuildError` with the message to show.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from starlette.applications import Starlette

from .config import ServerConfig

log = logging.getLogger("omnirt.serve")


class BuildError(ValueError):
    """The server cannot be built from these options (the message says why)."""


def build_app(config: ServerConfig, *, device: str | None, load_format: str = "auto") -> Starlette:
    """The pipelines, engine and app for ``config`` (heavy: loads or builds the models)."""
    from omnirt.kernels import settings as kernel_settings
    from omnirt.sessions.voices import VoiceCatalog
    from omnirt.stages.engine import Engine, EngineClient
    from omnirt.stages.factory import build_pipelines, configure_host_threads

    from .app import create_app

    check_device(device)
    kernel_settings.set_fused(config.fused_kernels)  # before the models: the DiT loaders install them
    kernel_settings.set_vae_fast(config.vae_fast)
    kernel_settings.set_fp8_attention(config.fp8_attention)
    try:
        pipelines = build_pipelines(
            config.models,
            device=device,
            max_slots=config.max_sessions,
            cuda_graphs=config.cuda_graphs,
            prefill_chunk=config.prefill_chunk,
            max_context=config.max_context,
            prefix_cache=config.prefix_cache,
            load_format=load_format,
            quantization=config.quantization,
            duplex_model=config.duplex_model,
            duplex_kv_dtype=config.duplex_kv_dtype,
            duplex_max_frames=config.duplex_max_frames,
        )
        engine = Engine(pipelines, batch_slice=config.batch_slice_ms / 1000 or None)
    except ValueError as exc:
        raise BuildError(f"cannot load the model: {exc}") from exc
    try:
        _configure_step_caches(pipelines, config)
    except ValueError as exc:
        raise BuildError(f"step cache: {exc}") from exc
    _configure_speech(pipelines, config)
    configure_host_threads(pipelines)
    info = pipelines[0].info
    try:
        voices = VoiceCatalog.for_model(tuple(info.voices), config.voice_aliases)
    except ValueError as exc:
        raise BuildError(f"bad --voice-alias: {exc}") from exc
    if info.random_weights and load_format == "dummy":
        log.warning(
            "model %s has RANDOM WEIGHTS (--load-format dummy): the real architecture and size, for "
            "benchmarks; its words and speech are noise.",
            info.id,
        )
    elif info.random_weights:
        log.warning(
            "model %s has the embedded RANDOM weights: its words and speech are noise. It is for trying "
            "the server and for tests; pass --model PATH to serve a real checkpoint.",
            info.id,
        )
    log.info("voices: %s; aliases: %s", ", ".join(voices.model) or "any", dict(voices.aliases))
    for kind, pipeline in engine.pipelines.items():
        model = pipeline.info
        weights = ", RANDOM weights" if model.random_weights else ""
        log.info("%s pipeline: %s (%s, from %s%s)", kind, model.id, model.architecture, model.source, weights)
    return create_app(EngineClient(engine), config)


def check_device(device: str | None) -> None:
    """``--device cuda`` or ``cuda:N`` only where torch sees that GPU: :class:`BuildError` otherwise
    (rather than torch's assertion deep in the first model's load)."""
    if device is None or not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        why = "this torch has no CUDA support" if torch.version.cuda is None else "no CUDA device is visible"
        raise BuildError(f"--device {device}: {why}; use --device cpu")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise BuildError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def _configure_speech(pipelines: Sequence[object], config: ServerConfig) -> None:
    """The speech pipeline's first-audio deadline (``SpeechPipeline.next_deadline``) and whether
    it reads prompts in ticks of their own (``SpeechPipeline.prompt_ticks``)."""
    for pipeline in pipelines:
        if hasattr(pipeline, "first_audio_target"):
            pipeline.first_audio_target = config.first_audio_target_ms / 1000
        if hasattr(pipeline, "prompt_ticks"):
            pipeline.prompt_ticks = config.prompt_ticks


def _configure_step_caches(pipelines: Sequence[object], config: ServerConfig) -> None:
    if not any(hasattr(p, "step_cache") for p in pipelines):
        if config.step_cache != "none" or config.step_cache_calibrations:
            raise ValueError("--step-cache and --step-cache-calibration need an image or video model")
        return
    from omnirt.stages.diffusion.cache.server import configure_step_caches

    configure_step_caches(
        pipelines,
        backend=config.step_cache,
        config=config.step_cache_config,
        calibrations=config.step_cache_calibrations,
    )
