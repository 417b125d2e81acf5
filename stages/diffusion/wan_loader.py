"""Loads a Wan2.1 text-to-video pipeline into a :class:`~.wan.WanDenoiser`.

``load_format="auto"``: a local diffusers folder (``model_index.json`` naming ``WanPipeline``;
``tokenizer/``, ``text_encoder/``, ``transformer/``, ``vae/``, ``scheduler/``), read with the
components' own ``from_pretrained`` (the transformer keeps diffusers' fp32 modules in fp32).

``load_format="dummy"``: the architecture from configs alone, with seeded random weights built on
the device: either such a folder without weights, or a components file like the published
``wan2.1-t2v.components.json`` (``transformer_<variant>``, ``text_encoder``, ``vae`` and
``defaults`` keys; ``variant`` picks the transformer, e.g. ``"1.3b"`` or ``"14b"``). What a
components file lacks comes from the embedded demo: its T5 tokenizer and the published Wan2.1
UniPC scheduler config.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import tempfile
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from ..checkpoints import READ_ERRORS, first_line, from_pretrained_checked
from ..types import ModelInfo
from .compressed import cast_keeping_fp32, load_transformer
from .denoiser import Defaults
from .quant import QUANTIZATIONS, quantize_model
from .wan import WanDenoiser, WanLimits
from .wan_demo import MARKER, WAN21_SCHEDULER_CONFIG, save_demo_tokenizer

log = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "dummy")
ARCHITECTURE = "WanPipeline"
#: Wan2.1's recommended settings (the model card: 480p, 81 frames at 16 fps, 50 steps, CFG 5).
WAN21_DEFAULTS = Defaults(
    width=832, height=480, num_inference_steps=50, guidance_scale=5.0, num_frames=81, fps=16
)
COMPONENTS = ("tokenizer", "text_encoder", "transformer", "vae", "scheduler")


class WanLoadError(ValueError):
    """The folder or file is not a Wan2.1 T2V pipeline this loader can serve."""


def load_wan(
    path: str | Path,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    vae_dtype: torch.dtype = torch.float32,
    load_format: str = "auto",
    seed: int = 0,
    variant: str | None = None,
    model_id: str | None = None,
    limits: WanLimits | None = None,
    max_sequence_length: int = 512,
    flow_shift: float | None = None,
    quantization: str = "none",
) -> WanDenoiser:
    """A :class:`WanDenoiser` for ``path`` (see the module doc for the two load formats).

    ``dtype`` (text encoder and transformer) defaults to float32 on CPU and bfloat16 elsewhere;
    the VAE runs in ``vae_dtype`` (float32, as diffusers recommends for Wan). ``flow_shift``
    overrides the scheduler's (3.0 suits 480p, 5.0 720p). ``limits`` default to the folder's demo
    marker's, else :class:`WanLimits`'s. ``quantization`` (``int8``, ``fp8``): the transformer's
    linear layers become W8A8 at load (``quant.py``), layer by layer on the device."""
    if quantization not in QUANTIZATIONS:
        known = ", ".join(QUANTIZATIONS)
        raise WanLoadError(f"unknown quantization {quantization!r}; expected one of: {known}")
    if load_format not in LOAD_FORMATS:
        raise WanLoadError(f"unknown load format {load_format!r}; expected one of: {', '.join(LOAD_FORMATS)}")
    path = Path(path).expanduser()
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype is None:
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    marker = _read_json(path / MARKER) if path.is_dir() and (path / MARKER).is_file() else {}
    start = time.perf_counter()
    if load_format == "dummy":
        parts, defaults = _build_dummy(path, device, dtype, vae_dtype, seed, variant)
        if quantization != "none":
            quantize_model(parts["transformer"], quantization, device=device)
        random_weights = True
    else:
        parts = _load_folder(path, device, dtype, vae_dtype, quantization)
        quantization = parts.pop("quantization")
        defaults = WAN21_DEFAULTS
        random_weights = bool(marker.get("random_weights"))
    if "defaults" in marker:
        defaults = Defaults(**marker["defaults"])
    if limits is None:
        limits = limits_from(marker["limits"]) if "limits" in marker else WanLimits()
    scheduler_config = parts.pop("scheduler_config")
    if flow_shift is not None:
        scheduler_config["flow_shift"] = float(flow_shift)
    info = ModelInfo(
        id=model_id or (path.stem if path.is_file() else path.name),
        architecture=ARCHITECTURE,
        random_weights=random_weights,
        source=str(path),
        quantization=quantization,
    )
    denoiser = WanDenoiser(
        **parts,
        scheduler_config=scheduler_config,
        info=info,
        defaults=defaults,
        limits=limits,
        device=device,
        max_sequence_length=max_sequence_length,
    )
    denoiser.sampler(_default_shape(defaults), defaults.num_inference_steps)  # the schedule's config works
    what = "weights"
    if random_weights:
        what = f"RANDOM WEIGHTS (dummy, seed {seed})" if load_format == "dummy" else "RANDOM WEIGHTS (demo)"
    log.info(
        "loaded Wan2.1 T2V %s from %s on %s (%s, VAE %s) in %.1f s: %s",
        info.id,
        path,
        device,
        dtype,
        vae_dtype,
        time.perf_counter() - start,
        what,
    )
    return denoiser


def _default_shape(d: Defaults):
    from .denoiser import Shape

    return Shape(width=d.width, height=d.height, frames=d.num_frames or 1)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise WanLoadError(f"cannot read {path}: {exc}") from exc


def _model_index(path: Path) -> dict[str, Any]:
    if not (path / "model_index.json").is_file():
        raise WanLoadError(f"{str(path)!r} is not a diffusers pipeline folder (no model_index.json)")
    index = _read_json(path / "model_index.json")
    if index.get("_class_name") != ARCHITECTURE:
        raise WanLoadError(f"{str(path)!r} holds a {index.get('_class_name')!r}, not a {ARCHITECTURE}")
    second = index.get("transformer_2")
    if (second and second[0] is not None) or index.get("boundary_ratio") is not None:
        raise WanLoadError(f"{str(path)!r} is a two-stage (Wan2.2) pipeline; only Wan2.1 T2V is supported")
    if index.get("expand_timesteps"):
        raise WanLoadError(f"{str(path)!r} expands timesteps (Wan2.2 TI2V); only Wan2.1 T2V is supported")
    missing = [c for c in COMPONENTS if not (path / c).is_dir()]
    if missing:
        raise WanLoadError(f"{str(path)!r} lacks the component folders: {', '.join(missing)}")
    return index


def _scheduler_config(path: Path, index: dict[str, Any]) -> dict[str, Any]:
    config = _read_json(path / "scheduler" / "scheduler_config.json")
    entry = index.get("scheduler") or [None, config.get("_class_name")]
    config["_class_name"] = entry[1]  # model_index names the class diffusers instantiates
    return config


def _load_folder(
    path: Path, device: torch.device, dtype: torch.dtype, vae_dtype: torch.dtype, quantization: str = "none"
) -> dict[str, Any]:
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import AutoTokenizer, UMT5EncoderModel

    index = _model_index(path)
    if importlib.util.find_spec("accelerate") is None:
        # WanTransformer3DModel keeps some modules in fp32, which diffusers only loads through
        # accelerate's low-memory path.
        raise WanLoadError("loading a Wan transformer needs the accelerate package (pip install accelerate)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path / "tokenizer"))
    except (*READ_ERRORS, ValueError) as exc:
        raise WanLoadError(f"{path / 'tokenizer'}: the tokenizer does not load ({first_line(exc)})") from None
    text_encoder = from_pretrained_checked(
        UMT5EncoderModel, path / "text_encoder", "text encoder", dtype=dtype, ignore_mismatched_sizes=True
    )
    transformer, stored = load_transformer(WanTransformer3DModel, path / "transformer", dtype=dtype)
    vae = from_pretrained_checked(AutoencoderKLWan, path / "vae", "VAE", torch_dtype=vae_dtype)
    if stored != "none":  # a W8A8 checkpoint: served as it is
        if quantization not in ("none", stored):
            raise WanLoadError(f"{path}: the transformer is stored {stored}, not servable as {quantization}")
    elif quantization != "none":  # on the CPU still: each layer quantized on the device in turn
        quantize_model(transformer, quantization, device=device)
    return {
        "quantization": stored if stored != "none" else quantization,
        "tokenizer": tokenizer,
        "text_encoder": text_encoder.to(device).eval(),
        "transformer": transformer.to(device).eval(),
        "vae": vae.to(device).eval(),
        "scheduler_config": _scheduler_config(path, index),
    }


def _config_of(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if not k.startswith("_")}


def _components_file(path: Path, variant: str | None) -> tuple[dict[str, Any], Defaults]:
    raw = _read_json(path)
    keys = [k for k in raw if k == "transformer" or k.startswith("transformer_")]
    if not keys:
        raise WanLoadError(f"{str(path)!r} has no transformer config")
    if variant is not None:
        key = f"transformer_{variant}"
        if key not in raw:
            raise WanLoadError(f"{str(path)!r} has no {key!r} (it has: {', '.join(keys)})")
    else:
        key = keys[0]
        if len(keys) > 1:
            log.info("%s: serving %s (pass a variant for another: %s)", path, key, ", ".join(keys))
    for part in ("text_encoder", "vae"):
        if part not in raw:
            raise WanLoadError(f"{str(path)!r} has no {part!r} config")
    configs = {
        "transformer": _config_of(raw[key]),
        "text_encoder": _config_of(raw["text_encoder"]),
        "vae": _config_of(raw["vae"]),
        "scheduler": dict(WAN21_SCHEDULER_CONFIG),
    }
    d = raw.get("defaults", {})
    width, height = WAN21_DEFAULTS.width, WAN21_DEFAULTS.height
    if "size" in d:
        width, height = (int(v) for v in str(d["size"]).split("x"))
    defaults = Defaults(
        width=width,
        height=height,
        num_inference_steps=int(d.get("num_inference_steps", WAN21_DEFAULTS.num_inference_steps)),
        guidance_scale=float(d.get("guidance_scale", WAN21_DEFAULTS.guidance_scale)),
        num_frames=int(d.get("num_frames", WAN21_DEFAULTS.num_frames)),
        fps=int(d.get("fps", WAN21_DEFAULTS.fps)),
    )
    return configs, defaults


def _folder_configs(path: Path) -> dict[str, Any]:
    index = _model_index(path)
    return {
        "transformer": _config_of(_read_json(path / "transformer" / "config.json")),
        "text_encoder": _config_of(_read_json(path / "text_encoder" / "config.json")),
        "vae": _config_of(_read_json(path / "vae" / "config.json")),
        "scheduler": _scheduler_config(path, index),
    }


def _build_dummy(
    path: Path,
    device: torch.device,
    dtype: torch.dtype,
    vae_dtype: torch.dtype,
    seed: int,
    variant: str | None,
) -> tuple[dict[str, Any], Defaults]:
    from transformers import AutoTokenizer

    if path.is_file():
        configs, defaults = _components_file(path, variant)
        tok_dir = None
    elif path.is_dir():
        configs, defaults = _folder_configs(path), WAN21_DEFAULTS
        tok_dir = path / "tokenizer" if (path / "tokenizer" / "tokenizer_config.json").is_file() else None
    else:
        raise WanLoadError(f"{str(path)!r}: no such file or folder")
    if tok_dir is not None:
        tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            save_demo_tokenizer(Path(tmp))
            tokenizer = AutoTokenizer.from_pretrained(tmp)
    vocab = int(configs["text_encoder"].get("vocab_size", 0))
    if len(tokenizer) > vocab:
        raise WanLoadError(f"the tokenizer has {len(tokenizer)} tokens, the text encoder's only {vocab}")
    parts = build_random_components(configs, device=device, dtype=dtype, vae_dtype=vae_dtype, seed=seed)
    parts["tokenizer"] = tokenizer
    parts["scheduler_config"] = configs["scheduler"]
    return parts, defaults


def build_random_components(
    configs: dict[str, Any],
    *,
    device: torch.device,
    dtype: torch.dtype,
    vae_dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> dict[str, torch.nn.Module]:
    """``text_encoder``, ``transformer`` and ``vae`` from their configs with seeded random weights,
    built on ``device`` (same seed, device and dtypes: the same weights). The transformer's
    ``_keep_in_fp32_modules`` stay float32 as ``from_pretrained`` leaves them. The process's global
    RNG state is left as it was."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    te_cfg = dict(configs["text_encoder"])
    te_cfg.pop("model_type", None)
    te_cfg.pop("architectures", None)
    devices = [device] if device.type == "cuda" else []
    out: dict[str, torch.nn.Module] = {}
    with torch.random.fork_rng(devices=devices), torch.device(device):
        torch.manual_seed(seed)
        out["text_encoder"] = UMT5EncoderModel._from_config(UMT5Config(**te_cfg), dtype=dtype).eval()
        transformer = WanTransformer3DModel.from_config(configs["transformer"])
        cast_keeping_fp32(transformer, dtype)
        out["transformer"] = transformer.eval()
        out["vae"] = AutoencoderKLWan.from_config(configs["vae"]).to(vae_dtype).eval()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    for name, module in out.items():
        params = sum(p.numel() for p in module.parameters())
        log.info("built random %s: %.2f M parameters on %s", name, params / 1e6, device)
    return out


_cast_keeping_fp32 = cast_keeping_fp32  # (the name benchmarks and tests import)


def limits_from(values: dict[str, Any]) -> WanLimits:
    """A :class:`WanLimits` from a dict of its fields (unknown keys refused)."""
    known = {f.name for f in fields(WanLimits)}
    unknown = set(values) - known
    if unknown:
        raise WanLoadError(f"unknown limits: {', '.join(sorted(unknown))}")
    return WanLimits(**values)
