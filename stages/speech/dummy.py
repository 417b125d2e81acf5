"""Random weights at real size from a ``config.json`` alone (``--load-format dummy``, as in vLLM).

:func:`build_random_model` builds ``Qwen3OmniMoeForConditionalGeneration`` directly on the
target device in the target dtype (no CPU copy, nothing read from disk) and initialises it
from a seed: transformers' own ``_init_weights`` (linear and embedding weights normal with the
config's ``initializer_range``, norms 1, biases 0, the code2wav offsets and sinusoid tables
computed), then the MoE weights it leaves out (the talker's experts come from ``torch.empty`` and
its routers are zero) drawn the same way. Rotary ``inv_freq`` buffers are computed by the
modules themselves on the device, so nothing is left uninitialised.

When the folder has no tokenizer, :func:`config_tokenizer` builds the embedded default's
tokenizer (``demo_tokenizer``: byte-level BPE, the chat tokens, the role words merged into
single tokens, the demo chat template) laid out at the ids the config names: the published
config puts ``<|im_start|>`` at 151644 and ``user`` at 872, which the tiny demo vocabulary does
not have. The tool-calling tags go to their published ids (``<tool_call>`` at 151657, ...) when
the vocabulary has room there, else after the other chat tokens. The remaining ids up to the
config's text ``vocab_size`` hold filler pseudo-words (`` bakito``), so every id a random model
draws decodes to readable babble. For the demo's own config this layout is exactly the demo
tokenizer.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn

from .demo_tokenizer import (
    CHAT_TEMPLATE,
    PUBLISHED_TOOL_TOKEN_IDS,
    SPECIAL_TOKENS,
    TOOL_TOKENS,
    role_merges,
    tool_tokens,
)

log = logging.getLogger(__name__)

#: ``--load-format`` values: ``auto`` reads the checkpoint's weights, ``dummy`` draws random ones.
LOAD_FORMATS = ("auto", "dummy")
DEFAULT_SEED = 0

#: Token ids a Qwen3-Omni config names, and the token each stands for. The model or the pipeline
#: reads these, so they are placed at the config's ids (its defaults when config.json omits them).
TOP_LEVEL_TOKENS = {
    "im_start_token_id": "<|im_start|>",
    "im_end_token_id": "<|im_end|>",
    "tts_pad_token_id": "<tts_pad>",
    "tts_bos_token_id": "<tts_text_bos>",
    "tts_eos_token_id": "<tts_text_eod>",
    "system_token_id": "system",
    "user_token_id": "user",
    "assistant_token_id": "assistant",
}
SUB_CONFIG_TOKENS = {
    "audio_token_id": "<|audio_pad|>",
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "audio_start_token_id": "<|audio_start|>",
    "vision_start_token_id": "<|vision_start|>",
    "user_token_id": "user",
}
#: Only placed where config.json names them (the model never reads them; the class defaults
#: would fall outside a small vocabulary).
OPTIONAL_SUB_CONFIG_TOKENS = {
    "audio_end_token_id": "<|audio_end|>",
    "vision_end_token_id": "<|vision_end|>",
}
SUB_CONFIGS = ("thinker_config", "talker_config")

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_SYLLABLES = [c + v for c in _CONSONANTS for v in _VOWELS]


class TokenLayoutError(ValueError):
    """The config's token ids cannot be laid out in its vocabulary (the message says which)."""


# -- weights ----------------------------------------------------------------------------------------


def build_random_model(
    config: Any, *, device: torch.device, dtype: torch.dtype, seed: int = DEFAULT_SEED
) -> nn.Module:
    """``Qwen3OmniMoeForConditionalGeneration(config)`` with seeded random weights, built on
    ``device`` in ``dtype`` (same seed, device and dtype: the same weights). The process's global
    RNG state is left as it was."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    start = time.perf_counter()
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.device(device):
        torch.manual_seed(seed)
        model = Qwen3OmniMoeForConditionalGeneration._from_config(config, dtype=dtype)
        init_moe_weights(model)
    model.eval()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    params = sum(p.numel() for p in model.parameters())
    log.info(
        "built %s with %s random parameters on %s (%s, seed %d) in %.1f s",
        type(model).__name__,
        f"{params / 1e9:.2f} B" if params >= 1e8 else f"{params / 1e6:.2f} M",
        device,
        dtype,
        seed,
        time.perf_counter() - start,
    )
    return model


def init_moe_weights(model: nn.Module) -> int:
    """Draws every MoE expert weight (3-D ``gate_up_proj`` / ``down_proj``) and router weight
    from a normal with the owning sub-model's ``initializer_range``, from the global RNG.

    transformers initialises the thinker's but not the talker's (``torch.empty`` and zeros), and
    releases differ; drawing them all here makes the result independent of that. Returns the
    number of tensors drawn."""
    from transformers import PreTrainedModel

    stds = {
        name: float(getattr(module.config, "initializer_range", 0.02) or 0.02)
        for name, module in model.named_modules()
        if isinstance(module, PreTrainedModel)
    }
    drawn = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            targets = [
                p for n, p in module.named_parameters(recurse=False) if n in ("gate_up_proj", "down_proj")
            ]
            targets = [p for p in targets if p.dim() == 3]
            router = getattr(module, "weight", None)
            if "Router" in type(module).__name__ and isinstance(router, nn.Parameter):
                targets.append(router)
            if not targets:
                continue
            owner = max((k for k in stds if k == "" or name == k or name.startswith(k + ".")), key=len)
            for param in targets:
                param.normal_(0.0, stds[owner])
                drawn += 1
    return drawn


# -- tokenizer --------------------------------------------------------------------------------------


def _int_id(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TokenLayoutError(f"{where} must be an integer token id, not {value!r}")
    return value


def config_token_ids(config: Any, raw: dict[str, Any]) -> dict[str, int]:
    """The token (string) -> id placements the config requires (see the tables above).

    Raises :class:`TokenLayoutError` when an id is outside the thinker's text vocabulary, when one
    token gets two ids, or two tokens one id."""
    vocab_size = int(config.thinker_config.text_config.vocab_size)
    placed: dict[str, int] = {}
    holders: dict[int, str] = {}

    def place(token: str, value: Any, where: str) -> None:
        if value is None:
            return
        token_id = _int_id(value, where)
        if not 0 <= token_id < vocab_size:
            raise TokenLayoutError(
                f"{where} = {token_id} is outside the thinker's text vocabulary (vocab_size {vocab_size})"
            )
        if placed.get(token, token_id) != token_id:
            raise TokenLayoutError(f"{where} = {token_id}, but {token!r} is at {placed[token]} elsewhere")
        if holders.get(token_id, token) != token:
            raise TokenLayoutError(f"{where} = {token_id} is also the id of {holders[token_id]!r}")
        placed[token] = token_id
        holders[token_id] = token

    for key, token in TOP_LEVEL_TOKENS.items():
        place(token, getattr(config, key, None), key)
    for section in SUB_CONFIGS:
        sub = getattr(config, section, None)
        if sub is None:
            continue
        for key, token in SUB_CONFIG_TOKENS.items():
            place(token, getattr(sub, key, None), f"{section}.{key}")
        for key, token in OPTIONAL_SUB_CONFIG_TOKENS.items():
            if key in (raw.get(section) or {}):
                place(token, getattr(sub, key, None), f"{section}.{key}")
    return placed


def _filler(token_id: int, width: int) -> str:
    """A pseudo-word for ``token_id`` in byte-level form (``Ġ`` is the leading space)."""
    parts = []
    for _ in range(width):
        token_id, digit = divmod(token_id, len(_SYLLABLES))
        parts.append(_SYLLABLES[digit])
    return "\u0120" + "".join(parts)


def config_vocab(config: Any, raw: dict[str, Any]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The byte-level BPE vocabulary (token -> id, dense over ``vocab_size``) and merges of the
    tokenizer :func:`config_tokenizer` builds."""
    from tokenizers.pre_tokenizers import ByteLevel

    vocab_size = int(config.thinker_config.text_config.vocab_size)
    vocab = dict(config_token_ids(config, raw))
    taken = set(vocab.values())
    for token, token_id in PUBLISHED_TOOL_TOKEN_IDS.items():
        if token_id < vocab_size and token_id not in taken and token not in vocab:
            vocab[token] = token_id
            taken.add(token_id)
    products, merges = role_merges()
    needed = [*sorted(ByteLevel.alphabet()), *products, *SPECIAL_TOKENS, *TOOL_TOKENS]
    free = (i for i in range(vocab_size) if i not in taken)
    for token in needed:
        if token in vocab:
            continue
        token_id = next(free, None)
        if token_id is None:
            raise TokenLayoutError(
                f"the thinker's text vocab_size {vocab_size} is too small for the byte-level tokenizer "
                f"({len(set(needed))} tokens)"
            )
        vocab[token] = token_id
    width = 1
    while len(_SYLLABLES) ** width < vocab_size:
        width += 1
    for token_id in free:
        vocab[_filler(token_id, width)] = token_id
    return vocab, merges


def config_tokenizer(config: Any, raw: dict[str, Any]) -> Any:
    """A ``PreTrainedTokenizerFast`` of the embedded default's design with the config's ids
    (built in memory, offline; about a second at the published 152k vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab, merges = config_vocab(config, raw)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))  # already in the vocabulary: they keep their ids
    tok.add_tokens(tool_tokens())
    limit = int(getattr(config.thinker_config.text_config, "max_position_embeddings", 4096))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=limit,
    )
    for token in (*SPECIAL_TOKENS, *TOOL_TOKENS):
        if fast.convert_tokens_to_ids(token) != vocab[token]:
            raise RuntimeError(f"special token {token!r} moved from id {vocab[token]}")
    return fast


# -- audio and image preprocessing ------------------------------------------------------------------


def default_feature_extractor(config: Any) -> Any:
    """Whisper log-mel features with the audio encoder's number of mel bins (16 kHz)."""
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(feature_size=int(config.thinker_config.audio_config.num_mel_bins))


def default_image_processor(config: Any) -> Any:
    """The Qwen2-VL image processor with the vision encoder's patch and merge sizes (the other
    settings are the embedded default's)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from .demo import image_processor_settings

    vision = config.thinker_config.vision_config
    settings = image_processor_settings(
        int(vision.patch_size), int(vision.temporal_patch_size), int(vision.spatial_merge_size)
    )
    del settings["image_processor_type"]
    return Qwen2VLImageProcessorPil.from_dict(settings)
