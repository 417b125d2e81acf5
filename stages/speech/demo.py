"""The embedded default speech model: a tiny Qwen3-Omni with deterministic random weights.

It has every part of the published architecture (``Qwen3OmniMoeForConditionalGeneration``:
thinker with audio and vision encoders and a MoE text model, talker with its MoE model and code
predictor, code2wav) at toy sizes, and is saved in the published layout (``config.json``,
``model.safetensors``, tokenizer files, ``preprocessor_config.json``) so the one loader serves
it and real checkpoints alike. The weights are random: it babbles, in text and in noise.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch

from ..cache import MARKER, ensure_built
from .demo_tokenizer import SPECIAL_TOKENS, TOOL_TOKENS, save_tokenizer

log = logging.getLogger(__name__)

DEMO_SEED = 1234
#: Bumped whenever the recipe below changes, so an old cache is never reused.
DEMO_VERSION = 3
INIT_STD = 0.1
CODEBOOK = 64
NUM_CODE_GROUPS = 8
VOICES = ("ethan", "chelsie")


def _moe_text_config(vocab_size: int, **extra: Any) -> dict[str, Any]:
    """The MoE text decoder shared by the demo's thinker and talker (a fresh dict per call)."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 4096,
        "moe_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 3, 3],
        },
        "initializer_range": INIT_STD,
        **extra,
    }


def demo_config_dict(token_ids: dict[str, int]) -> dict[str, Any]:
    """The full ``Qwen3OmniMoeConfig`` of the demo, as plain JSON-able values."""
    t = token_ids
    codec_base = CODEBOOK  # codec special ids live in [CODEBOOK, CODEBOOK + 1024)
    text = _moe_text_config(t["<vocab_size>"])
    thinker = {
        "audio_config": {
            "num_mel_bins": 128,
            "encoder_layers": 1,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 64,
            "d_model": 32,
            "output_dim": 64,
            "downsample_hidden_size": 16,
            "n_window": 50,
            "n_window_infer": 400,
            "max_source_positions": 1500,
            "initializer_range": INIT_STD,
        },
        "vision_config": {
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": 64,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0],
            "initializer_range": INIT_STD,
        },
        "text_config": text,
        "audio_token_id": t["<|audio_pad|>"],
        "image_token_id": t["<|image_pad|>"],
        "video_token_id": t["<|video_pad|>"],
        "audio_start_token_id": t["<|audio_start|>"],
        "vision_start_token_id": t["<|vision_start|>"],
        "user_token_id": t["user"],
        "position_id_per_seconds": 13,
        "initializer_range": INIT_STD,
    }
    talker_text = _moe_text_config(CODEBOOK + 1024, shared_expert_intermediate_size=32)
    code_predictor = {
        "vocab_size": CODEBOOK,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_code_groups": NUM_CODE_GROUPS,
        "initializer_range": INIT_STD,
    }
    talker = {
        "text_config": talker_text,
        "code_predictor_config": code_predictor,
        "num_code_groups": NUM_CODE_GROUPS,
        "thinker_hidden_size": 64,
        "accept_hidden_layer": 1,
        "codec_pad_id": codec_base + 0,
        "codec_bos_id": codec_base + 1,
        "codec_eos_token_id": codec_base + 2,
        "codec_nothink_id": codec_base + 3,
        "codec_think_bos_id": codec_base + 4,
        "codec_think_eos_id": codec_base + 5,
        "speaker_id": {name: codec_base + 10 + i for i, name in enumerate(VOICES)},
        "audio_token_id": t["<|audio_pad|>"],
        "image_token_id": t["<|image_pad|>"],
        "video_token_id": t["<|video_pad|>"],
        "audio_start_token_id": t["<|audio_start|>"],
        "vision_start_token_id": t["<|vision_start|>"],
        "position_id_per_seconds": 13,
        "spatial_merge_size": 2,
        "initializer_range": INIT_STD,
    }
    code2wav = {
        "codebook_size": CODEBOOK,
        "hidden_size": 32,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_quantizers": NUM_CODE_GROUPS,
        "sliding_window": 72,
        "decoder_dim": 32,
        "upsample_rates": [8, 5, 4, 3],
        "upsampling_ratios": [2, 2],
        "initializer_range": INIT_STD,
    }
    return {
        "architectures": ["Qwen3OmniMoeForConditionalGeneration"],
        "model_type": "qwen3_omni_moe",
        "thinker_config": thinker,
        "talker_config": talker,
        "code2wav_config": code2wav,
        "enable_audio_output": True,
        "im_start_token_id": t["<|im_start|>"],
        "im_end_token_id": t["<|im_end|>"],
        "tts_pad_token_id": t["<tts_pad>"],
        "tts_bos_token_id": t["<tts_text_bos>"],
        "tts_eos_token_id": t["<tts_text_eod>"],
        "system_token_id": t["system"],
        "user_token_id": t["user"],
        "assistant_token_id": t["assistant"],
        "initializer_range": INIT_STD,
    }


def _reinit_uninitialised(model: torch.nn.Module, seed: int) -> None:
    """MoE experts come out of ``torch.empty`` and routers as zeros: draw them from a seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".mlp.experts." in name or name.endswith(".mlp.gate.weight"):
                param.copy_(torch.randn(param.shape, generator=gen) * INIT_STD)


def build_demo_checkpoint(directory: Path, *, seed: int = DEMO_SEED) -> None:
    """Builds the demo checkpoint into ``directory`` (which must not exist yet)."""
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration, WhisperFeatureExtractor

    directory.mkdir(parents=True)
    token_ids = save_tokenizer(directory)
    config = Qwen3OmniMoeConfig(**demo_config_dict(token_ids))
    with torch.random.fork_rng(devices=[]):  # leave the process's global RNG as it was
        torch.manual_seed(seed)
        model = Qwen3OmniMoeForConditionalGeneration(config).eval()
    _reinit_uninitialised(model, seed + 1)
    for name, param in model.named_parameters():
        if not torch.isfinite(param).all():
            raise RuntimeError(f"non-finite weights in {name} of the demo model")
    model.save_pretrained(str(directory))
    WhisperFeatureExtractor(feature_size=128).save_pretrained(str(directory))
    _add_image_processor(directory)
    (directory / MARKER).write_text(
        json.dumps({"random_weights": True, "seed": seed, "version": DEMO_VERSION}) + "\n"
    )


def image_processor_settings(patch_size: int, temporal_patch_size: int, merge_size: int) -> dict[str, Any]:
    """The Qwen2-VL image processor keys of the embedded default (small images) for a vision
    encoder's patch and merge sizes."""
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "patch_size": patch_size,
        "temporal_patch_size": temporal_patch_size,
        "merge_size": merge_size,
        "min_pixels": 32 * 32,
        "max_pixels": 256 * 256,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "resample": 3,
        "rescale_factor": 1 / 255,
    }


def _add_image_processor(directory: Path) -> None:
    """Merges the Qwen2-VL image processor keys into ``preprocessor_config.json`` (published layout)."""
    path = directory / "preprocessor_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(image_processor_settings(16, 2, 2))
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def demo_cache_key(seed: int = DEMO_SEED) -> str:
    import transformers

    recipe = json.dumps(
        {
            "v": DEMO_VERSION,
            "seed": seed,
            "tf": transformers.__version__.split(".")[:2],
            "tok": SPECIAL_TOKENS + TOOL_TOKENS,
        },
        sort_keys=True,
    )
    return hashlib.sha256(recipe.encode()).hexdigest()[:12]


def ensure_demo_checkpoint(cache_root: Path | None = None, *, seed: int = DEMO_SEED) -> Path:
    """The demo checkpoint's folder, built in the cache on first use (:func:`..cache.ensure_built`)."""
    return ensure_built(
        f"demo-qwen3-omni-{demo_cache_key(seed)}", lambda d: build_demo_checkpoint(d, seed=seed), cache_root
    )
