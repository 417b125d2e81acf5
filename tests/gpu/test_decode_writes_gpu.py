"""The speech decode step's fewer launches on the GPU (marker ``gpu``; results in
docs/benchmarks.md): the QK-norm-RoPE kernel that also writes the step's keys and values into the
slot caches (``kernels/qk_norm_rope.qk_norm_rope_to_cache``) against the unfused kernel and the
two cache assignments it replaces, and the decode attention's one-chunk path (no combine launch)
against the combine, bitwise, at the real thinker's, talker's and code predictor's head shapes,
eagerly and replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch
from omnirt.kernels.decode_attention import decode_attention_triton, plan
from omnirt.kernels.qk_norm_rope import (
    fused_qk_norm_rope,
    qk_norm_rope_to_cache,
    split_packed_qkv,
    to_cache_applies,
)

from .speech_decoders import code_predictor_decoder

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# (query heads, kv heads) at head dim 128 in the published config: thinker, talker, code predictor
HEADS = [(32, 4), (16, 2), (16, 8)]


def _step(batch: int, hq: int, hk: int, dtype: torch.dtype, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dim, entries = 128, 40

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=g).to(dtype)

    qkv = randn(batch, 1, (hq + 2 * hk) * dim) * 3
    q, k, v = split_packed_qkv(qkv, hq, hk, dim)
    qw, kw = randn(dim), randn(dim)
    angles = torch.rand(1, 1, dim // 2, device="cuda", generator=g) * 40
    table = torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype)
    caches = [randn(batch + 3, hk, entries + 1, dim) for _ in range(2)]
    at = torch.randint(0, entries, (batch,), device="cuda", generator=g)
    at[-1] = entries  # an idle row: the scratch column
    return q, k, v, qw, kw, table, caches, at


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("hq", "hk"), HEADS)
@pytest.mark.parametrize("batch", [1, 8, 33])
def test_keys_and_values_written_by_the_kernel_are_the_assignments_bits(batch, hq, hk, dtype):
    q, k, v, qw, kw, table, caches, at = _step(batch, hq, hk, dtype, seed=batch + hq)
    assert to_cache_applies(q, k, v, qw, kw, table, *caches, at)
    want = [c.clone() for c in caches]
    want_q, want_k = fused_qk_norm_rope(q, k, qw, kw, table, eps=1e-6, interleaved=False)
    rows = torch.arange(batch, device="cuda")
    want[0][rows, :, at] = want_k[:, 0]
    want[1][rows, :, at] = v[:, 0]
    got_q = qk_norm_rope_to_cache(q, k, v, qw, kw, table, *caches, at, eps=1e-6, interleaved=False)
    assert torch.equal(got_q, want_q)
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])
    # replayed from a graph on other inputs: the same as eagerly
    fresh = [c.clone() for c in want]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = qk_norm_rope_to_cache(q, k, v, qw, kw, table, *fresh, at, eps=1e-6, interleaved=False)
    q2, k2, v2, _, _, _, _, at2 = _step(batch, hq, hk, dtype, seed=99)
    q.copy_(q2)  # views of one product: writes into the packed tensor
    k.copy_(k2)
    v.copy_(v2)
    at.copy_(at2)
    eager = [c.clone() for c in fresh]
    graph.replay()
    torch.cuda.synchronize()
    eager_q = qk_norm_rope_to_cache(q, k, v, qw, kw, table, *eager, at, eps=1e-6, interleaved=False)
    assert torch.equal(out, eager_q)
    assert torch.equal(fresh[0], eager[0]) and torch.equal(fresh[1], eager[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("hq", "hk"), HEADS)
@pytest.mark.parametrize("batch", [1, 8, 32])
def test_one_chunk_attention_is_the_combines_bits(batch, hq, hk, dtype):
    g = torch.Generator(device="cuda").manual_seed(batch * 7 + hq)
    keys = torch.randn(batch + 2, hk, 80, 128, device="cuda", generator=g).to(dtype)
    values = torch.randn(batch + 2, hk, 80, 128, device="cuda", generator=g).to(dtype)
    q = torch.randn(batch, hq, 128, device="cuda", generator=g).to(dtype)
    for attend in (1, 17, 64):
        if plan(batch, hk, attend, torch.cuda.get_device_properties(0).multi_processor_count)[0] != 1:
            continue
        lengths = torch.randint(0, attend + 1, (batch,), device="cuda", generator=g)
        lengths[0] = 0  # nothing visible: zeros
        direct = decode_attention_triton(q, keys, values, lengths, attend, 0.088)
        combined = decode_attention_triton(q, keys, values, lengths, attend, 0.088, combine=True)
        assert torch.equal(direct, combined), (attend, (direct - combined).abs().max())
        assert not direct[0].any()


@pytest.mark.parametrize("shared_rope", [False, True])
def test_slot_decoder_step_with_the_fused_writes_is_the_unfused_steps_bits(monkeypatch, shared_rope):
    """A ``SlotDecoder`` step at the code predictor's real head shapes (random weights, bf16): the
    hidden states and every cache entry the same with the keys and values written by the
    QK-norm-RoPE launch as by the two assignments after it."""
    from omnirt.stages.speech import slots

    decoder = code_predictor_decoder(layers=2, slots=8)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(8, 1024, device="cuda", generator=g).to(torch.bfloat16)
    active = torch.tensor([True, True, False, True, True, True, False, True], device="cuda")
    lengths = torch.tensor([3, 3, 0, 3, 3, 3, 5, 3], device="cuda")
    positions = torch.full((8,), 3, device="cuda")
    fused = {"calls": 0}
    applies = slots.to_cache_applies

    def counted(*args, **kwargs):
        fused["calls"] += 1
        return applies(*args, **kwargs)

    caches = (*decoder.keys, *decoder.values)
    start = [torch.randn(t.shape, device="cuda", generator=g).to(t.dtype) for t in caches]
    results = []
    for use in (True, False):
        monkeypatch.setattr(slots, "to_cache_applies", counted if use else (lambda *a, **k: False))
        for t, s in zip(caches, start, strict=True):
            t.copy_(s)
        decoder.lengths.copy_(lengths)
        rope = decoder.shared_rope(3) if shared_rope else None
        out = decoder.step(x, positions, active, 17, rope)
        results.append((out.clone(), [t.clone() for t in caches]))
    assert fused["calls"] == 2  # both layers took the fused writes
    assert torch.equal(results[0][0][active], results[1][0][active])
    for a, b in zip(results[0][1], results[1][1], strict=True):
        assert torch.equal(a, b)
