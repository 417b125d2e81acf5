"""Loads a Mimi checkpoint (``config.json`` + ``*.safetensors``) into ``StreamingMimi``.

Accepted key layouts:

* the published flat layout (``kyutai/mimi``; what ``MimiModel.save_pretrained`` writes):
  ``encoder.layers.*``, ``encoder_transformer.*``, ``downsample.*``, ``quantizer.*``,
  ``upsample.*``, ``decoder_transformer.*``, ``decoder.layers.*``;
* the nested layout of transformers 5.x modules in memory (``encoder.encoder_seanet.layers.*``,
  ``encoder.encoder_transformer.*``, ``decoder.decoder_seanet.layers.*``...), so a live
  ``MimiModel.state_dict()`` loads too.

Codebooks (``embed_sum``, ``cluster_usage``) become float32 tables; only the first
``num_quantizers`` are kept (Moshi uses 8 of 32). Every other weight must be present and every
key must be used: anything missing or left over raises ``ValueError``.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ..checkpoint import read_safetensors, safetensors_files
from .config import MimiCodecConfig
from .model import StreamingMimi

_NESTED_TO_FLAT = [
    (re.compile(r"^encoder\.(?:encoder_seanet|encoder)\.layers\."), "encoder.layers."),
    (re.compile(r"^encoder\.encoder_transformer\."), "encoder_transformer."),
    (re.compile(r"^encoder\.downsample\."), "downsample."),
    (re.compile(r"^decoder\.upsample\."), "upsample."),
    (re.compile(r"^decoder\.decoder_transformer\."), "decoder_transformer."),
    (re.compile(r"^decoder\.(?:decoder_seanet|decoder)\.layers\."), "decoder.layers."),
]
_CODEBOOK = re.compile(
    r"^quantizer\.(semantic|acoustic)_residual_vector_quantizer\.layers\.(\d+)\.codebook\.(\w+)$"
)
_PROJ = re.compile(r"^quantizer\.(semantic|acoustic)_residual_vector_quantizer\.(input|output)_proj\.weight$")


def flat_key(key: str) -> str:
    """Maps a key of either accepted layout to the published flat layout."""
    for pattern, replacement in _NESTED_TO_FLAT:
        if pattern.match(key):
            return pattern.sub(replacement, key, count=1)
    return key


def build_mimi(
    config: MimiCodecConfig,
    tensors: dict[str, torch.Tensor],
    num_quantizers: int | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> StreamingMimi:
    """Builds ``StreamingMimi`` from a state dict of either layout. Quantizer stays float32."""
    model = StreamingMimi(config, num_quantizers)
    kept = model.num_quantizers
    semantic = config.num_semantic_quantizers
    weights: dict[str, torch.Tensor] = {}
    codebooks: dict[int, dict[str, torch.Tensor]] = {}
    unexpected: list[str] = []
    for raw_key, tensor in tensors.items():
        key = flat_key(raw_key)
        if match := _CODEBOOK.match(key):
            group, index, name = match.group(1), int(match.group(2)), match.group(3)
            k = index if group == "semantic" else semantic + index
            if name in ("embed_sum", "cluster_usage"):
                if k < kept:
                    codebooks.setdefault(k, {})[name] = tensor
            elif name != "initialized":
                unexpected.append(raw_key)
        elif match := _PROJ.match(key):
            weights[f"quantizer.{match.group(1)}_{match.group(2)}_proj"] = tensor
        else:
            weights[key] = tensor
    missing_books = [k for k in range(kept) if set(codebooks.get(k, {})) != {"embed_sum", "cluster_usage"}]
    if missing_books:
        raise ValueError(f"checkpoint lacks codebooks {missing_books} (embed_sum and cluster_usage)")

    expected = model.state_dict()
    quantizer_buffers = {"quantizer.codebooks", "quantizer.codebook_norms"}
    if not model.quantizer.projected:
        quantizer_buffers |= {
            f"quantizer.{g}_{d}_proj" for g in ("semantic", "acoustic") for d in ("input", "output")
        }
    missing = sorted(set(expected) - set(weights) - quantizer_buffers)
    unexpected += sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match the Mimi config: missing {missing[:8]}"
            f"{'...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
            f"{'...' if len(unexpected) > 8 else ''}"
        )
    for key, tensor in weights.items():
        if tensor.shape != expected[key].shape:
            raise ValueError(
                f"{key}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(expected[key].shape)}"
            )
    model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    model.quantizer.set_codebooks(
        [codebooks[k]["embed_sum"].float() for k in range(kept)],
        [codebooks[k]["cluster_usage"].float() for k in range(kept)],
    )
    model.eval().requires_grad_(False)
    model.to(device)
    for name, module in model.named_children():
        if name != "quantizer":
            module.to(dtype)
    return model


def load_mimi(
    path: str | Path,
    num_quantizers: int | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> StreamingMimi:
    """Loads ``path/config.json`` and ``path/*.safetensors`` (the published Mimi layout)."""
    path = Path(path)
    config = MimiCodecConfig.from_json(path / "config.json")
    if not safetensors_files(path):
        raise ValueError(f"no .safetensors file in {path}")
    return build_mimi(config, read_safetensors(path), num_quantizers, device, dtype)
