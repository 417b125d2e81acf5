"""Loads a Moshi checkpoint (``MoshiForConditionalGeneration.save_pretrained``'s layout) into a
:class:`~.lm.DuplexLM` and its Mimi codec, and builds real-size random LMs for benchmarks.

The folder holds ``config.json`` (``model_type`` "moshi") and ``*.safetensors`` with the LM's
keys (``decoder.model.*``, ``decoder.lm_head.*``, ``depth_decoder.*``, ``embed_tokens.N.*``:
:mod:`.weights`) and the codec's (``audio_encoder.*``, built by ``codecs/mimi``'s ``build_mimi``
from ``audio_encoder_config`` with ``num_quantizers = num_codebooks``). Every key is used:
missing or extra keys raise ValueError with their names.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import torch
from transformers import MoshiConfig

from ...codecs.checkpoint import read_safetensors, safetensors_files
from ...codecs.mimi import MimiCodecConfig, StreamingMimi, build_mimi
from .lm import DuplexLM
from .weights import MoshiWeights, check_config

log = logging.getLogger(__name__)

_CODEC_PREFIX = "audio_encoder."


def read_config(path: str | Path) -> MoshiConfig:
    """``path/config.json`` as a MoshiConfig; ValueError when it is not a Moshi config."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ValueError(f"no config.json in {path}")
    data = json.loads(file.read_text(encoding="utf-8"))
    if data.get("model_type") != "moshi":
        raise ValueError(f"expected a Moshi checkpoint (model_type 'moshi'), got {data.get('model_type')!r}")
    config = MoshiConfig.from_dict(data)
    check_config(config)
    return config


def _listed(keys: list[str]) -> str:
    return ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")


def build_weights(config: MoshiConfig, tensors: dict[str, torch.Tensor]) -> MoshiWeights:
    """The LM's parameters from a state dict in the checkpoint layout (no ``audio_encoder.*``);
    ValueError naming missing or extra keys and shape mismatches."""
    with torch.device("meta"):
        weights = MoshiWeights(config)
    expected = {name: tuple(t.shape) for name, t in weights.state_dict().items()}
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise ValueError(
            "checkpoint does not match the Moshi config: "
            f"missing keys [{_listed(missing)}], unexpected keys [{_listed(extra)}]"
        )
    wrong = [
        f"{k} {tuple(tensors[k].shape)} != {expected[k]}"
        for k in expected
        if tuple(tensors[k].shape) != expected[k]
    ]
    if wrong:
        raise ValueError(f"checkpoint shapes do not match the Moshi config: {_listed(wrong)}")
    weights.load_state_dict(tensors, assign=True)
    return weights


def load_duplex_lm(
    path: str | Path,
    *,
    max_slots: int,
    device: torch.device | str,
    dtype: torch.dtype,
    graphs: bool,
    max_frames: int | None = None,
    mimi_dtype: torch.dtype = torch.float32,
    kv_dtype: str = "auto",
) -> tuple[DuplexLM, StreamingMimi]:
    """The LM and its codec from a ``MoshiForConditionalGeneration`` folder (module doc).
    ``max_frames`` shortens the attention window (default: the config's); ``kv_dtype``: the
    temporal KV storage (:data:`~.lm.KV_DTYPES`)."""
    path = Path(path)
    config = read_config(path)
    if not safetensors_files(path):
        raise ValueError(f"no .safetensors file in {path}")
    tensors = read_safetensors(path)
    codec = {k[len(_CODEC_PREFIX) :]: v for k, v in tensors.items() if k.startswith(_CODEC_PREFIX)}
    lm_tensors = {k: v for k, v in tensors.items() if not k.startswith(_CODEC_PREFIX)}
    del tensors
    if not codec:
        raise ValueError("checkpoint has no audio_encoder.* keys (the Mimi codec)")
    weights = build_weights(config, lm_tensors)
    mimi_config = MimiCodecConfig.from_dict(config.audio_encoder_config.to_dict())
    mimi = build_mimi(
        mimi_config, codec, num_quantizers=config.num_codebooks, device=device, dtype=mimi_dtype
    )
    lm = DuplexLM(
        weights,
        config,
        max_slots=max_slots,
        device=device,
        dtype=dtype,
        graphs=graphs,
        max_frames=max_frames,
        kv_dtype=kv_dtype,
    )
    log.info(
        "duplex LM loaded from %s: %d slots, %d-frame window, %s KV (%.2f GiB)",
        path,
        max_slots,
        lm.max_frames,
        "fp8" if kv_dtype == "fp8" else str(dtype).removeprefix("torch."),
        lm.kv_bytes / 2**30,
    )
    return lm, mimi


#: Files that hold a tokenizer (any one of them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(path: str | Path) -> Any:
    """The text tokenizer of a checkpoint folder (transformers' ``AutoTokenizer``, local files
    only); ValueError when the folder has none or it does not load."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"no tokenizer in {path} (expected one of {', '.join(TOKENIZER_FILES)})")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"the tokenizer in {path} does not load: {exc}") from None


def load_duplex(
    path: str | Path,
    *,
    max_slots: int,
    device: torch.device | str,
    dtype: torch.dtype | None = None,
    graphs: bool = True,
    kv_dtype: str = "auto",
    max_frames: int | None = None,
) -> tuple[DuplexLM, StreamingMimi, Any]:
    """The LM, its codec and its text tokenizer from a checkpoint folder (:func:`load_duplex_lm`,
    :func:`load_tokenizer`; the config and the tokenizer are checked before the weights are read).
    ``dtype``: the LM's, by default float32 on CPU and bfloat16 elsewhere (Mimi runs in float32);
    ``kv_dtype`` and ``max_frames`` as for :class:`~.lm.DuplexLM`."""
    device = torch.device(device)
    read_config(path)
    tokenizer = load_tokenizer(path)
    if dtype is None:
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    lm, mimi = load_duplex_lm(
        path,
        max_slots=max_slots,
        device=device,
        dtype=dtype,
        graphs=graphs,
        max_frames=max_frames,
        kv_dtype=kv_dtype,
    )
    return lm, mimi, tokenizer


#: Parameters that are scales (RMSNorm weights), initialised to one.
_NORMS = ("layernorm.weight", "norm.weight")
#: Projections whose output is added to the residual stream, scaled down with the depth.
_RESIDUAL_OUT = ("o_proj.linear.weight", "mlp.fc2.weight")


@torch.no_grad()
def dummy_duplex_lm(
    config: MoshiConfig,
    *,
    max_slots: int,
    device: torch.device | str,
    dtype: torch.dtype,
    seed: int,
    graphs: bool = True,
    max_frames: int | None = None,
    kv_dtype: str = "auto",
    attention_kernel: bool = True,
) -> DuplexLM:
    """A real-size LM with seeded random weights made on ``device`` (:func:`dummy_weights`)."""
    weights = dummy_weights(config, device=device, dtype=dtype, seed=seed)
    return DuplexLM(
        weights,
        config,
        max_slots=max_slots,
        device=device,
        dtype=dtype,
        graphs=graphs,
        max_frames=max_frames,
        kv_dtype=kv_dtype,
        attention_kernel=attention_kernel,
    )


@torch.no_grad()
def dummy_weights(
    config: MoshiConfig, *, device: torch.device | str, dtype: torch.dtype, seed: int
) -> MoshiWeights:
    """Seeded random LM weights made on ``device`` (nothing materialised on the CPU; several
    :class:`DuplexLM` may share them): embeddings with ``std 1/sqrt(2K + 1)`` (their sum has unit
    variance), every matrix ``std 1/sqrt(fan_in)``, the residual outputs (``o_proj``, ``fc2``)
    further by ``1/sqrt(2 * layers)``, norms one, so activations stay finite through every layer."""
    check_config(config)
    device = torch.device(device)
    with torch.device("meta"):
        weights = MoshiWeights(config).to(dtype)
    weights = weights.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    embed_std = 1.0 / math.sqrt(2 * config.num_codebooks + 1)
    for name, param in weights.named_parameters():
        if name.endswith(_NORMS):
            param.fill_(1.0)
            continue
        if "embed_tokens" in name:
            std = embed_std
        else:
            std = 1.0 / math.sqrt(param.shape[-1])
            if name.endswith(_RESIDUAL_OUT):
                layers = (
                    config.depth_decoder_config.num_hidden_layers
                    if name.startswith("depth_decoder")
                    else config.num_hidden_layers
                )
                std /= math.sqrt(2 * layers)
        param.normal_(0.0, std, generator=generator)
    return weights
