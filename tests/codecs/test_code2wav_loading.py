"""Loading code2wav weights: from a transformers module, and from checkpoint folders written here."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from omnirt.codecs.code2wav import Code2WavModel, Code2WavStreamer, load_code2wav
from omnirt.codecs.code2wav.random_init import randomize_, tiny_code2wav_config
from safetensors.torch import save_file
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav


@pytest.fixture(scope="module")
def hf() -> Qwen3OmniMoeCode2Wav:
    return randomize_(Qwen3OmniMoeCode2Wav(tiny_code2wav_config(sliding_window=3)).eval(), 11)


def _write_omni_checkpoint(folder: Path, hf: Qwen3OmniMoeCode2Wav) -> None:
    """The published layout: the whole model's config, code2wav tensors prefixed and spread
    over two shards next to other sub-models' tensors, with a shard index."""
    config = Qwen3OmniMoeConfig(code2wav_config=hf.config.to_dict())
    (folder / "config.json").write_text(config.to_json_string())
    tensors = {f"code2wav.{k}": v.to(torch.bfloat16).contiguous() for k, v in hf.state_dict().items()}
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": {"thinker.lm_head.weight": torch.ones(4, 4)}
        | {k: tensors[k] for k in names[: len(names) // 2]},
        "model-00002-of-00002.safetensors": {"talker.codec_head.weight": torch.ones(2, 4)}
        | {k: tensors[k] for k in names[len(names) // 2 :]},
    }
    weight_map = {}
    for file, content in shards.items():
        save_file(content, str(folder / file))
        weight_map |= dict.fromkeys(content, file)
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _stream(streamer: Code2WavStreamer, codes: torch.Tensor) -> np.ndarray:
    slot = streamer.acquire()
    return np.concatenate([streamer.step({slot: codes[:, f]})[slot] for f in range(codes.shape[1])])


def test_from_hf_shares_the_weights(hf: Qwen3OmniMoeCode2Wav) -> None:
    model = Code2WavModel.from_hf(hf)
    theirs = hf.state_dict()
    ours = model.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(ours[k].data_ptr() == theirs[k].data_ptr() for k in ours)


def test_published_checkpoint_folder(tmp_path: Path, hf: Qwen3OmniMoeCode2Wav) -> None:
    _write_omni_checkpoint(tmp_path, hf)
    model = load_code2wav(tmp_path)
    assert model.config.sliding_window == 3 and model.config.hidden_size == hf.config.hidden_size
    theirs = hf.state_dict()
    for name, tensor in model.state_dict().items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, theirs[name].to(torch.bfloat16).float()), name

    # The loaded model streams what transformers decodes offline with the same (bf16-rounded) weights.
    reference = Qwen3OmniMoeCode2Wav(hf.config).eval()
    reference.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in theirs.items()})
    codes = torch.randint(0, hf.config.codebook_size, (hf.config.num_quantizers, 6),
                          generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(codes[None])[0, 0].numpy()
    streamed = _stream(Code2WavStreamer(model, max_slots=1), codes)
    assert streamed.shape == expected.shape
    np.testing.assert_allclose(streamed, expected, rtol=1e-5, atol=1e-5)


def test_code2wav_only_folder(tmp_path: Path, hf: Qwen3OmniMoeCode2Wav) -> None:
    (tmp_path / "config.json").write_text(hf.config.to_json_string())
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(tmp_path / "model.safetensors"))
    model = load_code2wav(tmp_path, dtype=torch.float32)
    theirs = hf.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in model.state_dict().items())


def test_missing_tensor_is_a_clear_error(tmp_path: Path, hf: Qwen3OmniMoeCode2Wav) -> None:
    (tmp_path / "config.json").write_text(hf.config.to_json_string())
    tensors = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "decoder.0.conv.weight"}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['decoder.0.conv.weight'\]"):
        load_code2wav(tmp_path)


def test_misshapen_tensor_is_a_clear_error(tmp_path: Path, hf: Qwen3OmniMoeCode2Wav) -> None:
    config = hf.config.to_dict() | {"hidden_size": 2 * hf.config.hidden_size}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="misshapen"):
        load_code2wav(tmp_path)


def test_folder_without_config_or_code2wav(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no config.json"):
        load_code2wav(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="neither"):
        load_code2wav(tmp_path)


def test_from_a_whole_model_state_dict(hf: Qwen3OmniMoeCode2Wav) -> None:
    whole = {f"code2wav.{k}": v for k, v in hf.state_dict().items()}
    whole["thinker.lm_head.weight"] = torch.ones(2, 2)
    model = Code2WavModel.from_state_dict(hf.config, whole, prefix="code2wav.", dtype=torch.bfloat16)
    assert model.state_dict().keys() == hf.state_dict().keys()
    assert model.code_embedding.weight.dtype == torch.bfloat16
    assert model.pre_transformer.inv_freq.dtype == torch.float32

    with pytest.raises(ValueError, match=r"unexpected \['foo'\]"):
        Code2WavModel.from_state_dict(hf.config, whole | {"code2wav.foo": torch.ones(1)}, prefix="code2wav.")
