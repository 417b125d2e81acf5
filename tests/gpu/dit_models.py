"""Tiny diffusers DiTs on CUDA for the GPU tests (random weights, seeded)."""

from __future__ import annotations

import torch


def tiny_zimage(dim: int = 512, heads: int = 4) -> torch.nn.Module:
    """A Z-Image transformer of 2 layers and 1 refiner each, head dim ``dim / heads`` (128 for the
    QK kernel), bf16, on CUDA, seeded 0. Its feed-forward is ``dim / 3 * 8`` wide: fp8 products
    want a multiple of 16 (``dim`` 768: 2048)."""
    from diffusers import ZImageTransformer2DModel

    with torch.device("cuda"):
        torch.manual_seed(0)
        return ZImageTransformer2DModel(
            all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=dim, n_layers=2,
            n_refiner_layers=1, n_heads=heads, n_kv_heads=heads, norm_eps=1e-5, qk_norm=True,
            cap_feat_dim=64, axes_dims=[32, 48, 48], axes_lens=[256, 128, 128],
        ).to(torch.bfloat16).eval()  # fmt: skip
