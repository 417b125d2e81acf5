"""The embedded demo checkpoint, the loader's checks and the factory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omnirt.stages.factory import build_pipeline
from omnirt.stages.speech.demo import build_demo_checkpoint
from omnirt.stages.speech.demo_tokenizer import build_tokenizer
from omnirt.stages.speech.loader import CheckpointError, load_speech_pipeline

from .conftest import drain, of, text_request


def test_demo_build_is_deterministic(tmp_path: Path, demo_dir: Path) -> None:
    build_demo_checkpoint(tmp_path / "again")
    names = sorted(p.name for p in demo_dir.iterdir())
    assert names == sorted(p.name for p in (tmp_path / "again").iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json"} <= set(names)
    for name in names:
        assert (demo_dir / name).read_bytes() == (tmp_path / "again" / name).read_bytes(), name
    other = tmp_path / "other-seed"
    build_demo_checkpoint(other, seed=99)
    assert (other / "model.safetensors").read_bytes() != (demo_dir / "model.safetensors").read_bytes()


def test_demo_tokenizer_round_trips_any_text() -> None:
    tok = build_tokenizer()
    for text in ("hello, world", "système 你好 🎙️\n\ttabs", "<|im_start|>user\nhi"):
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    assert len(tok.encode("user").ids) == 1 and len(tok.encode("assistant").ids) == 1


def test_demo_weights_are_all_initialised(demo_dir: Path) -> None:
    from safetensors.torch import load_file

    weights = load_file(str(demo_dir / "model.safetensors"))
    experts = [k for k in weights if ".mlp.experts." in k]
    assert experts and all(0.05 < float(weights[k].std()) < 0.2 for k in experts)
    assert all(bool(weights[k].isfinite().all()) for k in weights)


def test_factory_demo_is_marked_random(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, demo_dir: Path
) -> None:
    monkeypatch.setenv("OMNIRT_CACHE", str(demo_dir.parent))  # reuse the session's build
    pipe = build_pipeline("demo", device="cpu", max_slots=2)
    assert pipe.info.random_weights and pipe.info.id == "demo-qwen3-omni"
    assert pipe.info.source == str(demo_dir)
    assert set(pipe.info.voices) == {"ethan", "chelsie"}
    pipe.add(text_request("r", max_output_tokens=3))
    assert of(drain(pipe), "r")[-1].reason == "length"


def test_factory_loads_a_path_not_marked_random(demo_dir: Path, tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in demo_dir.iterdir():
        if f.name != "omnirt_demo.json":
            (plain / f.name).write_bytes(f.read_bytes())
    pipe = build_pipeline(str(plain), device="cpu", max_slots=1)
    assert not pipe.info.random_weights and pipe.info.architecture == "Qwen3OmniMoeForConditionalGeneration"


def test_bad_model_paths_are_clear_errors(tmp_path: Path, demo_dir: Path) -> None:
    with pytest.raises(ValueError, match="no such file"):
        build_pipeline(str(tmp_path / "missing"), device="cpu")
    with pytest.raises(CheckpointError, match="no config.json"):
        load_speech_pipeline(tmp_path)
    bad = tmp_path / "llama"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="'llama' model"):
        load_speech_pipeline(bad)
    (bad / "config.json").write_text((demo_dir / "config.json").read_text())
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_speech_pipeline(bad)


def test_a_checkpoint_without_talker_serves_text_only(demo_dir: Path, tmp_path: Path) -> None:
    from omnirt.stages.pipeline import RequestRejected

    folder = tmp_path / "thinker-only"
    folder.mkdir()
    for f in demo_dir.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config["enable_audio_output"] = False
    (folder / "config.json").write_text(json.dumps(config))
    pipe = load_speech_pipeline(folder, max_slots=1)
    assert pipe.info.voices == ()
    with pytest.raises(RequestRejected, match="no talker"):
        pipe.add(text_request("a", output_audio=True))
    pipe.add(text_request("t", max_output_tokens=3))
    assert of(drain(pipe), "t")[-1].usage.output_text_tokens == 3


def test_chat_template_from_the_processor_file(demo_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "processor-template"
    folder.mkdir()
    for f in demo_dir.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    template = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").unlink()
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    tok_cfg.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    with pytest.raises(CheckpointError, match="no chat template"):
        load_speech_pipeline(folder)
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    pipe = load_speech_pipeline(folder, max_slots=1)
    pipe.add(text_request("t", max_output_tokens=2))
    assert of(drain(pipe), "t")[-1].reason == "length"


def test_the_loader_prewarms_on_the_default_workers_unless_told(demo_dir, monkeypatch):
    """Without ``compile_workers`` the start-up prewarms on ``default_compile_workers()`` threads,
    as the server starts (off CUDA the capture does nothing of it)."""
    from omnirt.stages.speech import loader
    from omnirt.stages.speech.pipeline import SpeechPipeline

    asked = []
    monkeypatch.setattr(loader, "default_compile_workers", lambda: 7)
    def capture(self: SpeechPipeline, compile_workers: int = 0) -> float:
        asked.append(compile_workers)
        return 0.0

    monkeypatch.setattr(SpeechPipeline, "capture", capture)
    loader.load_speech_pipeline(demo_dir, max_slots=1, max_context=64)
    loader.load_speech_pipeline(demo_dir, max_slots=1, max_context=64, compile_workers=0)
    assert asked == [7, 0]
