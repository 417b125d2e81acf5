"""kernels/decode_attention.py: the split-window decode kernel against its torch reference under
the Triton interpreter (fp32, small shapes), the fp8 cache's quantization, and the dispatcher."""

from __future__ import annotations

import math

import pytest
import torch
from omnirt.kernels.decode_attention import (
    BLOCK_N,
    FP8,
    decode_attention,
    decode_attention_reference,
    kernel_applies,
    plan,
    quantize_kv,
)

from .conftest import interpreted

SLOTS, KV_HEADS, WINDOW, DIM = 6, 2, 150, 32


def _cache(seed: int, heads: int = 4, batch: int = 5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, DIM, generator=g)
    keys = torch.randn(SLOTS, KV_HEADS, WINDOW + 1, DIM, generator=g)
    values = torch.randn(SLOTS, KV_HEADS, WINDOW + 1, DIM, generator=g)
    return q, keys, values


def _ring_lengths(positions: list[int]) -> torch.Tensor:
    """What the duplex LM passes: a slot at position p attends to its last min(p + 1, window)."""
    return (torch.tensor(positions) + 1).clamp(max=WINDOW)


@interpreted
@pytest.mark.parametrize("heads", [2, 4])  # one query head per kv head, and two
def test_kernel_equals_the_reference_at_every_length(heads):
    from omnirt.kernels.decode_attention import decode_attention_triton

    q, keys, values = _cache(0, heads)
    scale = 1 / math.sqrt(DIM)
    # lengths 0, 1, partial, a block boundary, full (ring wrapped: position past the window)
    lengths = torch.cat([torch.tensor([0]), _ring_lengths([0, 40, BLOCK_N - 1, 400]), torch.tensor([3])])
    for attend in (WINDOW, 96, 1):  # the full window and two buckets below some lengths
        got = decode_attention_triton(q, keys, values, lengths, attend, scale)
        want = decode_attention_reference(q, keys, values, lengths, attend, scale)
        assert got.shape == (5, heads * DIM)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got[0], torch.zeros(heads * DIM))  # nothing visible: zeros


@interpreted
def test_kernel_reads_only_the_visible_entries():
    from omnirt.kernels.decode_attention import decode_attention_triton

    q, keys, values = _cache(1)
    lengths = _ring_lengths([5, 70, 149, 0, 12])
    want = decode_attention_reference(q, keys, values, lengths, WINDOW, 0.2)
    for row, n in enumerate(lengths.tolist()):  # poison everything a row must not read
        keys[row, :, n:] = float("nan")
        values[row, :, n:] = float("nan")
    keys[5:] = float("nan")  # slots past the batch
    got = decode_attention_triton(q, keys, values, lengths, WINDOW, 0.2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@interpreted
def test_scaled_cache_kernel_equals_the_reference():
    from omnirt.kernels.decode_attention import decode_attention_triton

    q, keys, values = _cache(2)
    kq, ks = quantize_kv(keys)
    vq, vs = quantize_kv(values)
    assert kq.dtype == FP8 and ks.shape == (SLOTS, KV_HEADS, WINDOW + 1) and ks.dtype == torch.float32
    lengths = _ring_lengths([0, 9, 64, 130, 500])
    # fp8 storage and the same values widened to fp32: the scales do the same in both
    for k, v in ((kq, vq), (kq.float(), vq.float())):
        got = decode_attention_triton(q, k, v, lengths, 140, 0.3, ks, vs)
        want = decode_attention_reference(q, k, v, lengths, 140, 0.3, ks, vs)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fp8_cache_error_against_the_unquantized_attention():
    """The stated fp8 tolerance (docs/duplex.md): relative L2 error of the attention output
    below 4% on random keys/values, and the dequantized vectors within e4m3's half ulp."""
    q, keys, values = _cache(3)
    keys[:, :, 7] *= 30.0  # an outlier position: only its own scale moves
    kq, ks = quantize_kv(keys)
    vq, vs = quantize_kv(values)
    back = kq.float() * ks[..., None]
    assert ((back - keys).abs() <= keys.abs().amax(-1, keepdim=True) / 448 * 16 + 1e-6).all()
    lengths = _ring_lengths([20, 60, 100, 149, 400])
    exact = decode_attention_reference(q, keys, values, lengths, WINDOW, 1 / math.sqrt(DIM))
    fp8 = decode_attention_reference(q, kq, vq, lengths, WINDOW, 1 / math.sqrt(DIM), ks, vs)
    error = (fp8 - exact).norm(dim=1) / exact.norm(dim=1)
    assert error.max() < 0.04


def test_plan_splits_few_rows_and_covers_the_window():
    for batch, attend, sms in ((1, 3000, 132), (8, 3000, 132), (128, 3000, 132), (2, 40, 132), (1, 1, 4)):
        splits, chunk = plan(batch, 32, attend, sms)
        assert chunk % BLOCK_N == 0 and splits * chunk >= attend > (splits - 1) * chunk
    assert plan(1, 32, 3000, 132)[0] > 1  # one row: many chunks
    assert plan(128, 32, 3000, 132)[0] == 1  # 4096 programs already


def test_dispatcher_runs_the_reference_off_cuda_and_checks_its_input():
    q, keys, values = _cache(4)
    lengths = _ring_lengths([1, 2, 3, 4, 5])
    assert not kernel_applies(q, keys, values, lengths)
    got = decode_attention(q, keys, values, lengths, 32, 0.5)
    assert torch.equal(got, decode_attention_reference(q, keys, values, lengths, 32, 0.5))
    with pytest.raises(ValueError, match="shapes do not fit"):
        decode_attention(q, keys, values, lengths, WINDOW + 2, 0.5)  # past the cache
    with pytest.raises(ValueError, match="unscaled cache"):
        decode_attention(q, keys.to(FP8), values.to(FP8), lengths, 32, 0.5)
    with pytest.raises(ValueError, match="both scales"):
        decode_attention(q, keys, values, lengths, 32, 0.5, torch.ones(SLOTS, KV_HEADS, WINDOW + 1))
    with pytest.raises(ValueError, match="lengths"):
        decode_attention(q, keys, values, lengths.float(), 32, 0.5)


@interpreted
def test_one_chunk_writes_the_output_itself_with_the_combines_bits():
    """Where one chunk covers the window (a short cache: the code predictor's), the first kernel
    writes the output: the same bits as through the combine, including rows with nothing visible."""
    from omnirt.kernels.decode_attention import decode_attention_triton

    q, keys, values = _cache(4, heads=4)
    lengths = torch.tensor([0, 1, 9, 17, 3])
    attend = 17
    assert plan(5, KV_HEADS, attend, 4)[0] == 1
    direct = decode_attention_triton(q, keys, values, lengths, attend, 0.3)
    combined = decode_attention_triton(q, keys, values, lengths, attend, 0.3, combine=True)
    assert torch.equal(direct, combined)
    assert torch.equal(direct[0], torch.zeros(4 * DIM))
    torch.testing.assert_close(
        direct, decode_attention_reference(q, keys, values, lengths, attend, 0.3), rtol=1e-5, atol=1e-5
    )
