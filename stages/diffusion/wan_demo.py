"""The embedded default video model: a tiny Wan2.1 text-to-video pipeline with random weights.

It has every part of the published pipeline (``WanPipeline``: a UMT5 text encoder and its T5
tokenizer, ``WanTransformer3DModel``, ``AutoencoderKLWan``, the ``UniPCMultistepScheduler`` of
Wan2.1 with flow shift 3) at toy sizes, saved in the diffusers layout (``model_index.json`` and a
folder per component) so the one loader serves it and real checkpoints alike. The tokenizer is a
small SentencePiece-style Unigram model (T5's kind) built offline with ``tokenizers``. The weights
are random (seeded): it draws coloured noise that moves.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import string
from pathlib import Path
from typing import Any

import torch

from ..cache import MARKER, ensure_built

log = logging.getLogger(__name__)

WAN_DEMO_SEED = 4321
#: Bumped whenever the recipe below changes, so an old cache is never reused.
WAN_DEMO_VERSION = 1
# MARKER (``..cache``): the marker file of a built demo folder also holds its defaults and limits.

#: T5's special tokens, at T5's ids.
SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")
DEMO_WORDS = (
    "the a an and of in on at to with is are it this that cat dog bird fish man woman child city sea sky "
    "sun moon tree car red blue green white black small big running walking flying slowly video"
).split()

#: The published Wan2.1 T2V scheduler (``scheduler/scheduler_config.json`` of the diffusers
#: folders; flow shift 3.0 is the 480p setting).
WAN21_SCHEDULER_CONFIG: dict[str, Any] = {
    "_class_name": "UniPCMultistepScheduler",
    "beta_end": 0.02,
    "beta_schedule": "linear",
    "beta_start": 0.0001,
    "disable_corrector": [],
    "dynamic_thresholding_ratio": 0.995,
    "final_sigmas_type": "zero",
    "flow_shift": 3.0,
    "lower_order_final": True,
    "num_train_timesteps": 1000,
    "predict_x0": True,
    "prediction_type": "flow_prediction",
    "rescale_betas_zero_snr": False,
    "sample_max_value": 1.0,
    "solver_order": 2,
    "solver_p": None,
    "solver_type": "bh2",
    "steps_offset": 0,
    "thresholding": False,
    "timestep_spacing": "linspace",
    "trained_betas": None,
    "use_beta_sigmas": False,
    "use_exponential_sigmas": False,
    "use_flow_sigmas": True,
    "use_karras_sigmas": False,
}

TEXT_ENCODER_CONFIG: dict[str, Any] = {
    "model_type": "umt5",
    "vocab_size": 256,
    "d_model": 32,
    "d_kv": 8,
    "d_ff": 64,
    "num_layers": 2,
    "num_heads": 4,
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "feed_forward_proj": "gated-gelu",
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "decoder_start_token_id": 0,
}

TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": [1, 2, 2],
    "num_attention_heads": 2,
    "attention_head_dim": 12,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 32,
    "freq_dim": 32,
    "ffn_dim": 48,
    "num_layers": 2,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "rope_max_seq_len": 64,
}

VAE_CONFIG: dict[str, Any] = {
    "base_dim": 8,
    "z_dim": 16,
    "dim_mult": [1, 1, 2, 2],
    "num_res_blocks": 1,
    "temperal_downsample": [False, True, True],
}

#: What a request to the demo gets when it leaves a field out, and what it may ask for (CPU sized).
DEMO_DEFAULTS: dict[str, Any] = {
    "width": 64,
    "height": 64,
    "num_frames": 17,
    "fps": 16,
    "num_inference_steps": 4,
    "guidance_scale": 5.0,
}
DEMO_LIMITS: dict[str, Any] = {"max_width": 256, "max_height": 256, "max_frames": 65, "max_steps": 50}


def demo_vocabulary() -> list[tuple[str, float]]:
    """The Unigram pieces and log-probabilities: T5's specials at 0-2, the word-start marker, every
    printable ASCII character alone and after the marker, then a few whole words."""
    chars = string.ascii_letters + string.digits + string.punctuation
    vocab = [(tok, 0.0) for tok in SPECIAL_TOKENS] + [("\u2581", -2.0)]
    vocab += [(c, -5.0) for c in chars]
    vocab += [("\u2581" + c, -4.0) for c in chars]
    vocab += [("\u2581" + w, -3.0) for w in DEMO_WORDS]
    return vocab


def save_demo_tokenizer(directory: Path) -> int:
    """Writes the demo's T5 tokenizer (``tokenizer.json``, ``tokenizer_config.json``,
    ``special_tokens_map.json``) into ``directory``; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    vocab = demo_vocabulary()
    tok = Tokenizer(models.Unigram(vocab, unk_id=SPECIAL_TOKENS.index("<unk>"), byte_fallback=False))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(" {2,}", " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    specials = {"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}
    config = {"tokenizer_class": "T5Tokenizer", "extra_ids": 0, "model_max_length": 512, **specials}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (directory / "special_tokens_map.json").write_text(json.dumps(specials, indent=2, sort_keys=True) + "\n")
    return len(vocab)


def build_wan_demo(directory: Path, *, seed: int = WAN_DEMO_SEED) -> None:
    """Builds the demo pipeline folder into ``directory`` (which must not exist yet)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel

    directory.mkdir(parents=True)
    tok_dir = directory / "tokenizer"
    vocab_size = save_demo_tokenizer(tok_dir)
    if vocab_size > TEXT_ENCODER_CONFIG["vocab_size"]:
        raise RuntimeError(f"demo tokenizer has {vocab_size} tokens, the text encoder fewer")
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    with torch.random.fork_rng(devices=[]):  # leave the process's global RNG as it was
        torch.manual_seed(seed)
        text_encoder = UMT5EncoderModel(UMT5Config(**TEXT_ENCODER_CONFIG)).eval()
        transformer = WanTransformer3DModel(**TRANSFORMER_CONFIG).eval()
        vae = AutoencoderKLWan(**VAE_CONFIG).eval()
    scheduler = UniPCMultistepScheduler.from_config(
        {k: v for k, v in WAN21_SCHEDULER_CONFIG.items() if not k.startswith("_")}
    )
    for name, module in (("text_encoder", text_encoder), ("transformer", transformer), ("vae", vae)):
        for pname, param in module.named_parameters():
            if not torch.isfinite(param).all():
                raise RuntimeError(f"non-finite weights in {name}.{pname} of the demo Wan")
    pipe = WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler, transformer=transformer
    )
    pipe.save_pretrained(str(directory))
    # save_pretrained rewrites the tokenizer folder: keep exactly the files written above.
    shutil.rmtree(tok_dir)
    save_demo_tokenizer(tok_dir)
    marker = {
        "random_weights": True,
        "seed": seed,
        "version": WAN_DEMO_VERSION,
        "defaults": DEMO_DEFAULTS,
        "limits": DEMO_LIMITS,
    }
    (directory / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")


def wan_demo_cache_key(seed: int = WAN_DEMO_SEED) -> str:
    import diffusers
    import transformers

    recipe = json.dumps(
        {
            "v": WAN_DEMO_VERSION,
            "seed": seed,
            "tf": transformers.__version__.split(".")[:2],
            "diffusers": diffusers.__version__.split(".")[:2],
            "configs": [TEXT_ENCODER_CONFIG, TRANSFORMER_CONFIG, VAE_CONFIG, WAN21_SCHEDULER_CONFIG],
            "vocab": demo_vocabulary(),
            "defaults": DEMO_DEFAULTS,
            "limits": DEMO_LIMITS,
        },
        sort_keys=True,
    )
    return hashlib.sha256(recipe.encode()).hexdigest()[:12]


def ensure_wan_demo(cache_root: Path | None = None, *, seed: int = WAN_DEMO_SEED) -> Path:
    """The demo Wan folder, built in the cache on first use (:func:`...cache.ensure_built`)."""
    return ensure_built(
        f"demo-wan2.1-t2v-{wan_demo_cache_key(seed)}", lambda d: build_wan_demo(d, seed=seed), cache_root
    )
