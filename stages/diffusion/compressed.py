"""DiT transformers from compressed-tensors W8A8 checkpoints (the layout llm-compressor writes).

A transformer folder whose ``config.json`` carries a ``quantization_config`` with
``quant_method: compressed-tensors`` holds, for each quantized linear layer, ``weight`` (int8, or
float8 e4m3 for ``float-quantized``) and ``weight_scale`` (one per output channel), and for the
rest the usual tensors. The schemes served are llm-compressor's ``W8A8`` and ``FP8_DYNAMIC``
presets: symmetric per-channel static weights, symmetric per-token dynamic activations, 8 bits,
targeting ``Linear``, with an ``ignore`` list (names, or ``re:`` patterns). The config is read
with the compressed-tensors library's own model (so its schema, not ours, decides what is valid).

:func:`load_transformer` builds the model without allocating its weights (accelerate's
``init_empty_weights``), swaps the targeted layers for :class:`~.quant.W8A8Linear` and assigns the
checkpoint's tensors: nothing full-width is ever materialised. A folder without a
``quantization_config`` loads through diffusers' ``from_pretrained`` as before.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...kernels.w8a8 import STORAGE
from ..checkpoints import check_weight_files, from_pretrained_checked
from .quant import W8A8Linear

#: compressed-tensors formats whose tensors are the quantized values and their scales as such.
FORMATS = {"int-quantized": "int8", "naive-quantized": "int8", "float-quantized": "fp8"}


class CompressedCheckpointError(ValueError):
    """A compressed-tensors checkpoint that cannot be served, and why."""


def read_scheme(config: dict[str, Any]) -> tuple[str, list[str]] | None:
    """``(kind, ignore)`` of a transformer ``config.json``'s compressed-tensors W8A8
    ``quantization_config``; None without one; CompressedCheckpointError for another scheme."""
    raw = config.get("quantization_config")
    if raw is None:
        return None
    if raw.get("quant_method") != "compressed-tensors":
        raise CompressedCheckpointError(f"quantization method {raw.get('quant_method')!r} is not served")
    from compressed_tensors.quantization import QuantizationConfig

    try:
        parsed = QuantizationConfig.model_validate(raw)
    except Exception as exc:  # the library's validation error, whatever its class
        raise CompressedCheckpointError(f"invalid compressed-tensors config: {exc}") from None
    kind = FORMATS.get(str(parsed.format))
    if kind is None:
        raise CompressedCheckpointError(f"compressed-tensors format {parsed.format!r} is not served")
    if len(parsed.config_groups) != 1:
        raise CompressedCheckpointError("one quantization config group is served (W8A8 or FP8_DYNAMIC)")
    (scheme,) = parsed.config_groups.values()
    want = "int" if kind == "int8" else "float"
    weights, acts = scheme.weights, scheme.input_activations
    ok = (
        list(scheme.targets) == ["Linear"]
        and weights is not None
        and (weights.num_bits, str(weights.type), str(weights.strategy), weights.symmetric, weights.dynamic)
        == (8, want, "channel", True, False)
        and acts is not None
        and (acts.num_bits, str(acts.type), str(acts.strategy), acts.symmetric, acts.dynamic)
        == (8, want, "token", True, True)
        and scheme.output_activations is None
    )
    if not ok:
        raise CompressedCheckpointError(
            "only 8-bit symmetric per-channel weights with dynamic per-token activations on Linear "
            "layers are served (llm-compressor's W8A8 and FP8_DYNAMIC schemes)"
        )
    return kind, list(parsed.ignore or [])


def _ignored(name: str, ignore: list[str]) -> bool:
    for pattern in ignore:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif name == pattern:
            return True
    return False


def cast_keeping_fp32(model: nn.Module, dtype: torch.dtype) -> None:
    """Casts ``model``'s floating parameters to ``dtype`` except those of its
    ``_keep_in_fp32_modules`` (as ``from_pretrained`` leaves them); buffers stay as they are."""
    keep = list(getattr(model, "_keep_in_fp32_modules", None) or [])
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not torch.is_floating_point(param):
                continue
            target = torch.float32 if any(k in name.split(".") for k in keep) else dtype
            if param.dtype != target:
                param.data = param.data.to(target)


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CompressedCheckpointError(f"{folder}: no .safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors


def load_transformer(
    cls: Any, folder: Path, *, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> tuple[nn.Module, str]:
    """The transformer of ``folder`` (a diffusers ``transformer/`` folder) and its quantization
    (``none``, ``int8``, ``fp8``): a compressed-tensors W8A8 checkpoint into W8A8 layers, anything
    else through ``cls.from_pretrained``."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise CompressedCheckpointError(f"cannot read {folder / 'config.json'}: {exc}") from None
    scheme = read_scheme(config)
    if scheme is None:
        return from_pretrained_checked(cls, folder, "transformer", torch_dtype=dtype).to(device), "none"
    check_weight_files(folder, quantized=True)
    kind, ignore = scheme
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = cls.from_config({k: v for k, v in config.items() if k != "quantization_config"})
    quantized: set[str] = set()
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or _ignored(name, ignore):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        out_features, in_features = module.weight.shape
        bias = None if module.bias is None else torch.empty(out_features, dtype=dtype)
        layer = W8A8Linear(
            torch.empty(out_features, in_features, dtype=STORAGE[kind]),
            torch.empty(out_features, 1, dtype=torch.float32),
            bias,
            kind,  # type: ignore[arg-type]
        )
        setattr(parent, child, layer)
        quantized.add(name)
    state: dict[str, torch.Tensor] = {}
    for key, tensor in _read_tensors(folder).items():
        owner, _, leaf = key.rpartition(".")
        if owner in quantized:
            if leaf == "weight":
                if tensor.dtype != STORAGE[kind]:
                    stored = STORAGE[kind]
                    raise CompressedCheckpointError(f"{key} is {tensor.dtype}; {kind} stores {stored}")
                state[f"{owner}.qweight"] = tensor
            elif leaf == "weight_scale":
                state[f"{owner}.weight_scale"] = tensor.float().reshape(-1, 1)
            elif leaf == "bias":
                state[key] = tensor.to(dtype)
            elif leaf == "weight_zero_point" and not tensor.any():
                continue  # symmetric: all zeros
            else:
                raise CompressedCheckpointError(f"{key}: not part of the served scheme")
        else:
            state[key] = tensor
    expected = set(model.state_dict())
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected)
    if unexpected:
        raise CompressedCheckpointError(f"tensors the model does not have: {', '.join(unexpected[:5])}")
    lacking = [k for k in missing if _tensor(model, k).is_meta]  # (buffers are built by __init__)
    if lacking:
        raise CompressedCheckpointError(f"the checkpoint lacks {', '.join(lacking[:5])}")
    model.load_state_dict(state, strict=False, assign=True)
    cast_keeping_fp32(model, dtype)
    return model.to(device).eval(), kind


def _tensor(model: nn.Module, key: str) -> torch.Tensor:
    owner, _, leaf = key.rpartition(".")
    return getattr(model.get_submodule(owner) if owner else model, leaf)
