"""Loads Z-Image from a local diffusers folder, or builds it with random weights from its configs.

A folder in the published layout has ``model_index.json`` naming ``ZImagePipeline`` and the
subfolders ``transformer/``, ``text_encoder/``, ``tokenizer/``, ``vae/`` and ``scheduler/``. With
``load_format="auto"`` each component loads through its own library class (diffusers'
``ZImageTransformer2DModel`` and ``AutoencoderKL``, the transformers class that
``model_index.json`` names for the text encoder, ``AutoTokenizer``), exactly as
``ZImagePipeline.from_pretrained`` would load it. With ``load_format="dummy"`` only the configs are
read (the folder's, or a components JSON file such as the published
``z-image-turbo.components.json``: ``{"transformer": {...}, "text_encoder": {...}, "vae": {...},
"scheduler": {...}, "defaults": {...}}``) and every component is built on the device with seeded
random weights (component ``k`` from seed ``seed + k``); a missing tokenizer is replaced by the
offline byte-level tokenizer of the speech demo (:mod:`omnirt.stages.speech.demo_tokenizer`).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from ..checkpoints import READ_ERRORS, first_line, from_pretrained_checked
from ..types import ModelInfo
from .compressed import load_transformer
from .denoiser import Defaults
from .quant import QUANTIZATIONS, quantize_model
from .zimage import TURBO_DEFAULTS, Limits, ZImageDenoiser

log = logging.getLogger(__name__)

PIPELINE_CLASS = "ZImagePipeline"
LOAD_FORMATS = ("auto", "dummy")
COMPONENTS = ("transformer", "text_encoder", "vae", "scheduler")
_CONFIG_FILES = {
    "transformer": "transformer/config.json",
    "text_encoder": "text_encoder/config.json",
    "vae": "vae/config.json",
    "scheduler": "scheduler/scheduler_config.json",
}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def pipeline_class(path: Path) -> str | None:
    """The ``_class_name`` of a diffusers folder's ``model_index.json`` (None: not such a folder)."""
    index = path / "model_index.json"
    if not index.is_file():
        return None
    return _read_json(index).get("_class_name")


def read_component_configs(path: Path) -> dict[str, dict[str, Any]]:
    """The components' configs (and ``defaults`` when given) of a folder or a components JSON file."""
    if path.is_file():
        data = _read_json(path)
        missing = [c for c in COMPONENTS if not isinstance(data.get(c), dict)]
        if missing:
            raise ValueError(f"{path}: no config for {', '.join(missing)}")
        return {k: v for k, v in data.items() if k in (*COMPONENTS, "defaults")}
    found = pipeline_class(path)
    if found != PIPELINE_CLASS:
        raise ValueError(f"{path}: model_index.json names {found!r}, not {PIPELINE_CLASS!r}")
    configs = {name: _read_json(path / rel) for name, rel in _CONFIG_FILES.items()}
    extra = path / "omnirt_defaults.json"
    if extra.is_file():
        configs["defaults"] = _read_json(extra)
    return configs


def defaults_from(configs: dict[str, dict[str, Any]], fallback: Defaults) -> Defaults:
    d = configs.get("defaults") or {}
    width, height = fallback.width, fallback.height
    if "size" in d:
        width, height = (int(v) for v in str(d["size"]).lower().split("x"))
    return Defaults(
        width=int(d.get("width", width)),
        height=int(d.get("height", height)),
        num_inference_steps=int(d.get("num_inference_steps", fallback.num_inference_steps)),
        guidance_scale=float(d.get("guidance_scale", fallback.guidance_scale)),
    )


def vae_config(raw: dict[str, Any]) -> dict[str, Any]:
    """An ``AutoencoderKL`` config with the block types filled in to match ``block_out_channels``
    (summaries such as the published components file list the channels alone)."""
    cfg = {k: v for k, v in raw.items() if not k.startswith("_")}
    blocks = len(cfg.get("block_out_channels", (64,)))
    cfg.setdefault("down_block_types", ["DownEncoderBlock2D"] * blocks)
    cfg.setdefault("up_block_types", ["UpDecoderBlock2D"] * blocks)
    return cfg


def _text_encoder_class(path: Path) -> Any:
    import transformers

    entry = _read_json(path / "model_index.json").get("text_encoder") or [None, None]
    name = entry[1] if isinstance(entry, list) and len(entry) == 2 else None
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    return cls or transformers.AutoModel


def offline_tokenizer() -> Any:
    """The speech demo's byte-level tokenizer with its Qwen chat template (no files needed)."""
    from transformers import PreTrainedTokenizerFast

    from ..speech.demo_tokenizer import CHAT_TEMPLATE, build_tokenizer

    return PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )


def _build_random(configs: dict[str, dict[str, Any]], device: torch.device, dtype: torch.dtype, seed: int):
    from diffusers import AutoencoderKL, ZImageTransformer2DModel
    from transformers import AutoConfig, AutoModel

    te_raw = dict(configs["text_encoder"])
    te_raw.pop("architectures", None)
    te_config = AutoConfig.for_model(te_raw.pop("model_type", "qwen3"), **te_raw)
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.device(device):
        torch.manual_seed(seed)
        t_cfg = {k: v for k, v in configs["transformer"].items() if not k.startswith("_")}
        transformer = ZImageTransformer2DModel.from_config(t_cfg).to(dtype)
        torch.manual_seed(seed + 1)
        text_encoder = AutoModel.from_config(te_config, dtype=dtype)
        torch.manual_seed(seed + 2)
        vae = AutoencoderKL.from_config(vae_config(configs["vae"])).to(dtype)
    return transformer, text_encoder, vae


def load_zimage(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    load_format: str = "auto",
    seed: int = 0,
    model_id: str | None = None,
    random_weights: bool = False,
    defaults: Defaults | None = None,
    limits: Limits = Limits(),
    quantization: str = "none",
) -> ZImageDenoiser:
    """A :class:`ZImageDenoiser` for a diffusers folder (or, with ``load_format="dummy"``, a
    components JSON file). ``dtype``: float32 on CPU, bfloat16 on CUDA unless given.
    ``quantization`` (``int8``, ``fp8``): the transformer's linear layers become W8A8 at load
    (``quant.py``), layer by layer on the device. Raises ``ValueError`` for a folder that is not a
    Z-Image pipeline or cannot be read, or an unknown quantization."""
    if quantization not in QUANTIZATIONS:
        known = ", ".join(QUANTIZATIONS)
        raise ValueError(f"unknown quantization {quantization!r}; expected one of: {known}")
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load format {load_format!r}; expected one of: {', '.join(LOAD_FORMATS)}")
    path = Path(path).expanduser()
    device = torch.device(device)
    dtype = dtype or (torch.float32 if device.type == "cpu" else torch.bfloat16)
    if path.is_file() and load_format != "dummy":
        raise ValueError(f"{path}: a components file has no weights; use load_format='dummy'")
    configs = read_component_configs(path)
    start = time.perf_counter()
    if load_format == "dummy":
        transformer, text_encoder, vae = _build_random(configs, device, dtype, seed)
        if quantization != "none":
            quantize_model(transformer, quantization, device=device)
        tok_dir = path / "tokenizer"
        tokenizer = _load_tokenizer(tok_dir) if tok_dir.is_dir() else offline_tokenizer()
        random_weights = True
    else:
        from diffusers import AutoencoderKL, ZImageTransformer2DModel

        transformer, stored = load_transformer(ZImageTransformer2DModel, path / "transformer", dtype=dtype)
        vae = from_pretrained_checked(AutoencoderKL, path / "vae", "VAE", torch_dtype=dtype)
        text_encoder = from_pretrained_checked(
            _text_encoder_class(path),
            path / "text_encoder",
            "text encoder",
            dtype=dtype,
            ignore_mismatched_sizes=True,
        )
        tokenizer = _load_tokenizer(path / "tokenizer")
        if stored != "none":  # a W8A8 checkpoint: served as it is
            if quantization not in ("none", stored):
                raise ValueError(f"{path}: the transformer is stored {stored}, not as {quantization}")
            quantization = stored
        elif quantization != "none":  # on the CPU still: each layer quantized on the device in turn
            quantize_model(transformer, quantization, device=device)
        transformer, vae, text_encoder = transformer.to(device), vae.to(device), text_encoder.to(device)
    for name, module in (("transformer", transformer), ("text_encoder", text_encoder), ("vae", vae)):
        module.requires_grad_(False)
        if load_format == "dummy" and not all(torch.isfinite(p).all() for p in module.parameters()):
            raise RuntimeError(f"non-finite random weights in the {name}")
    info = ModelInfo(
        id=model_id or path.stem,
        architecture=PIPELINE_CLASS,
        random_weights=random_weights,
        source=str(path),
        quantization=quantization,
    )
    denoiser = ZImageDenoiser(
        transformer=transformer,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        scheduler_config={k: v for k, v in configs["scheduler"].items() if not k.startswith("_")},
        info=info,
        defaults=defaults or defaults_from(configs, TURBO_DEFAULTS),
        limits=limits,
    )
    what = f"RANDOM WEIGHTS (seed {seed})" if load_format == "dummy" else "weights"
    log.info(
        "loaded %s with %s from %s in %.1f s", denoiser.describe(), what, path, time.perf_counter() - start
    )
    return denoiser


def _load_tokenizer(directory: Path) -> Any:
    """The tokenizer of ``directory``; ``ValueError`` naming it when there is none or it does not load."""
    from transformers import AutoTokenizer

    if not directory.is_dir():
        raise ValueError(f"{directory}: no such folder (the pipeline's tokenizer)")
    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except (*READ_ERRORS, ValueError) as exc:
        raise ValueError(f"{directory}: the tokenizer does not load ({first_line(exc)})") from None
