"""The safetensors reader shared by the Mimi and code2wav loaders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omnirt.codecs.checkpoint import read_safetensors, safetensors_files
from omnirt.codecs.mimi import load_mimi
from omnirt.codecs.mimi.reference import TINY_MIMI, save_reference_model
from safetensors.torch import save_file


def test_one_file_a_folder_and_a_prefix(tmp_path: Path) -> None:
    save_file({"a.x": torch.ones(2), "b.y": torch.zeros(3)}, str(tmp_path / "one.safetensors"))
    save_file({"a.z": torch.full((1,), 2.0)}, str(tmp_path / "two.safetensors"))
    single = read_safetensors(tmp_path / "one.safetensors")
    assert sorted(single) == ["a.x", "b.y"]
    assert sorted(read_safetensors(tmp_path)) == ["a.x", "a.z", "b.y"]
    stripped = read_safetensors(tmp_path, "a.")
    assert sorted(stripped) == ["x", "z"] and torch.equal(stripped["z"], torch.full((1,), 2.0))
    assert read_safetensors(tmp_path / "missing") == {}


def test_an_index_names_the_shards_and_only_those_with_the_prefix_are_opened(tmp_path: Path) -> None:
    save_file({"code2wav.w": torch.ones(2)}, str(tmp_path / "model-1.safetensors"))
    (tmp_path / "stray.safetensors").write_bytes(b"not a safetensors file")
    weight_map = {"code2wav.w": "model-1.safetensors", "thinker.w": "model-2-absent.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert safetensors_files(tmp_path, "code2wav.") == [tmp_path / "model-1.safetensors"]
    assert list(read_safetensors(tmp_path, "code2wav.")) == ["w"]
    every = [tmp_path / "model-1.safetensors", tmp_path / "model-2-absent.safetensors"]
    assert safetensors_files(tmp_path) == every  # the index, not a glob of the folder


def test_mimi_folder_without_safetensors_is_refused(tmp_path: Path) -> None:
    save_reference_model(tmp_path, seed=0, **TINY_MIMI)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no \.safetensors file"):
        load_mimi(tmp_path)
