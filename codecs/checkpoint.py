"""Reads tensors from a checkpoint's safetensors files (one reader for every codec loader).

A checkpoint is one ``.safetensors`` file or a folder: with ``model.safetensors.index.json``
its shards are the files the index lists, otherwise every ``*.safetensors`` file in it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


def safetensors_files(path: str | Path, prefix: str = "") -> list[Path]:
    """The files to read for the tensors named ``prefix*``: ``path`` itself when it is a file;
    else the shards the folder's index lists for such tensors; else the folder's
    ``*.safetensors`` files. Sorted; empty when there are none."""
    path = Path(path)
    if path.is_file():
        return [path]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted({file for key, file in weight_map.items() if key.startswith(prefix)})
        return [path / name for name in names]
    return sorted(path.glob("*.safetensors"))


def read_safetensors(path: str | Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor named ``prefix*`` in :func:`safetensors_files`, on the CPU, named without
    the prefix; the other tensors are not read. Empty when there is no file."""
    tensors: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path, prefix):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for key in handle.keys():
                if key.startswith(prefix):
                    tensors[key[len(prefix) :]] = handle.get_tensor(key)
    return tensors
