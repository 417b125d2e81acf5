"""Incremental detokenization and the repetition penalty, on their own (the sampler: test_sampler.py)."""

from __future__ import annotations

import torch
from omnirt.stages.sampling import apply_repetition_penalty
from omnirt.stages.speech.demo_tokenizer import build_tokenizer
from omnirt.stages.speech.detok import IncrementalDetokenizer
from transformers import PreTrainedTokenizerFast


def test_detokenizer_never_splits_a_character() -> None:
    tok = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer())
    text = "Grüße, 你好 🎙️ ok"
    ids = tok(text)["input_ids"]
    assert len(ids) > len(text)  # byte-level: multi-byte characters span several tokens
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # some tokens completed no character yet


def test_detokenizer_flushes_an_unfinished_character_at_the_end() -> None:
    tok = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer())
    ids = tok("é")["input_ids"]
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ids[0]) == ""
    assert detok.flush() == "\ufffd"


def test_detokenizer_skips_padded_vocabulary_rows() -> None:
    tok = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer())
    detok = IncrementalDetokenizer(tok, vocab_limit=len(tok))
    assert detok.push(len(tok) + 5) == ""
    assert detok.push(tok.convert_tokens_to_ids("h")) == "h"


def test_repetition_penalty_matches_transformers() -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = torch.tensor([[1.0, -2.0, 3.0, 0.5]])
    seen = torch.tensor([[True, True, False, False]])
    expected = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([[0, 1]]), logits.clone())
    assert torch.allclose(apply_repetition_penalty(logits, seen, 1.3), expected)
