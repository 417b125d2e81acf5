"""Compressed-tensors W8A8 checkpoints (stages/diffusion/compressed.py): a checkpoint written here
in llm-compressor's layout (the config from the compressed-tensors library's own ``W8A8`` and
``FP8_DYNAMIC`` presets; ``weight`` and ``weight_scale`` per quantized layer) loads into W8A8
layers and computes exactly what the model quantized in memory computes; a Wan folder with such a
transformer serves through the loader; schemes that are not served are refused with the reason."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
from omnirt.stages.diffusion.compressed import CompressedCheckpointError, load_transformer, read_scheme
from omnirt.stages.diffusion.quant import W8A8Linear, quantize_model
from safetensors.torch import save_file

from .test_fused_install import _wan

PRESETS = {"int8": ("W8A8", "int-quantized"), "fp8": ("FP8_DYNAMIC", "float-quantized")}


def write_checkpoint(model: torch.nn.Module, folder: Path, kind: str) -> None:
    """``model`` (already quantized in memory by quantize_model) in the compressed-tensors layout."""
    folder.mkdir(parents=True, exist_ok=True)
    preset, fmt = PRESETS[kind]
    kept = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    quant = QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])},
        format=fmt,
        ignore=kept,
        quantization_status="compressed",
    )
    config = dict(model.config)
    config["quantization_config"] = quant.model_dump(exclude_none=True)
    (folder / "config.json").write_text(json.dumps(config, default=list))
    tensors = {}
    for name, tensor in model.state_dict().items():
        owner, _, leaf = name.rpartition(".")
        if isinstance(model.get_submodule(owner), W8A8Linear):
            leaf = {"qweight": "weight", "weight_scale": "weight_scale", "bias": "bias"}[leaf]
            if leaf == "weight_scale":  # llm-compressor saves scales in the model's dtype
                tensor = tensor.to(torch.bfloat16)
        tensors[f"{owner}.{leaf}" if owner else leaf] = tensor.contiguous()
    save_file(tensors, str(folder / "model.safetensors"))


def _call(model: torch.nn.Module) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    video = torch.randn(1, 16, 3, 8, 12, generator=g)
    text = torch.randn(1, 16, 32, generator=g)
    with torch.no_grad():
        return model(video, torch.tensor([400.0]), text, return_dict=False)[0]


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_checkpoints_round_trip(tmp_path: Path, kind: str) -> None:
    from diffusers import WanTransformer3DModel

    model = _wan(torch.float32)
    quantize_model(model, kind)
    # llm-compressor stores weight scales in the model dtype: what the loader reads back
    for module in model.modules():
        if isinstance(module, W8A8Linear):
            module.weight_scale.copy_(module.weight_scale.to(torch.bfloat16).float())
    write_checkpoint(model, tmp_path / "transformer", kind)
    loaded, stored = load_transformer(WanTransformer3DModel, tmp_path / "transformer", dtype=torch.float32)
    assert stored == kind
    assert sum(isinstance(m, W8A8Linear) for m in loaded.modules()) == sum(
        isinstance(m, W8A8Linear) for m in model.modules()
    )
    assert not any(p.is_meta for p in loaded.parameters())
    if kind == "int8":  # integer accumulation: the same bits
        assert torch.equal(_call(loaded), _call(model))
    else:  # the CPU's fp8 product blocks its sums by the operands' alignment: fp32 rounding apart
        torch.testing.assert_close(_call(loaded), _call(model), rtol=1e-5, atol=1e-5)


def test_a_wan_folder_with_a_w8a8_transformer_serves_it(tmp_path: Path) -> None:
    from diffusers import WanTransformer3DModel
    from omnirt.stages.diffusion.wan_demo import ensure_wan_demo
    from omnirt.stages.diffusion.wan_loader import WanLoadError, load_wan

    folder = tmp_path / "wan"
    shutil.copytree(ensure_wan_demo(), folder)
    original = WanTransformer3DModel.from_pretrained(str(folder / "transformer"))
    quantize_model(original, "int8")
    shutil.rmtree(folder / "transformer")
    write_checkpoint(original, folder / "transformer", "int8")
    denoiser = load_wan(folder, device="cpu")
    assert denoiser.info.quantization == "int8"
    assert any(isinstance(m, W8A8Linear) for m in denoiser.transformer.modules())
    with pytest.raises(WanLoadError, match="stored int8"):
        load_wan(folder, device="cpu", quantization="fp8")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda q: q.update(quant_method="bitsandbytes"), "not served"),
        (lambda q: q.update(format="pack-quantized"), "format"),
        (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="tensor"), "per-channel"),
        (lambda q: q["config_groups"]["group_0"]["input_activations"].update(strategy="tensor"), "per-token"),
        (lambda q: q["config_groups"]["group_0"].update(targets=["re:.*attn.*"]), "Linear"),
        (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits="eight"), "invalid"),
    ],
)
def test_schemes_that_are_not_served_are_refused(edit, message) -> None:
    quant = QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme("W8A8", ["Linear"])}, format="int-quantized"
    ).model_dump(exclude_none=True)
    assert read_scheme({"quantization_config": json.loads(json.dumps(quant))}) == ("int8", [])
    edit(quant)
    with pytest.raises(CompressedCheckpointError, match=message):
        read_scheme({"quantization_config": quant})
    assert read_scheme({}) is None
