"""The embedded default image model: a tiny Z-Image with deterministic random weights.

Every component of the published architecture (a Qwen3 text encoder with the offline byte-level
tokenizer of the speech demo, ``ZImageTransformer2DModel``, a 16-channel ``AutoencoderKL`` with
the real 8x downsampling and scaling/shift factors, ``FlowMatchEulerDiscreteScheduler`` with the
real shift) at toy sizes, saved by diffusers' own ``ZImagePipeline.save_pretrained`` in the
published folder layout, so the one loader serves it and real checkpoints alike. The weights are
random: its images are noise.
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..cache import MARKER, ensure_built
from ..speech.demo_tokenizer import SPECIAL_TOKENS, save_tokenizer

log = logging.getLogger(__name__)

DEMO_SEED = 4321
#: Bumped whenever the recipe below changes, so an old cache is never reused.
DEMO_VERSION = 1
DEMO_ID = "demo-z-image"
#: What requests get by default (Turbo's recommended steps and guidance, a small size).
DEMO_DEFAULTS = {"width": 256, "height": 256, "num_inference_steps": 8, "guidance_scale": 0.0}


def text_encoder_config(vocab_size: int) -> dict[str, Any]:
    return {
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "max_position_embeddings": 1024,
        "rope_theta": 1_000_000.0,
        "rms_norm_eps": 1e-6,
    }


TRANSFORMER_CONFIG: dict[str, Any] = {
    "all_patch_size": [2],
    "all_f_patch_size": [1],
    "in_channels": 16,
    "dim": 64,
    "n_layers": 2,
    "n_refiner_layers": 1,
    "n_heads": 2,
    "n_kv_heads": 2,
    "norm_eps": 1e-5,
    "qk_norm": True,
    "cap_feat_dim": 32,
    "rope_theta": 256.0,
    "t_scale": 1000.0,
    "axes_dims": [8, 12, 12],
    "axes_lens": [1536, 512, 512],
}

VAE_CONFIG: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 16,
    "block_out_channels": [8, 16, 16, 16],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "layers_per_block": 1,
    "norm_num_groups": 8,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}

SCHEDULER_CONFIG: dict[str, Any] = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}


def build_tiny_zimage(directory: Path, *, seed: int = DEMO_SEED) -> None:
    """Builds a tiny Z-Image into ``directory`` (which must not exist yet), diffusers layout."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        ZImagePipeline,
        ZImageTransformer2DModel,
    )
    from transformers import AutoTokenizer, Qwen3Config, Qwen3Model

    directory.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        ids = save_tokenizer(Path(tmp))
        tokenizer = AutoTokenizer.from_pretrained(tmp)
    with torch.random.fork_rng(devices=[]):  # leave the process's global RNG as it was
        torch.manual_seed(seed)
        transformer = ZImageTransformer2DModel(**TRANSFORMER_CONFIG).eval()
        # Random pad tokens (zeros at init) so padding is visible to the parity tests.
        with torch.no_grad():
            transformer.x_pad_token.normal_()
            transformer.cap_pad_token.normal_()
        torch.manual_seed(seed + 1)
        cfg = text_encoder_config(ids["<vocab_size>"])
        cfg.pop("model_type")
        text_encoder = Qwen3Model(Qwen3Config(**cfg)).eval()
        torch.manual_seed(seed + 2)
        vae = AutoencoderKL(**VAE_CONFIG).eval()
    pipe = ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    pipe.save_pretrained(str(directory))
    (directory / "omnirt_defaults.json").write_text(json.dumps(DEMO_DEFAULTS, indent=2) + "\n")
    (directory / MARKER).write_text(
        json.dumps({"random_weights": True, "seed": seed, "version": DEMO_VERSION}) + "\n"
    )


def demo_cache_key(seed: int = DEMO_SEED) -> str:
    import diffusers
    import transformers

    recipe = json.dumps(
        {
            "v": DEMO_VERSION,
            "seed": seed,
            "tf": transformers.__version__.split(".")[:2],
            "diffusers": diffusers.__version__.split(".")[:2],
            "tok": SPECIAL_TOKENS,
        },
        sort_keys=True,
    )
    return hashlib.sha256(recipe.encode()).hexdigest()[:12]


def ensure_zimage_demo(cache_root: Path | None = None, *, seed: int = DEMO_SEED) -> Path:
    """The demo Z-Image folder, built in the cache on first use (:func:`...cache.ensure_built`)."""
    return ensure_built(
        f"{DEMO_ID}-{demo_cache_key(seed)}", lambda d: build_tiny_zimage(d, seed=seed), cache_root
    )
