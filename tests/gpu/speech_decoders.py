"""A ``SlotDecoder`` at the code predictor's real shapes on CUDA for the GPU tests (random weights,
seeded, bf16)."""

from __future__ import annotations

import torch


def code_predictor_decoder(layers: int, slots: int):
    """A ``SlotDecoder`` of ``slots`` slots of 17 entries over a Qwen3 model of ``layers`` layers at
    the code predictor's widths (hidden 1024, 16 query and 8 key/value heads of 128), seeded 0."""
    from omnirt.stages.speech.slots import SlotDecoder
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(0)
    cfg = Qwen3Config(
        hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        num_hidden_layers=layers, vocab_size=64, max_position_embeddings=64,
    )  # fmt: skip
    model = Qwen3Model(cfg).eval().to("cuda", torch.bfloat16)
    return SlotDecoder(
        model, num_slots=slots, max_len=17, device=torch.device("cuda"), dtype=torch.bfloat16,
        multimodal_rope=False,
    )  # fmt: skip
