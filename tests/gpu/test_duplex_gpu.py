"""The duplex LM on CUDA with bf16 dummy weights of a mid-size Moshi config: CUDA-graph replay
bitwise equal to eager at several batch buckets, and no host sync inside a step.

Run on the lent GPU: ``pytest -m gpu -s tests/gpu/test_duplex_gpu.py``; results go to
docs/benchmarks.md. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from omnirt.stages.duplex.lm import DuplexLM, DuplexSampling
from omnirt.stages.duplex.loader import dummy_duplex_lm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SLOTS = 32
STEPS = 12
K = 8


def _config():
    from transformers import MoshiConfig

    return MoshiConfig(
        vocab_size=32000,
        hidden_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        ffn_dim=4096,
        max_position_embeddings=3000,
        sliding_window=3000,
        num_codebooks=K,
        audio_vocab_size=2048,  # no audio_encoder_config here to take it from
        depth_decoder_config={
            "hidden_size": 512,
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "ffn_dim": 2048,
        },
    )


def _lm(graphs: bool) -> DuplexLM:
    return dummy_duplex_lm(
        _config(), max_slots=SLOTS, device="cuda", dtype=torch.bfloat16, seed=0, graphs=graphs, max_frames=512
    )


def _start(lm: DuplexLM, rows: int) -> None:
    for slot in range(rows):
        sampled = slot % 2 == 1
        lm.start(
            slot,
            DuplexSampling(
                text_temperature=0.7 if sampled else 0.0, audio_temperature=0.8 if sampled else 0.0, seed=slot
            ),
        )


def _stream(lm: DuplexLM, rows: int) -> list[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(rows)
    out = []
    for n in range(STEPS):
        codes = torch.randint(0, 2048, (rows, K), generator=generator)
        active = torch.ones(rows, dtype=torch.bool)
        if rows > 1:
            active[n % rows] = False  # one idle row per step
        step = lm.step(codes, active)
        out.append((step.text, step.audio, step.audio_ready, step.delayed))
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("rows", [1, 8, 32])
def test_graph_replay_equals_eager_bitwise(rows: int) -> None:
    eager = _lm(graphs=False)
    _start(eager, rows)
    expected = _stream(eager, rows)
    del eager
    graphed = _lm(graphs=True)
    graphed.capture()
    assert graphed.graphs > 0
    _start(graphed, rows)
    got = _stream(graphed, rows)
    assert graphed.last_path == "graph"
    for want, have in zip(expected, got, strict=True):
        for a, b in zip(want, have, strict=True):
            assert torch.equal(a, b)
    texts = torch.stack([s[0] for s in got])
    assert texts.unique().numel() > 1


def test_step_never_syncs_with_the_host() -> None:
    lm = _lm(graphs=False)
    _start(lm, 8)
    codes = torch.randint(0, 2048, (8, K), device="cuda")
    active = torch.tensor([True, False, True, True, True, True, False, True], device="cuda")
    lm._runner({"user_codes": codes, "active": active}, 1)  # first call: lazy initialisation may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        lm._runner({"user_codes": codes, "active": active}, 2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(lm.keys[-1].float()).all()
