"""Small deterministic random code2wav weights, for tests (``stages/speech/demo.py`` draws its own).

Transformers' own init makes a nearly silent code2wav (outputs around 1e-7), which hides
errors in any comparison. :func:`randomize_` draws weights that give outputs of a few tenths,
mostly unclamped, and works on any module under code2wav parameter names (transformers'
``Qwen3OmniMoeCode2Wav`` or :class:`.model.Code2WavModel`), so both get the same weights from
one seed.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig


def tiny_code2wav_config(**overrides: object) -> Qwen3OmniMoeCode2WavConfig:
    """The real frame geometry (upsampling 2*2, decoder 8*5*4*3, 1920 samples per frame) with
    tiny widths, 2 layers, grouped KV heads and a sliding window of 4 frames."""
    values: dict[str, object] = dict(
        hidden_size=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
        num_hidden_layers=2, sliding_window=4, codebook_size=16, num_quantizers=4, decoder_dim=32,
    )
    values.update(overrides)
    return Qwen3OmniMoeCode2WavConfig(**values)


@torch.no_grad()
def randomize_(module: nn.Module, seed: int = 0) -> nn.Module:
    """Overwrites every parameter of a code2wav module in place, deterministically by name."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in sorted(module.named_parameters()):
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith(("alpha", "beta")):  # SnakeBeta log-parameters
            value = 0.3 * torch.randn(param.shape, generator=generator)
        elif leaf in ("scale", "gamma"):  # layer scales: large enough for the branch to matter
            value = 0.3 + 0.1 * torch.randn(param.shape, generator=generator)
        elif leaf == "bias":
            value = 0.05 * torch.randn(param.shape, generator=generator)
        elif param.dim() == 1:  # norm weights
            value = 1.0 + 0.1 * torch.randn(param.shape, generator=generator)
        elif name.endswith("code_embedding.weight"):
            value = torch.randn(param.shape, generator=generator)
        else:  # linear and conv weights: unit gain per output
            fan_in = param.shape[1] * math.prod(param.shape[2:])
            if name.startswith("upsample.") and ".0.conv." in name:  # [in, out, k], k == stride
                fan_in = param.shape[0]
            elif ".block.1.conv." in name:  # decoder transposed conv: [in, out, k], k == 2 * stride
                fan_in = 2 * param.shape[0]
            gain = 1.0
            if ".conv2." in name:  # residual branch of a decoder unit: keep the sum from growing
                gain = 0.3
            elif ".block.1.conv." in name:  # decoder transposed conv: two overlapping taps
                gain = 0.6
            elif name.startswith("decoder.") and ".block." not in name and param.shape[0] == 1:
                gain = 0.15  # the output conv: a few tenths, rarely clamped
            value = gain * torch.randn(param.shape, generator=generator) / math.sqrt(max(fan_in, 1))
        param.copy_(value.to(param.dtype))
    return module
