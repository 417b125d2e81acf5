"""Loads a Qwen3-Omni checkpoint in its published layout into a :class:`SpeechPipeline`.

The folder holds ``config.json`` + ``*.safetensors`` (the ``Qwen3OmniMoeForConditionalGeneration``
weights), the tokenizer files with the chat template, and ``preprocessor_config.json`` (Whisper
feature extractor; the Qwen2-VL image processor keys when the model takes images). The demo
checkpoint goes through this same code.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from ..types import ModelInfo
from .pipeline import SpeechPipeline
from .prompt import PromptBuilder

log = logging.getLogger(__name__)

ARCHITECTURE = "Qwen3OmniMoeForConditionalGeneration"


class CheckpointError(ValueError):
    """The folder is not a loadable Qwen3-Omni checkpoint (the message says why)."""


def _check_folder(path: Path) -> dict:
    if not path.exists():
        raise CheckpointError(f"model path {str(path)!r} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"model path {str(path)!r} is not a folder")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{str(path)!r} has no config.json (expected a Hugging Face checkpoint folder)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{config_file} is not valid JSON: {exc}") from None
    if config.get("model_type") != "qwen3_omni_moe":
        raise CheckpointError(
            f"{str(path)!r} holds a {config.get('model_type')!r} model; "
            "the speech pipeline serves qwen3_omni_moe"
        )
    if not any(path.glob("*.safetensors")):
        raise CheckpointError(f"{str(path)!r} has no *.safetensors weights")
    for name in ("tokenizer_config.json", "preprocessor_config.json"):
        if not (path / name).is_file():
            raise CheckpointError(f"{str(path)!r} has no {name}")
    return config


def _image_processor(path: Path) -> object | None:
    cfg = json.loads((path / "preprocessor_config.json").read_text())
    if "patch_size" not in cfg and "image_processor_type" not in cfg:
        return None
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil.from_pretrained(str(path))


def _folder_chat_template(path: Path) -> str:
    """The chat template published beside the tokenizer (``chat_template.jinja`` or the
    processor's ``chat_template.json``), for tokenizers whose config holds none."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    processor = path / "chat_template.json"
    if processor.is_file():
        template = json.loads(processor.read_text()).get("chat_template")
        if isinstance(template, str) and template:
            return template
    raise CheckpointError(f"{str(path)!r} has no chat template (tokenizer config, chat_template.jinja/.json)")


def _stop_tokens(model: object, tokenizer: object) -> set[int]:
    """Ids that end the thinker's reply: ``<|im_end|>``, the tokenizer's EOS, ``<|endoftext|>``
    and the EOS ids of the checkpoint's generation configs."""
    stop = {int(model.config.im_end_token_id)}  # type: ignore[attr-defined]
    eos_id = getattr(tokenizer, "eos_token_id", None)
    if eos_id is not None:
        stop.add(int(eos_id))
    endoftext = tokenizer.get_vocab().get("<|endoftext|>")  # type: ignore[attr-defined]
    if endoftext is not None:
        stop.add(int(endoftext))
    for owner in (model, getattr(model, "thinker", None)):
        eos = getattr(getattr(owner, "generation_config", None), "eos_token_id", None)
        if eos is not None:
            stop.update(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    return stop


def load_speech_pipeline(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    *,
    max_slots: int = 32,
    max_context: int | None = None,
    max_audio_frames: int = 2048,
    audio_frames_per_token: float = 12.0,
    vocoder: str = "auto",
    cuda_graphs: bool = True,
    warm_up: bool = False,
    model_id: str | None = None,
    random_weights: bool | None = None,
) -> SpeechPipeline:
    """A :class:`SpeechPipeline` for the checkpoint folder ``path``.

    ``dtype`` defaults to float32 on CPU and bfloat16 elsewhere; ``max_context`` (thinker tokens
    per request, prompt and reply) defaults to the smaller of the model's limit and 4096.
    ``cuda_graphs``: on CUDA, the steps that have a CUDA-graph path capture it here and replay
    it (today the streaming code2wav vocoder; bitwise the same audio); ignored on CPU.
    """
    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration, WhisperFeatureExtractor

    path = Path(path).expanduser()
    raw = _check_folder(path)
    device = torch.device(device)
    if dtype is None:
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(path), dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = _folder_chat_template(path)
    cfg = model.config
    tcfg = cfg.thinker_config
    audio_token = tokenizer.convert_ids_to_tokens(int(tcfg.audio_token_id))
    image_token = tokenizer.convert_ids_to_tokens(int(tcfg.image_token_id))
    prompts = PromptBuilder(
        tokenizer,
        WhisperFeatureExtractor.from_pretrained(str(path)),
        _image_processor(path),
        audio_token=audio_token,
        image_token=image_token,
        n_window=int(tcfg.audio_config.n_window),
        merge_size=int(tcfg.vision_config.spatial_merge_size),
    )
    limit = int(tcfg.text_config.max_position_embeddings)
    context = min(limit, max_context or 4096)
    marker = path / "omnirt_demo.json"
    if random_weights is None:
        random_weights = marker.is_file() and bool(json.loads(marker.read_text()).get("random_weights"))
    stop = _stop_tokens(model, tokenizer)
    voices = tuple(sorted((cfg.talker_config.speaker_id or {}).keys())) if model.has_talker else ()
    info = ModelInfo(
        id=model_id or path.name,
        architecture=raw.get("architectures", [ARCHITECTURE])[0],
        random_weights=random_weights,
        source=str(path),
        voices=voices,
        max_context_tokens=context,
    )
    log.info(
        "loaded %s from %s on %s (%s)%s",
        info.architecture,
        path,
        device,
        dtype,
        " -- RANDOM WEIGHTS (demo)" if random_weights else "",
    )
    pipeline = SpeechPipeline(
        model,
        prompts,
        info,
        max_slots=max_slots,
        max_context=context,
        max_audio_frames=max_audio_frames,
        audio_frames_per_token=audio_frames_per_token,
        stop_token_ids=stop,
        vocoder=vocoder,
        cuda_graphs=cuda_graphs,
    )
    if warm_up:
        pipeline.warm_up()
    return pipeline
