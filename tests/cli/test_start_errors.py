"""``omnirt serve`` refuses broken model folders and bad flags with one line saying why: exit 1
(argument errors: 2), no traceback, and never a server over weights the checkpoint lacked."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from omnirt.realtime.cli import main
from omnirt.stages.diffusion.zimage_demo import ensure_zimage_demo
from omnirt.stages.speech.demo import ensure_demo_checkpoint
from safetensors.torch import load_file, save_file


def _copy(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    (target / "omnirt_demo.json").unlink()
    return target


def _rewrite(file: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def _drop_one(tensors: dict[str, torch.Tensor]) -> None:
    del tensors[sorted(tensors)[3]]


def _grow_one(tensors: dict[str, torch.Tensor]) -> None:
    key = next(k for k in sorted(tensors) if tensors[k].dim() == 2)
    rows, cols = tensors[key].shape
    tensors[key] = torch.zeros(rows + 1, cols)


def _as_int8(tensors: dict[str, torch.Tensor]) -> None:
    for key, value in tensors.items():
        tensors[key] = value.to(torch.int8)


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[:5000])


def _shard(folder: Path, *, lose: bool) -> None:
    """``model.safetensors`` as two shards and their index; ``lose``: the second shard deleted."""
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    keys = sorted(tensors)
    weight_map = {}
    for n, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2 :]), start=1):
        name = f"model-0000{n}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    if lose:
        (folder / "model-00002-of-00002.safetensors").unlink()


SPEECH_BREAKS: dict[str, tuple[Callable[[Path], None], str]] = {
    "truncated": (lambda d: _truncate(d / "model.safetensors"), "is not a readable safetensors file"),
    "missing-tensor": (lambda d: _rewrite(d / "model.safetensors", _drop_one), "model's checkpoint lacks"),
    "wrong-shape": (lambda d: _rewrite(d / "model.safetensors", _grow_one), "its config makes"),
    "wrong-dtype": (lambda d: _rewrite(d / "model.safetensors", _as_int8), "not floating point"),
    "lost-shard": (lambda d: _shard(d, lose=True), "names shards that are not there"),
    "bad-index": (
        lambda d: (_shard(d, lose=False), (d / "model.safetensors.index.json").write_text("{oops")),
        "is not a readable shard index",
    ),
    "bad-tokenizer": (lambda d: (d / "tokenizer.json").write_text("{oops"), "the tokenizer or preprocessor"),
}


def _refused(argv: list[str], caplog: pytest.LogCaptureFixture) -> str:
    """Runs ``omnirt serve argv`` (an exception would fail the test: a traceback for the user);
    asserts exit 1 with one error line, and returns it."""
    with caplog.at_level("ERROR"):
        assert main(["serve", "--device", "cpu", "--duplex-model", "none", *argv]) == 1
    errors = [r for r in caplog.records if r.levelname == "ERROR" and r.name == "omnirt.serve"]
    assert len(errors) == 1 and errors[0].exc_info is None
    return errors[0].getMessage()


@pytest.mark.parametrize("name", list(SPEECH_BREAKS))
def test_a_broken_speech_checkpoint_is_refused_in_one_line(
    name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint cut short, lacking a tensor or a shard, with a tensor of another shape or
    stored as integers, or a broken tokenizer: ``cannot load the model`` naming the file or the
    tensor, where the libraries raised tracebacks or served the lacking weights at random."""
    folder = _copy(ensure_demo_checkpoint(), tmp_path / "speech")
    breaks, expected = SPEECH_BREAKS[name]
    breaks(folder)
    message = _refused(["--model", str(folder)], caplog)
    assert message.startswith("cannot load the model:") and expected in message
    assert "\n" not in message


ZIMAGE_BREAKS: dict[str, tuple[Callable[[Path], None], str]] = {
    "truncated-transformer": (
        lambda d: _truncate(d / "transformer" / "diffusion_pytorch_model.safetensors"),
        "is not a readable safetensors file",
    ),
    "transformer-missing-tensor": (
        lambda d: _rewrite(d / "transformer" / "diffusion_pytorch_model.safetensors", _drop_one),
        "the transformer's checkpoint lacks",
    ),
    "text-encoder-missing-tensor": (
        lambda d: _rewrite(d / "text_encoder" / "model.safetensors", _drop_one),
        "the text encoder's checkpoint lacks",
    ),
    "transformer-as-int8": (
        lambda d: _rewrite(d / "transformer" / "diffusion_pytorch_model.safetensors", _as_int8),
        "not floating point",
    ),
    "no-vae-weights": (
        lambda d: (d / "vae" / "diffusion_pytorch_model.safetensors").unlink(),
        "the VAE does not load",
    ),
    "no-tokenizer": (lambda d: shutil.rmtree(d / "tokenizer"), "tokenizer: no such folder"),
}


@pytest.mark.parametrize("name", list(ZIMAGE_BREAKS))
def test_a_broken_diffusers_folder_is_refused_in_one_line(
    name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = _copy(ensure_zimage_demo(), tmp_path / "z-image")
    breaks, expected = ZIMAGE_BREAKS[name]
    breaks(folder)
    message = _refused(["--model", str(folder)], caplog)
    assert message.startswith("cannot load the model:") and expected in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_refused_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("ERROR"):
        assert main(["serve", "--device", "cuda", "--model", "demo"]) == 1
    assert "--device cuda:" in caplog.text and "use --device cpu" in caplog.text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--host", ""], "not an empty one"),
        (["--host", " "], "not an empty one"),
        (["--min-replicas", "-1"], "argument --min-replicas: must be at least 0"),
        (["--replica-cpus", "inf"], "must be at least 0 and finite"),
        (["--drain-seconds", "nan"], "must be at least 0 and finite"),
    ],
)
def test_bad_listen_and_replica_values_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An empty ``--host`` listened on every interface; ``--min-replicas -1`` was blamed on a
    ``--max-replicas`` never given; an infinite drain never ended."""
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_quantization_without_a_diffusion_model_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``--quantization`` quantizes the image and video transformers only: with a speech
    checkpoint alone it did nothing, silently."""
    folder = _copy(ensure_demo_checkpoint(), tmp_path / "speech")
    message = _refused(["--model", str(folder), "--quantization", "int8"], caplog)
    assert "--quantization int8" in message and "image or video model" in message
