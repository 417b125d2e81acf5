"""Loads code2wav weights from a published checkpoint folder (``config.json`` + safetensors).

A Qwen3-Omni checkpoint holds the whole model: its ``config.json`` has a ``code2wav_config``
and its code2wav tensors are named ``code2wav.*``, possibly across several shards (listed by
``model.safetensors.index.json`` when present). A folder holding only code2wav (its config at
the top level, tensors named as in ``Qwen3OmniMoeCode2Wav``) loads too. Only the code2wav
tensors are read.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig

from ..checkpoint import read_safetensors
from .model import Code2WavModel

PREFIX = "code2wav."


def read_config(folder: Path) -> tuple[Qwen3OmniMoeCode2WavConfig, str]:
    """The code2wav config of a checkpoint folder, and the prefix of its code2wav tensors."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{folder} has no config.json")
    raw = json.loads(config_path.read_text())
    if "code2wav_config" in raw:
        if not raw["code2wav_config"]:
            raise ValueError(f"{config_path} has an empty code2wav_config (no audio output)")
        return Qwen3OmniMoeCode2WavConfig.from_dict(raw["code2wav_config"]), PREFIX
    if "upsample_rates" in raw and "num_quantizers" in raw:
        return Qwen3OmniMoeCode2WavConfig.from_dict(raw), ""
    raise ValueError(f"{config_path} is neither a Qwen3-Omni nor a code2wav config")


def load_code2wav(path: str | Path, device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.float32) -> Code2WavModel:
    """A :class:`.model.Code2WavModel` with a checkpoint folder's code2wav weights.

    Raises ``ValueError`` when the folder has no usable config, or when its tensors do not
    match the config (missing, unexpected or misshapen tensors)."""
    folder = Path(path)
    config, prefix = read_config(folder)
    tensors = read_safetensors(folder, prefix)
    if not tensors:
        raise ValueError(f"{folder} holds no {prefix or 'code2wav '}tensors in its safetensors files")
    try:
        return Code2WavModel.from_state_dict(config, tensors, device=device, dtype=dtype)
    except ValueError as error:
        raise ValueError(f"{folder}: {error}") from None
