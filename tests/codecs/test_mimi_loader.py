"""Checkpoint loading: published layout, shards, nested in-memory keys, config checks."""

from __future__ import annotations

import json

import pytest
import torch
from omnirt.codecs.mimi import MimiCodecConfig, MimiSlotPool, build_mimi, load_mimi
from omnirt.codecs.mimi.reference import TINY_MIMI, random_reference_model
from safetensors.torch import load_file, save_file

FRAME = 1920


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("mimi")
    model = random_reference_model(seed=4, **TINY_MIMI)
    model.save_pretrained(str(path))
    return model, path


def _codes_and_audio(pool: MimiSlotPool):
    audio = 0.1 * torch.randn(1, 3 * FRAME, generator=torch.Generator().manual_seed(5))
    codes = pool.encode(audio)
    return codes, pool.decode(codes)


def test_checkpoint_uses_the_published_flat_layout(saved):
    _, path = saved
    keys = set(load_file(path / "model.safetensors"))
    assert "encoder.layers.0.conv.weight" in keys
    assert "decoder_transformer.layers.0.self_attn.q_proj.weight" in keys
    assert "quantizer.semantic_residual_vector_quantizer.layers.0.codebook.embed_sum" in keys


def test_flat_sharded_and_nested_layouts_load_the_same_weights(saved, tmp_path):
    model, path = saved
    model.save_pretrained(str(tmp_path), max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    config = MimiCodecConfig.from_json(path / "config.json")
    nested = {
        "encoder.encoder_seanet." + k[len("encoder.") :] if k.startswith("encoder.layers.") else k: v
        for k, v in load_file(path / "model.safetensors").items()
    }
    nested = {
        ("decoder.decoder_transformer." + k[len("decoder_transformer.") :])
        if k.startswith("decoder_transformer.")
        else k: v
        for k, v in nested.items()
    }
    results = [
        _codes_and_audio(MimiSlotPool(load_mimi(path), 1)),
        _codes_and_audio(MimiSlotPool(load_mimi(tmp_path), 1)),
        _codes_and_audio(MimiSlotPool(build_mimi(config, nested), 1)),
        _codes_and_audio(MimiSlotPool(build_mimi(config, model.state_dict()), 1)),
    ]
    for codes, audio in results[1:]:
        assert torch.equal(codes, results[0][0])
        assert torch.equal(audio, results[0][1])


def _tensors(path):
    return dict(load_file(path / "model.safetensors"))


def test_missing_unexpected_and_misshapen_weights_are_refused(saved, tmp_path):
    _, path = saved
    config = MimiCodecConfig.from_json(path / "config.json")
    tensors = _tensors(path)
    missing = {k: v for k, v in tensors.items() if k != "decoder.layers.0.conv.bias"}
    with pytest.raises(ValueError, match="missing.*decoder.layers.0.conv.bias"):
        build_mimi(config, missing)
    with pytest.raises(ValueError, match="unexpected.*extra.weight"):
        build_mimi(config, {**tensors, "extra.weight": torch.zeros(1)})
    bad = {**tensors, "upsample.conv.weight": torch.zeros(3, 3, 3)}
    with pytest.raises(ValueError, match="upsample.conv.weight"):
        build_mimi(config, bad)
    no_book = {
        k: v for k, v in tensors.items() if "acoustic_residual_vector_quantizer.layers.2.codebook" not in k
    }
    with pytest.raises(ValueError, match=r"codebooks \[3\]"):
        build_mimi(config, no_book)
    # fewer quantizers need fewer codebooks
    assert build_mimi(config, no_book, num_quantizers=3).num_quantizers == 3
    save_file(missing, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ValueError, match="missing"):
        load_mimi(tmp_path)


def test_config_reads_old_and_new_layouts_and_refuses_what_cannot_stream(saved):
    _, path = saved
    data = json.loads((path / "config.json").read_text())
    config = MimiCodecConfig.from_dict(data)
    assert (config.frame_size, config.latent_stride, config.sliding_window) == (1920, 2, 4)
    old = {k: v for k, v in data.items() if k != "rope_parameters"} | {
        "rope_theta": 500.0,
        "frame_rate": 12.5,
    }
    assert MimiCodecConfig.from_dict(old).rope_theta == 500.0
    assert MimiCodecConfig.from_dict(old).frame_size == 1920
    for change, message in [
        ({"use_causal_conv": False}, "causal"),
        ({"trim_right_ratio": 0.5}, "trim_right_ratio"),
        ({"pad_mode": "reflect"}, "pad_mode"),
        ({"audio_channels": 2}, "mono"),
        ({"model_type": "encodec"}, "model_type"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, "rope_type"),
    ]:
        with pytest.raises(ValueError, match=message):
            MimiCodecConfig.from_dict({**data, **change})
    with pytest.raises(ValueError, match="num_quantizers"):
        build_mimi(config, _tensors(path), num_quantizers=9)
