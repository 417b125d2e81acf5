"""Incremental detokenization and token choice, on their own."""

from __future__ import annotations

import torch
from omnirt.stages.speech.demo_tokenizer import build_tokenizer
from omnirt.stages.speech.detok import IncrementalDetokenizer
from omnirt.stages.speech.sampling import (
    SamplingParams,
    apply_repetition_penalty,
    choose,
    choose_rows,
    choose_rows_tensor,
)
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


def test_tiny_top_p_is_greedy_and_temperature_spreads() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=gen)
    best = int(logits.argmax())
    assert {choose(logits, SamplingParams(1.0, 1e-6, 0, gen)) for _ in range(20)} == {best}
    assert len({choose(logits, SamplingParams(5.0, 1.0, 0, gen)) for _ in range(50)}) > 5
    assert {choose(logits, SamplingParams(5.0, 1.0, 1, gen)) for _ in range(20)} == {best}  # top_k=1


def test_choose_rows_mixes_greedy_and_sampled_rows() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 40, generator=gen)
    rows = choose_rows(logits, [SamplingParams(), SamplingParams(1.0, 1.0, 0, gen), SamplingParams()])
    assert rows[0] == int(logits[0].argmax()) and rows[2] == int(logits[2].argmax())


def test_choose_rows_tensor_draws_the_sampled_rows_in_order() -> None:
    """Sampled rows draw one after another from their generators (top-k and top-p on), so the
    batch equals choosing each row on its own with the same generator states."""
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))

    def params(seed: int) -> list[SamplingParams]:
        gen = torch.Generator().manual_seed(seed)  # shared by the sampled rows, like one request's
        return [
            SamplingParams(),
            SamplingParams(1.0, 0.8, 50, gen),
            SamplingParams(),
            SamplingParams(0.9, 0.5, 8, gen),
        ]

    batch = choose_rows_tensor(logits, params(5))
    one_by_one = [choose(row, p) for row, p in zip(logits, params(5), strict=True)]
    assert batch.dtype == torch.long and batch.tolist() == one_by_one
    assert one_by_one[0] == int(logits[0].argmax()) and one_by_one[2] == int(logits[2].argmax())


def test_repetition_penalty_matches_transformers() -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = torch.tensor([[1.0, -2.0, 3.0, 0.5]])
    seen = torch.tensor([[True, True, False, False]])
    expected = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([[0, 1]]), logits.clone())
    assert torch.allclose(apply_repetition_penalty(logits, seen, 1.3), expected)
