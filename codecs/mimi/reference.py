"""transformers ``MimiModel`` with random weights, the parity reference of tests and benchmarks.

A freshly initialised ``MimiModel`` has all-zero codebooks (every frame encodes to code 0),
which would make any parity check vacuous: ``random_reference_model`` fills ``embed_sum`` with
Gaussian values, sets ``cluster_usage`` to 1 and drops the cached embedding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# Keeps the frame geometry of the real codec (24 kHz, 1920 samples per frame); ~130 k parameters.
TINY_MIMI: dict[str, Any] = {
    "hidden_size": 32,
    "num_filters": 4,
    "num_hidden_layers": 1,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "codebook_size": 64,
    "codebook_dim": 16,
    "vector_quantization_hidden_dimension": 16,
    "num_quantizers": 8,
    "upsample_groups": 32,
    "sliding_window": 4,
}


def randomize_codebooks(model: torch.nn.Module, seed: int = 0) -> None:
    """Seeded Gaussian codebooks for every quantizer of a transformers ``MimiModel`` (also one
    inside ``MoshiForConditionalGeneration.audio_encoder``)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "embed_sum") and hasattr(module, "cluster_usage"):
                module.embed_sum.copy_(torch.randn(module.embed_sum.shape, generator=generator))
                module.cluster_usage.fill_(1.0)
                module._embed = None


def random_reference_model(seed: int = 0, **config_kwargs: Any):
    """A ``transformers.MimiModel`` (eval mode) with seeded random weights and codebooks."""
    from transformers import MimiConfig, MimiModel

    torch.manual_seed(seed)
    model = MimiModel(MimiConfig(**config_kwargs)).eval()
    randomize_codebooks(model, seed)
    return model


def save_reference_model(path: str | Path, seed: int = 0, **config_kwargs: Any):
    """Saves a random reference model in the published layout (config.json + model.safetensors)."""
    model = random_reference_model(seed, **config_kwargs)
    model.save_pretrained(str(path))
    return model
