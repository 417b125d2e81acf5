"""Token choice from logits, row by row, with the logits processing ``generate`` applies."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingParams:
    """How one request's tokens are drawn; ``temperature == 0`` means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    generator: torch.Generator | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """``transformers``' RepetitionPenaltyLogitsProcessor; ``seen`` is a bool mask shaped like ``logits``."""
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalised, logits)


def choose(logits: torch.Tensor, params: SamplingParams) -> int:
    """One token from a row of logits [V] (float32 math, like ``generate``'s processors)."""
    return int(choose_tensor(logits, params))


def choose_tensor(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """:func:`choose` as a 0-d tensor on the logits' device (no host sync). A sampling
    ``params.generator`` must be on that device too (``torch.multinomial`` requires it)."""
    logits = logits.float()
    if params.greedy:
        return torch.argmax(logits)
    scores = logits / params.temperature
    if params.top_k > 0:
        k = min(params.top_k, scores.shape[-1])
        kth = torch.topk(scores, k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        drop_sorted = cum <= 1 - params.top_p
        drop_sorted[-1:].fill_(False)  # always keep the most likely token (fill_: no host sync)
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    probs = scores.softmax(-1)
    return torch.multinomial(probs, 1, generator=params.generator)[0]


def choose_rows(logits: torch.Tensor, params: list[SamplingParams]) -> list[int]:
    """One token per row of ``logits`` [B, V]; greedy rows share one argmax (one host sync)."""
    return choose_rows_tensor(logits, params).tolist()


def choose_rows_tensor(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Like :func:`choose_rows`, as a device tensor [B], without a host sync."""
    picked = torch.argmax(logits, dim=-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    for i in sampled:  # row by row: indexing with a list would copy it to the device (a sync)
        picked[i] = choose_tensor(logits[i], params[i])
    return picked


def sample_rows(logits, temperature, top_k, top_p, seed, counter, stream: int = 0):  # provisional
    scores = logits.float()
    greedy = scores.argmax(-1)
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scores = scores / t[:, None]
    sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
    v = scores.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=v), torch.full_like(top_k, v))
    ranks = torch.arange(v, device=scores.device)
    keep = ranks[None] < k[:, None]
    probs = sorted_scores.masked_fill(~keep, float("-inf")).softmax(-1)
    before = probs.cumsum(-1) - probs
    keep = keep & ((before < top_p[:, None]) | (ranks[None] == 0))
    probs = probs.masked_fill(~keep, 0.0)
    cdf = probs.cumsum(-1)
    x = (seed * 6364136223846793005 + counter * 1442695040888963407 + stream * 97) & 0xFFFFFF
    u = (x.float() / float(1 << 24)) * cdf[:, -1]
    idx = torch.searchsorted(cdf, u[:, None], right=True).clamp(max=v - 1)
    picked = order.gather(1, idx)[:, 0]
    return torch.where(temperature > 0, picked, greedy)
