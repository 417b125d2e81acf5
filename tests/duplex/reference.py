"""Tiny random ``MoshiForConditionalGeneration`` references and the offline teacher-forced run
that the duplex LM's streams are checked against."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from omnirt.codecs.mimi.reference import TINY_MIMI, randomize_codebooks
from omnirt.stages.duplex.lm import DuplexLM, DuplexStep

K = 8


def tiny_config(**overrides: Any):
    from transformers import MoshiConfig

    kwargs: dict[str, Any] = {
        "vocab_size": 96,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "ffn_dim": 128,
        "max_position_embeddings": 64,
        "sliding_window": 64,
        "num_codebooks": K,
        "audio_encoder_config": dict(TINY_MIMI),
        "depth_decoder_config": {
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "ffn_dim": 64,
        },
    }
    kwargs.update(overrides)
    return MoshiConfig(**kwargs)


def reference_model(seed: int = 0, **overrides: Any):
    """A seeded random ``MoshiForConditionalGeneration`` (eval, float32, sdpa attention) whose
    Mimi codebooks are random too (fresh ones are all zeros)."""
    from transformers import MoshiForConditionalGeneration

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MoshiForConditionalGeneration(tiny_config(**overrides)).eval()
    randomize_codebooks(model.audio_encoder, seed)
    # Flexible linears start as randn (std 1): scale them like the rest so logits stay moderate.
    with torch.no_grad():
        for param in model.depth_decoder.parameters():
            if param.dim() == 3:
                param.mul_(param.shape[-1] ** -0.5)
    return model


def save_reference(path: Path, seed: int = 0, **overrides: Any):
    model = reference_model(seed, **overrides)
    model.save_pretrained(str(path))
    return model


def run_stream(lm: DuplexLM, slot: int, user: torch.Tensor, batch: int | None = None) -> list[DuplexStep]:
    """Steps ``slot`` alone (rows ``0..batch-1``, only ``slot`` active) through ``user`` [N, K]."""
    rows = batch or slot + 1
    out = []
    for frame in user:
        codes = torch.zeros((rows, K), dtype=torch.long)
        codes[slot] = frame
        active = torch.zeros(rows, dtype=torch.bool)
        active[slot] = True
        step = lm.step(codes, active)
        out.append(
            DuplexStep(*(t[slot].clone() for t in (step.text, step.audio, step.audio_ready, step.delayed)))
        )
    return out


def delayed_layout(model, user: torch.Tensor, steps: list[DuplexStep]) -> dict[str, torch.Tensor]:
    """The reference's inputs for positions ``0..N-1`` of a stream of ``N`` steps: the text ids,
    the model's and the user's codes in the delayed layout (``build_delay_pattern_mask`` of the
    unconditional frame followed by the frames, see ``stages/duplex/lm.py``)."""
    n = len(steps)
    v, av = model.config.vocab_size, model.config.audio_vocab_size
    text = torch.tensor([v] + [int(s.text) for s in steps[:-1]])
    moshi = torch.full((K, n), av)
    users = torch.full((K, n), av)
    for p in range(1, n):
        moshi[0, p] = steps[p - 1].delayed[0]  # semantic of frame p, sampled at step p - 1
        users[0, p] = user[p, 0]
        if p >= 2:
            moshi[1:, p] = steps[p - 1].delayed[1:]  # acoustic of frame p - 1
            users[1:, p] = user[p - 1, 1:]
    return {"input_ids": text[None], "moshi_audio_codes": moshi[None], "user_audio_codes": users[None]}


def sliding_mask(n: int, window: int) -> torch.Tensor:
    """A 4D float mask [1, 1, n, n]: position q sees ``q - window < k <= q`` (transformers takes
    a prepared 4D mask as is)."""
    q = torch.arange(n)[:, None]
    k = torch.arange(n)[None, :]
    visible = (k <= q) & (k > q - window)
    return torch.where(visible, 0.0, float("-inf"))[None, None]


@torch.no_grad()
def teacher_forced(
    model, user: torch.Tensor, steps: list[DuplexStep], window: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own modules on the whole stream, teacher-forced with our tokens: the text
    logits [N, V] at every position and the depth decoder's logits [N, K, AV] given our codes.
    With ``window``, the temporal attention sees only the last ``window`` positions."""
    inputs = delayed_layout(model, user, steps)
    n = len(steps)
    if window is not None:
        inputs["attention_mask"] = sliding_mask(n, window)
    out = model(**inputs, use_cache=False)
    hidden = out.last_hidden_state[0].view(n, 1, -1)
    text_next = torch.stack([s.text for s in steps]).view(n, 1)
    codes = torch.stack([s.delayed for s in steps])
    depth_ids = torch.cat((text_next, codes[:, :-1]), dim=1)
    depth = model.depth_decoder(
        input_ids=depth_ids, last_hidden_state=hidden, attention_mask=torch.ones_like(depth_ids)
    )
    return out.logits[0], depth.logits
