"""An offline byte-level BPE tokenizer with the Qwen chat tokens, for the embedded demo model.

Every byte is a token, so any text round-trips; a few merges make the chat role names single
tokens, as the Qwen3-Omni talker needs (it finds user turns by the token after ``<|im_start|>``).
The chat template renders audio and image parts the way the published Qwen3-Omni template does
(one placeholder each, expanded to the encoder's length by the prompt builder), and tools, tool
calls and tool results the way it does (the Qwen3 format): a ``# Tools`` system block with one
JSON line per function in ``<tools>``, assistant calls as ``<tool_call>`` JSON blocks, results
as ``<tool_response>`` blocks in a user turn. The four tool tags are added tokens that are not
special (they decode to their text), as in the published vocabulary.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
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
#: The tool-calling tags: added tokens after the special ones (not special: they decode to text).
#: The published vocabulary has them at 151657, 151658, 151665 and 151666.
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
PUBLISHED_TOOL_TOKEN_IDS = dict(zip(TOOL_TOKENS, (151657, 151658, 151665, 151666), strict=True))
ROLE_WORDS = ("user", "assistant", "system")

#: The chat template: every tag trims the whitespace around it, so only the quoted strings render.
CHAT_TEMPLATE = r"""
{%- macro render(content) -%}
    {%- if content is string -%}{{- content -}}
    {%- else -%}
        {%- for part in content -%}
            {%- if part['type'] == 'text' -%}{{- part['text'] -}}
            {%- elif part['type'] == 'audio' -%}{{- '<|audio_start|><|audio_pad|><|audio_end|>' -}}
            {%- elif part['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set first_system = messages and messages[0]['role'] == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if first_system -%}{{- render(messages[0]['content']) + '\n\n' -}}{%- endif -%}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
    {%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments ' -}}
    {{- 'within <tool_call></tool_call> XML tags:\n<tool_call>\n' -}}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif first_system -%}
    {{- '<|im_start|>system\n' + render(messages[0]['content']) + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- set role = message['role'] -%}
    {%- if role == 'user' or (role == 'system' and not loop.first) -%}
        {{- '<|im_start|>' + role + '\n' + render(message['content']) + '<|im_end|>\n' -}}
    {%- elif role == 'assistant' -%}
        {%- set content = render(message['content']) -%}
        {{- '<|im_start|>assistant\n' + content -}}
        {%- for call in message.get('tool_calls') or [] -%}
            {%- if content or not loop.first -%}{{- '\n' -}}{%- endif -%}
            {%- set call = call['function'] if call.get('function') else call -%}
            {{- '<tool_call>\n{"name": "' + call['name'] + '", "arguments": ' -}}
            {%- if call['arguments'] is string -%}{{- call['arguments'] -}}
            {%- else -%}{{- call['arguments'] | tojson -}}
            {%- endif -%}
            {{- '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' + render(message['content']) + '\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""


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
    tok.add_tokens(tool_tokens())
    return tok


def tool_tokens() -> list[AddedToken]:
    """The tool tags as added tokens that are not special (as in the published tokenizer)."""
    return [AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS]


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
    ids = {t: fast.convert_tokens_to_ids(t) for t in (*SPECIAL_TOKENS, *TOOL_TOKENS)}
    ids.update({w: fast.convert_tokens_to_ids(w) for w in ROLE_WORDS})
    ids["<vocab_size>"] = len(fast)
    return ids
