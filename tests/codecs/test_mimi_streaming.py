"""Streaming Mimi vs transformers' MimiModel on the same (tiny, random) weights.

The tiny config has sliding_window=4 tokens (2 frames), and every stream here runs 7 frames
(14 tokens), so the KV ring wraps and the window is exercised.
"""

from __future__ import annotations

import pytest
import torch
from omnirt.codecs.mimi import MimiSlotPool, load_mimi
from omnirt.codecs.mimi.reference import TINY_MIMI, save_reference_model

FRAME = 1920
FRAMES = 7


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("mimi")
    model = save_reference_model(path, seed=0, **{**TINY_MIMI, "num_hidden_layers": 2})
    return model, path


@pytest.fixture(scope="module")
def audio():
    generator = torch.Generator().manual_seed(1)
    return 0.1 * torch.randn(2, FRAMES * FRAME, generator=generator)


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_codebooks_are_random_so_codes_vary(reference, audio):
    model, _ = reference
    with torch.no_grad():
        codes = model.encode(audio[:, None], num_quantizers=8).audio_codes
    assert codes.unique().numel() > 10


def test_frame_by_frame_encode_equals_transformers_full_encode(reference, audio):
    model, path = reference
    pool = MimiSlotPool(load_mimi(path), max_slots=2)
    with torch.no_grad():
        expected = model.encode(audio[:, None], num_quantizers=8).audio_codes
    got = torch.cat([pool.encode(audio[:, i * FRAME : (i + 1) * FRAME]) for i in range(FRAMES)], dim=-1)
    assert got.dtype == torch.int64
    assert torch.equal(got, expected)


def test_frame_by_frame_decode_equals_transformers_full_decode(reference, audio):
    model, path = reference
    pool = MimiSlotPool(load_mimi(path), max_slots=2)
    with torch.no_grad():
        codes = model.encode(audio[:, None], num_quantizers=8).audio_codes
        expected = model.decode(codes).audio_values[:, 0]
    got = torch.cat([pool.decode(codes[:, :, i : i + 1]) for i in range(FRAMES)], dim=-1)
    assert got.shape == expected.shape == (2, FRAMES * FRAME)
    assert _relative_error(got, expected) < 2e-6


def test_transformers_decoder_alone_does_not_stream(reference, audio):
    """The gap this codec fills: frame-by-frame transformers decode diverges from a full decode."""
    model, _ = reference
    with torch.no_grad():
        codes = model.encode(audio[:, None], num_quantizers=8).audio_codes
        full = model.decode(codes).audio_values[:, 0]
        frames = torch.cat(
            [model.decode(codes[:, :, i : i + 1]).audio_values[:, 0] for i in range(FRAMES)], -1
        )
    assert _relative_error(frames, full) > 1e-3


def test_frame_by_frame_equals_whole_sequence_in_one_call(reference, audio):
    _, path = reference
    whole, stepped = MimiSlotPool(load_mimi(path), 2), MimiSlotPool(load_mimi(path), 2)
    codes_whole = whole.encode(audio)
    codes_stepped = torch.cat(
        [stepped.encode(audio[:, i * FRAME : (i + 1) * FRAME]) for i in range(FRAMES)], -1
    )
    assert torch.equal(codes_whole, codes_stepped)
    wav_whole = whole.decode(codes_whole)
    wav_stepped = torch.cat([stepped.decode(codes_whole[:, :, i : i + 1]) for i in range(FRAMES)], -1)
    assert _relative_error(wav_stepped, wav_whole) < 2e-6


def test_uneven_chunks_of_frames(reference, audio):
    _, path = reference
    pool, stepped = MimiSlotPool(load_mimi(path), 2), MimiSlotPool(load_mimi(path), 2)
    bounds = [0, 3, 4, 7]
    chunks = [pool.encode(audio[:, a * FRAME : b * FRAME]) for a, b in zip(bounds, bounds[1:], strict=False)]
    expected = torch.cat([stepped.encode(audio[:, i * FRAME : (i + 1) * FRAME]) for i in range(FRAMES)], -1)
    assert [c.shape[-1] for c in chunks] == [3, 1, 3]
    assert torch.equal(torch.cat(chunks, -1), expected)


def test_fewer_quantizers_match_transformers(reference, audio):
    model, path = reference
    pool = MimiSlotPool(load_mimi(path, num_quantizers=4), 2)
    with torch.no_grad():
        expected = model.encode(audio[:, None], num_quantizers=4).audio_codes
        wav = model.decode(expected).audio_values[:, 0]
    got = torch.cat([pool.encode(audio[:, i * FRAME : (i + 1) * FRAME]) for i in range(FRAMES)], -1)
    assert got.shape[1] == 4 and torch.equal(got, expected)
    decoded = torch.cat([pool.decode(expected[:, :, i : i + 1]) for i in range(FRAMES)], -1)
    assert _relative_error(decoded, wav) < 2e-6


def test_reset_restarts_a_stream(reference, audio):
    _, path = reference
    pool = MimiSlotPool(load_mimi(path), 2)
    first = torch.cat([pool.encode(audio[:, i * FRAME : (i + 1) * FRAME]) for i in range(3)], -1)
    pool.reset(0)
    pool.reset(1)
    again = torch.cat([pool.encode(audio[:, i * FRAME : (i + 1) * FRAME]) for i in range(3)], -1)
    assert torch.equal(first, again)
    wav = pool.decode(first)
    encoder_side = {
        name: buffer.clone()
        for name, buffer in pool.model.state_buffers().items()
        if name.startswith(("encoder", "downsample"))
    }
    assert any(name.startswith("encoder_transformer.") for name in encoder_side)
    assert any(name.startswith("downsample.") for name in encoder_side)
    assert any(buffer.any() for buffer in encoder_side.values())  # not all at reset values
    pool.reset(0, encoder=False)
    pool.reset(1, encoder=False)
    after = pool.model.state_buffers()
    assert all(torch.equal(after[name], buffer) for name, buffer in encoder_side.items())
    assert torch.equal(pool.decode(first), wav)


def test_grouped_kv_heads_match_transformers(tmp_path, audio):
    """One KV head shared by both query heads, against transformers as above."""
    config = {**TINY_MIMI, "num_hidden_layers": 2, "num_key_value_heads": 1}
    model = save_reference_model(tmp_path, seed=5, **config)
    pool = MimiSlotPool(load_mimi(tmp_path), max_slots=2)
    for attention in (pool.model.encoder_transformer, pool.model.decoder_transformer):
        assert [layer.self_attn.num_kv_heads for layer in attention.layers] == [1, 1]
    with torch.no_grad():
        expected = model.encode(audio[:, None], num_quantizers=8).audio_codes
        wav = model.decode(expected).audio_values[:, 0]
    got = torch.cat([pool.encode(audio[:, i * FRAME : (i + 1) * FRAME]) for i in range(FRAMES)], dim=-1)
    assert torch.equal(got, expected)
    decoded = torch.cat([pool.decode(expected[:, :, i : i + 1]) for i in range(FRAMES)], -1)
    assert _relative_error(decoded, wav) < 2e-6
