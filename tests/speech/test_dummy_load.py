"""``load_format="dummy"``: the model from config.json alone, with seeded random weights."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from omnirt.stages.factory import build_pipeline
from omnirt.stages.speech.demo import demo_config_dict
from omnirt.stages.speech.demo_tokenizer import (
    CHAT_TEMPLATE,
    PUBLISHED_TOOL_TOKEN_IDS,
    ROLE_WORDS,
    SPECIAL_TOKENS,
    build_tokenizer,
    save_tokenizer,
)
from omnirt.stages.speech.dummy import (
    TokenLayoutError,
    build_random_model,
    config_token_ids,
    config_tokenizer,
)
from omnirt.stages.speech.loader import CheckpointError, LoadFormatError, load_speech_pipeline
from omnirt.stages.speech.tool_calls import ToolTags
from omnirt.stages.types import AudioDelta, Finished, TextDelta, ToolSpec
from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

from .conftest import audio_request, drain, of, text_request

#: The published Qwen3-Omni-30B-A3B-Instruct config.json, kept in the repository.
PUBLISHED = Path(__file__).resolve().parents[2] / "benchmarks/models/qwen3-omni-30b-a3b-instruct/config.json"


@pytest.fixture(scope="module")
def demo_raw(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The embedded default's config.json (ids from its tokenizer)."""
    return demo_config_dict(save_tokenizer(tmp_path_factory.mktemp("demo-tokenizer")))


def _shrink_moe(text: dict[str, Any], layers: int) -> None:
    text.update(
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
    )
    text["rope_parameters"] = dict(text["rope_parameters"], mrope_section=[2, 3, 3])
    if text.get("shared_expert_intermediate_size"):
        text["shared_expert_intermediate_size"] = 32


def published_tiny(thinker_layers: int = 2, talker_layers: int = 2) -> dict[str, Any]:
    """The published Qwen3-Omni config with tiny widths: every token id, codec id, speaker and
    vocabulary size as published (152064 text tokens)."""
    raw = json.loads(PUBLISHED.read_text())
    thinker, talker = raw["thinker_config"], raw["talker_config"]
    _shrink_moe(thinker["text_config"], thinker_layers)
    thinker["audio_config"].update(
        d_model=32,
        encoder_attention_heads=2,
        encoder_ffn_dim=64,
        encoder_layers=1,
        downsample_hidden_size=16,
        output_dim=64,
    )
    thinker["vision_config"].update(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        deepstack_visual_indexes=[0],
        num_position_embeddings=64,
    )
    _shrink_moe(talker["text_config"], talker_layers)
    talker.update(
        thinker_hidden_size=64, accept_hidden_layer=min(talker["accept_hidden_layer"], thinker_layers)
    )
    talker["code_predictor_config"].update(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    talker["code_predictor_config"]["head_dim"] = 16
    raw["code2wav_config"].update(
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        num_hidden_layers=1,
        decoder_dim=32,
        codebook_dim=16,
        vector_quantization_hidden_dimension=16,
    )
    return raw


def config_folder(directory: Path, raw: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(raw))
    return directory


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def test_a_config_only_folder_serves_an_audio_turn(tmp_path: Path, demo_raw: dict[str, Any]) -> None:
    folder = config_folder(tmp_path / "tiny-omni", demo_raw)
    pipeline = load_speech_pipeline(folder, load_format="dummy", max_slots=2, max_audio_frames=20)
    info = pipeline.info
    assert info.random_weights and info.id == "tiny-omni" and info.source == str(folder)
    assert info.voices == ("chelsie", "ethan")
    # No tokenizer in the folder: the embedded default's, which already has the demo config's ids.
    assert pipeline.tokenizer.get_vocab() == build_tokenizer().get_vocab(with_added_tokens=True)
    pipeline.add(audio_request("a", max_output_tokens=4))
    outs = of(drain(pipeline), "a")
    assert sum(o.tokens for o in outs if isinstance(o, TextDelta)) == 4
    audio = [o for o in outs if isinstance(o, AudioDelta)]
    assert audio and sum(o.pcm.size for o in audio) > 0 and any(np.any(o.pcm != 0) for o in audio)
    assert isinstance(outs[-1], Finished) and outs[-1].reason == "length"


def test_the_published_ids_get_a_tokenizer_laid_out_at_them(tmp_path: Path) -> None:
    raw = published_tiny()
    folder = config_folder(tmp_path / "omni-published-tiny", raw)
    pipeline = load_speech_pipeline(folder, load_format="dummy", max_slots=2, max_audio_frames=12)
    tok = pipeline.tokenizer
    assert len(tok) == raw["thinker_config"]["text_config"]["vocab_size"] == 152064
    expected = {
        "<|im_start|>": raw["im_start_token_id"],
        "<|im_end|>": raw["im_end_token_id"],
        "user": raw["user_token_id"],
        "assistant": raw["assistant_token_id"],
        "system": raw["system_token_id"],
        "<tts_pad>": raw["tts_pad_token_id"],
        "<tts_text_bos>": raw["tts_bos_token_id"],
        "<tts_text_eod>": raw["tts_eos_token_id"],
        "<|audio_pad|>": raw["thinker_config"]["audio_token_id"],
        "<|audio_start|>": raw["thinker_config"]["audio_start_token_id"],
        "<|audio_end|>": raw["thinker_config"]["audio_end_token_id"],
        "<|image_pad|>": raw["thinker_config"]["image_token_id"],
        "<|vision_start|>": raw["thinker_config"]["vision_start_token_id"],
    }
    assert {t: tok.convert_tokens_to_ids(t) for t in expected} == expected
    assert expected["<|im_start|>"] == 151644 and expected["user"] == 872
    # The tool tags at the published vocabulary's ids, and the prompt renders tools with them.
    assert {t: tok.convert_tokens_to_ids(t) for t in PUBLISHED_TOOL_TOKEN_IDS} == PUBLISHED_TOOL_TOKEN_IDS
    assert ToolTags.of(tok) == ToolTags(151657, 151658)
    tools = [ToolSpec("f", "", {"type": "object"})]
    with_tools = pipeline.prompts.build(text_request("t").messages, tools).input_ids[0].tolist()
    assert 151657 in with_tools and 151658 in with_tools
    prompt = pipeline.prompts.build(audio_request("p").messages)
    ids = prompt.input_ids[0].tolist()
    assert ids[:2] == [151644, 872] and ids[-3:] == [151644, 77091, tok.convert_tokens_to_ids("\u010a")]
    assert prompt.audio_tokens > 0 and ids.count(151675) == prompt.audio_tokens
    assert tok.decode([1000, 150000]).startswith(" ")  # filler ids decode to pseudo-words
    assert raw["im_end_token_id"] in pipeline.stop_token_ids
    pipeline.add(audio_request("a", max_output_tokens=3, voice="aiden"))
    outs = of(drain(pipeline), "a")
    assert any(isinstance(o, TextDelta) for o in outs) and any(isinstance(o, AudioDelta) for o in outs)
    assert isinstance(outs[-1], Finished) and outs[-1].reason in ("stop", "length")


def test_same_seed_same_weights_and_the_global_rng_untouched(demo_raw: dict[str, Any]) -> None:
    config = Qwen3OmniMoeConfig(**demo_raw)
    cpu = torch.device("cpu")
    before = torch.get_rng_state()
    a = _state(build_random_model(config, device=cpu, dtype=torch.float32, seed=7))
    b = _state(build_random_model(config, device=cpu, dtype=torch.float32, seed=7))
    c = _state(build_random_model(config, device=cpu, dtype=torch.float32, seed=8))
    assert torch.equal(torch.get_rng_state(), before)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    differ = [k for k in a if a[k].is_floating_point() and not torch.equal(a[k], c[k])]
    assert any(".mlp.experts." in k for k in differ) and any("embed_tokens" in k for k in differ)
    # The talker's experts (torch.empty) and routers (zeros) get drawn like the thinker's.
    std = config.talker_config.text_config.initializer_range
    for name in ("talker.model.layers.0.mlp.experts.gate_up_proj", "talker.model.layers.0.mlp.gate.weight"):
        assert abs(float(a[name].detach().std()) - std) < 0.3 * std, name
    assert all(torch.isfinite(t).all() for t in a.values() if t.is_floating_point())


def test_buffers_equal_those_of_a_normally_built_model(demo_raw: dict[str, Any]) -> None:
    """Rotary ``inv_freq``, sinusoid tables and code offsets are computed, not left uninitialised."""
    built = dict(
        build_random_model(
            Qwen3OmniMoeConfig(**demo_raw), device=torch.device("cpu"), dtype=torch.float32
        ).named_buffers()
    )
    reference = dict(Qwen3OmniMoeForConditionalGeneration(Qwen3OmniMoeConfig(**demo_raw)).named_buffers())
    assert built.keys() == reference.keys() and len(built) >= 5
    for name, buf in reference.items():
        assert built[name].dtype == buf.dtype and torch.equal(built[name], buf), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_published_depth_stays_finite(dtype: torch.dtype) -> None:
    """48 thinker and 20 talker layers (tiny widths) with the published init: every hidden state
    and the logits stay finite and of moderate size."""
    config = Qwen3OmniMoeConfig(**published_tiny(thinker_layers=48, talker_layers=20))
    model = build_random_model(config, device=torch.device("cpu"), dtype=dtype, seed=3)
    ids = torch.randint(0, 151643, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        thinker = model.thinker(input_ids=ids, output_hidden_states=True)
        talker = model.talker.model(
            inputs_embeds=torch.randn(1, 12, 64, generator=torch.Generator().manual_seed(1)).to(dtype),
            output_hidden_states=True,
        )
    assert len(thinker.hidden_states) == 49 and len(talker.hidden_states) == 21
    for h in (*thinker.hidden_states, *talker.hidden_states, thinker.logits):
        assert torch.isfinite(h).all()
        assert float(h.float().abs().max()) < 100.0
    assert float(thinker.logits.float().std()) > 0.01  # not collapsed either


def test_the_published_config_has_its_parameter_count_on_meta() -> None:
    config = Qwen3OmniMoeConfig(**json.loads(PUBLISHED.read_text()))
    model = build_random_model(config, device=torch.device("meta"), dtype=torch.bfloat16)
    counts = {name: sum(p.numel() for p in part.parameters()) for name, part in model.named_children()}
    assert sum(counts.values()) == pytest.approx(35.26e9, rel=2e-3)
    assert counts["thinker"] == pytest.approx(31.72e9, rel=2e-3)
    assert counts["talker"] == pytest.approx(3.32e9, rel=2e-3)
    assert counts["code2wav"] == pytest.approx(0.216e9, rel=2e-3)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_a_config_file_path_works_for_dummy_only(tmp_path: Path, demo_raw: dict[str, Any]) -> None:
    config_file = tmp_path / "tiny-omni.config.json"
    config_file.write_text(json.dumps(demo_raw))
    pipeline = load_speech_pipeline(config_file, load_format="dummy", max_slots=1)
    assert pipeline.info.id == "tiny-omni" and pipeline.info.random_weights
    with pytest.raises(CheckpointError, match="is not a folder"):
        load_speech_pipeline(config_file)


def test_a_folder_tokenizer_is_used_when_present(tmp_path: Path, demo_raw: dict[str, Any]) -> None:
    folder = config_folder(tmp_path / "with-tokenizer", demo_raw)
    save_tokenizer(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["model_max_length"] = 1234  # marks the folder's tokenizer
    config.pop("chat_template", None)  # and no template: the embedded default's is used
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    pipeline = load_speech_pipeline(folder, load_format="dummy", max_slots=1)
    assert pipeline.tokenizer.model_max_length == 1234
    assert pipeline.tokenizer.chat_template == CHAT_TEMPLATE
    assert pipeline.prompts.build(audio_request("x").messages).audio_tokens > 0


def test_factory_passes_the_load_format(tmp_path: Path, demo_raw: dict[str, Any]) -> None:
    folder = config_folder(tmp_path / "factory", demo_raw)
    pipeline = build_pipeline(str(folder), device="cpu", max_slots=1, load_format="dummy")
    assert pipeline.info.random_weights
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        build_pipeline(str(folder), device="cpu", max_slots=1)


@pytest.mark.parametrize(
    ("setup", "error", "message"),
    [
        (lambda d, raw: None, CheckpointError, "does not exist"),
        (lambda d, raw: d.mkdir(), CheckpointError, "has no config.json"),
        (lambda d, raw: config_folder(d, {**raw, "model_type": "llama"}), CheckpointError, "'llama' model"),
        (lambda d, raw: config_folder(d, {"thinker_config": {}}), CheckpointError, "None model"),
        (
            lambda d, raw: (d.mkdir(), (d / "config.json").write_text("{not json")),
            CheckpointError,
            "not valid JSON",
        ),
        (
            lambda d, raw: config_folder(d, {**raw, "im_start_token_id": 10**6}),
            TokenLayoutError,
            "im_start_token_id = 1000000 is outside",
        ),
        (
            lambda d, raw: config_folder(d, {**raw, "im_end_token_id": raw["im_start_token_id"]}),
            TokenLayoutError,
            "is also the id of '<|im_start|>'",
        ),
    ],
)
def test_bad_configs_are_clear_errors(
    tmp_path: Path, demo_raw: dict[str, Any], setup: Any, error: type[ValueError], message: str
) -> None:
    folder = tmp_path / "bad"
    setup(folder, copy.deepcopy(demo_raw))
    with pytest.raises(error, match=re.escape(message)):
        load_speech_pipeline(folder, load_format="dummy")
    assert issubclass(error, ValueError)


def test_an_unknown_load_format_is_refused(tmp_path: Path, demo_raw: dict[str, Any]) -> None:
    folder = config_folder(tmp_path / "fmt", demo_raw)
    with pytest.raises(LoadFormatError, match="unknown load format 'pt'; expected one of: auto, dummy"):
        load_speech_pipeline(folder, load_format="pt")


def test_thinker_and_talker_must_agree_on_token_ids(demo_raw: dict[str, Any]) -> None:
    raw = copy.deepcopy(demo_raw)
    raw["talker_config"]["audio_token_id"] = raw["thinker_config"]["audio_token_id"] + 1
    with pytest.raises(TokenLayoutError, match="talker_config.audio_token_id"):
        config_token_ids(Qwen3OmniMoeConfig(**raw), raw)


def test_a_vocabulary_too_small_for_the_tokenizer_is_refused() -> None:
    ids = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *ROLE_WORDS))}
    ids["<vocab_size>"] = 100  # room for the named ids, not for the 256 byte tokens
    raw = demo_config_dict(ids)
    with pytest.raises(TokenLayoutError, match="vocab_size 100 is too small"):
        config_tokenizer(Qwen3OmniMoeConfig(**raw), raw)


# -- on CUDA (run with ``pytest -m gpu``) ------------------------------------------------------------

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@gpu
@needs_cuda
def test_cuda_dummy_turn_in_bf16(tmp_path: Path) -> None:
    """Built on the GPU in bf16 (the default dtype there), seeded, and serving an audio turn."""
    raw = published_tiny(thinker_layers=4, talker_layers=2)
    cuda = torch.device("cuda")
    config = Qwen3OmniMoeConfig(**raw)
    model = build_random_model(config, device=cuda, dtype=torch.bfloat16, seed=5)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    a = _state(model)
    b = _state(build_random_model(Qwen3OmniMoeConfig(**raw), device=cuda, dtype=torch.bfloat16, seed=5))
    assert all(t.device.type == "cuda" for t in a.values())
    assert all(torch.equal(a[k], b[k]) for k in a)
    del model, a, b
    folder = config_folder(tmp_path / "cuda-tiny", raw)
    pipeline = load_speech_pipeline(
        folder, device="cuda", load_format="dummy", max_slots=2, max_audio_frames=12
    )
    assert pipeline.dtype == torch.bfloat16 and pipeline.info.random_weights
    pipeline.add(audio_request("a", max_output_tokens=3))
    outs = of(drain(pipeline), "a")
    assert any(isinstance(o, TextDelta) for o in outs) and any(isinstance(o, AudioDelta) for o in outs)
    assert isinstance(outs[-1], Finished) and outs[-1].reason in ("stop", "length")


@gpu
@needs_cuda
@pytest.mark.slow
def test_cuda_real_size_builds_on_the_device_and_stays_finite() -> None:
    """The published config at full size: 35.26 B parameters built on the GPU without a CPU copy
    (the process's peak resident memory grows by far less than the 66 GB of weights, and GPU
    memory by about their size), and a 48-layer thinker forward in bf16 stays finite."""
    import resource
    import time

    cuda = torch.device("cuda")
    torch.zeros(1, device=cuda)  # the CUDA context exists before host memory is measured
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(cuda)
    torch.cuda.reset_peak_memory_stats(cuda)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    model = build_random_model(
        Qwen3OmniMoeConfig(**json.loads(PUBLISHED.read_text())), device=cuda, dtype=torch.bfloat16
    )
    seconds = time.perf_counter() - start
    rss_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(
        f"\nreal-size dummy build: {seconds:.1f} s, {weights / 2**30:.1f} GiB of weights, "
        f"peak GPU {(torch.cuda.max_memory_allocated(cuda) - base) / 2**30:.1f} GiB, "
        f"host peak RSS +{rss_growth / 2**30:.2f} GiB"
    )
    try:
        assert sum(p.numel() for p in model.parameters()) == pytest.approx(35.26e9, rel=2e-3)
        assert rss_growth < 4 * 2**30
        assert torch.cuda.max_memory_allocated(cuda) - base < 1.1 * weights
        ids = torch.randint(0, 151643, (1, 64), device=cuda, generator=torch.Generator(cuda).manual_seed(0))
        with torch.no_grad():
            out = model.thinker(input_ids=ids, output_hidden_states=True)
        assert len(out.hidden_states) == 49
        for h in (*out.hidden_states, out.logits):
            assert torch.isfinite(h).all()
        assert float(out.logits.float().abs().max()) < 100.0
    finally:
        del model
        torch.cuda.empty_cache()
