"""An offline byte-level BPE tokenizer with the Qwen chat tokens, for the embedded demo model.

Every byte is a token, so any text round-trips; a few merges make the chat role names single
tokens, as the Qwen3-Omni talker needs (it finds user turns by the token after ``<|im_start|>``).
The chat template renders audio and image parts the way the published Qwen3-Omni template does
(one placeholder each, expanded to the encoder's length by the prompt builder).
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel

#: Special tokens in id order, after the byte vocabulary and the merged role words.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|audio_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
)
ROLE_WORDS = ("user", "assistant", "system")

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] == 'audio' -%}{{- '<|audio_start|><|audio_pad|><|audio_end|>' -}}"
    "{%- elif part['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def role_merges() -> tuple[list[str], list[tuple[str, str]]]:
    """The BPE merges that make each role word one token, and the tokens they produce."""
    products: list[str] = []
    merges: list[tuple[str, str]] = []
    for word in ROLE_WORDS:
        prefix = word[0]
        for ch in word[1:]:
            merges.append((prefix, ch))
            prefix += ch
            if prefix not in products:
                products.append(prefix)
    return products, merges


def build_tokenizer() -> Tokenizer:
    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    products, merges = role_merges()
    for token in products:
        vocab.setdefault(token, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def save_tokenizer(directory: Path) -> dict[str, int]:
    """Writes ``tokenizer.json`` + ``tokenizer_config.json``; returns the ids of the special
    tokens and role words, and the vocabulary size under ``"<vocab_size>"``."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(),
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )
    fast.save_pretrained(str(directory))
    ids = {t: fast.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    ids.update({w: fast.convert_tokens_to_ids(w) for w in ROLE_WORDS})
    ids["<vocab_size>"] = len(fast)
    return ids
