"""Loads a Qwen3-Omni checkpoint in its published layout into a :class:`SpeechPipeline`.

The folder holds ``config.json`` + ``*.safetensors`` (the ``Qwen3OmniMoeForConditionalGeneration``
weights), the tokenizer files with the chat template, and ``preprocessor_config.json`` (Whisper
feature extractor; the Qwen2-VL image processor keys when the model takes images). The demo
checkpoint goes through this same code. With ``load_format="dummy"`` only ``config.json`` is
needed: the weights are random (:mod:`.dummy`); everything after the model is built (prompt
builder, stop tokens, model info, the pipeline) is the same code for both.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from ..checkpoints import READ_ERRORS, CheckpointError, first_line, from_pretrained_checked
from ..graphs import default_compile_workers
from ..types import ModelInfo
from .dummy import DEFAULT_SEED, LOAD_FORMATS
from .experts import IMPLEMENTATION as EXPERTS
from .memory import plan_slots
from .pipeline import SpeechPipeline
from .prompt import PromptBuilder

log = logging.getLogger(__name__)

ARCHITECTURE = "Qwen3OmniMoeForConditionalGeneration"


class LoadFormatError(ValueError):
    """An unknown ``load_format`` (``--load-format``)."""


def _read_config(path: Path, *, allow_file: bool = False) -> dict:
    """The ``config.json`` (a ``qwen3_omni_moe`` one) of the folder ``path``, or ``path`` itself
    when ``allow_file`` and it is a file; else a :class:`CheckpointError`."""
    if not path.exists():
        raise CheckpointError(f"model path {str(path)!r} does not exist")
    if path.is_file() and allow_file:
        config_file = path
    elif not path.is_dir():
        raise CheckpointError(f"model path {str(path)!r} is not a folder")
    else:
        config_file = path / "config.json"
        if not config_file.is_file():
            raise CheckpointError(
                f"{str(path)!r} has no config.json (expected a Hugging Face checkpoint folder)"
            )
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{config_file} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file} does not hold a JSON object")
    if config.get("model_type") != "qwen3_omni_moe":
        raise CheckpointError(
            f"{str(path)!r} holds a {config.get('model_type')!r} model; "
            "the speech pipeline serves qwen3_omni_moe"
        )
    return config


def _check_checkpoint_files(path: Path) -> None:
    """What ``--load-format auto`` needs beside config.json: weights, tokenizer, preprocessor."""
    if not any(path.glob("*.safetensors")):
        raise CheckpointError(
            f"{str(path)!r} has no *.safetensors weights (--load-format dummy serves random weights "
            "from config.json alone)"
        )
    for name in ("tokenizer_config.json", "preprocessor_config.json"):
        if not (path / name).is_file():
            raise CheckpointError(f"{str(path)!r} has no {name}")


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


def _folder_tokenizer(path: Path, *, template_fallback: str | None = None) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if not getattr(tokenizer, "chat_template", None):
        try:
            tokenizer.chat_template = _folder_chat_template(path)
        except CheckpointError:
            if template_fallback is None:
                raise
            log.warning("%s has no chat template: using the embedded default's", path)
            tokenizer.chat_template = template_fallback
    return tokenizer


def _load_checkpoint(path: Path, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any, Any, Any]:
    """``--load-format auto``: the model, tokenizer, feature extractor and image processor, all
    read from the checkpoint folder."""
    from transformers import Qwen3OmniMoeForConditionalGeneration, WhisperFeatureExtractor

    _check_checkpoint_files(path)
    model = from_pretrained_checked(
        Qwen3OmniMoeForConditionalGeneration, path, "model", dtype=dtype, ignore_mismatched_sizes=True
    )
    model = model.to(device).eval()
    try:
        features = WhisperFeatureExtractor.from_pretrained(str(path))
        tokenizer = _folder_tokenizer(path)
    except (*READ_ERRORS, ValueError) as exc:
        what = "the tokenizer or preprocessor does not load"
        raise CheckpointError(f"{str(path)!r}: {what} ({first_line(exc)})") from None
    return model, tokenizer, features, _image_processor(path)


def _build_dummy(
    path: Path, raw: dict, device: torch.device, dtype: torch.dtype, seed: int
) -> tuple[Any, Any, Any, Any]:
    """``--load-format dummy``: the architecture of ``config.json`` with seeded random weights
    (:mod:`.dummy`); tokenizer and preprocessors from the folder where it has them, else the
    embedded default's, laid out at the config's token ids. ``path`` may be the config file
    itself (then no other file is read)."""
    from transformers import GenerationConfig, Qwen3OmniMoeConfig, WhisperFeatureExtractor

    from . import dummy
    from .demo_tokenizer import CHAT_TEMPLATE

    try:
        config = Qwen3OmniMoeConfig(**raw)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{str(path)!r}: not a valid Qwen3-Omni config: {exc}") from None

    def has(name: str) -> bool:
        return path.is_dir() and (path / name).is_file()

    if has("tokenizer_config.json"):
        tokenizer = _folder_tokenizer(path, template_fallback=CHAT_TEMPLATE)
    else:
        tokenizer = dummy.config_tokenizer(config, raw)
        log.info("%s has no tokenizer: using the embedded default's, at the config's token ids", path)
    if has("preprocessor_config.json"):
        features, images = WhisperFeatureExtractor.from_pretrained(str(path)), _image_processor(path)
    else:
        features, images = dummy.default_feature_extractor(config), dummy.default_image_processor(config)
    model = dummy.build_random_model(config, device=device, dtype=dtype, seed=seed)
    if has("generation_config.json"):
        model.generation_config = GenerationConfig.from_pretrained(str(path))
    return model, tokenizer, features, images


def load_speech_pipeline(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    *,
    load_format: str = "auto",
    seed: int = DEFAULT_SEED,
    max_slots: int = 32,
    max_context: int | None = None,
    max_audio_frames: int = 2048,
    audio_frames_per_token: float = 12.0,
    vocoder: str = "auto",
    cuda_graphs: bool = True,
    prefill_worker: bool = False,
    prefill_chunk: int = 512,
    prefix_cache: bool = True,
    warm_up: bool = False,
    model_id: str | None = None,
    random_weights: bool | None = None,
    compile_workers: int | None = None,
) -> SpeechPipeline:
    """A :class:`SpeechPipeline` for the checkpoint folder ``path``.

    ``load_format``: ``"auto"`` reads the weights, tokenizer and preprocessor config of a
    checkpoint in the published layout; ``"dummy"`` needs only ``config.json`` (``path`` may
    also be that JSON file) and builds the model with random weights (``seed``) on ``device``
    (see :mod:`.dummy`), reported as random whatever ``random_weights`` says.
    ``dtype`` defaults to float32 on CPU and bfloat16 elsewhere; ``max_context`` (thinker tokens
    per request, prompt and reply) defaults to the smaller of the model's limit and 4096, or on
    CUDA to the longest power of two up to that whose slots fit the free memory (see
    :mod:`.memory`; a given ``max_context`` whose slots do not fit is refused with the sizes).
    ``cuda_graphs``: on CUDA, every decode step (thinker token, talker frame with the code
    predictor's loop and sampling) and the streaming code2wav vocoder capture their CUDA graphs
    here, for every batch and attention-length bucket, and replay them (bitwise the same output
    as eager); ``False`` runs them all eagerly. Ignored on CPU. MoE layers run transformers'
    ``grouped_mm`` experts with one launch grouping the pairs by expert (:mod:`.experts`; no host
    sync, capturable; ``batched_mm`` for fp32 on CUDA).
    ``prefill_worker``: read prompts on a thread and CUDA stream beside the decode steps (see
    :class:`~.pipeline.SpeechPipeline`; off by default). ``prefill_chunk``: prompt tokens a
    prompt pass reads per tick (a longer prompt is read over several ticks). ``prefix_cache``:
    reuse the prompt prefix another request has read (see :mod:`.prefix_cache`).
    ``compile_workers``: threads that make the steps' first calls at every bucket before the
    capture (``stages.graphs.prewarm``: their Triton compiles side by side; 0 or 1: the captures
    make them one after another; None: ``stages.graphs.default_compile_workers()``).
    """
    if load_format not in LOAD_FORMATS:
        raise LoadFormatError(
            f"unknown load format {load_format!r}; expected one of: {', '.join(LOAD_FORMATS)}"
        )
    path = Path(path).expanduser()
    raw = _read_config(path, allow_file=load_format == "dummy")
    device = torch.device(device)
    if dtype is None:
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    if load_format == "dummy":
        model, tokenizer, features, images = _build_dummy(path, raw, device, dtype, seed)
        random_weights = True
        what = f"RANDOM WEIGHTS (--load-format dummy, seed {seed})"
    else:
        model, tokenizer, features, images = _load_checkpoint(path, device, dtype)
        if random_weights is None:
            marker = path / "omnirt_demo.json"
            random_weights = marker.is_file() and bool(json.loads(marker.read_text()).get("random_weights"))
        what = "RANDOM WEIGHTS (demo)" if random_weights else "weights"
    # grouped_mm needs no host sync and can be captured, but only in bf16 on CUDA: in fp32 there
    # it falls back to a path that copies from the host, so fp32 CUDA runs batched_mm. Ours is
    # grouped_mm with the pairs grouped by expert in one launch (.experts).
    fp32_cuda = device.type == "cuda" and dtype == torch.float32
    model.set_experts_implementation("batched_mm" if fp32_cuda else EXPERTS)
    cfg = model.config
    limit = int(cfg.thinker_config.text_config.max_position_embeddings)
    # The slots' KV caches, planned against what the GPU has free once the weights are in.
    plan = plan_slots(
        cfg,
        max_slots=max_slots,
        max_context=min(limit, max_context) if max_context else None,
        default_context=min(limit, 4096),
        max_audio_frames=max_audio_frames,
        element_size=torch.empty((), dtype=dtype).element_size(),
        free_bytes=torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None,
    )
    log.info("speech slots: %s", plan.describe())
    info = ModelInfo(
        id=model_id or _model_name(path),
        architecture=raw.get("architectures", [ARCHITECTURE])[0] if load_format == "auto" else ARCHITECTURE,
        random_weights=random_weights,
        source=str(path),
        voices=tuple(sorted((cfg.talker_config.speaker_id or {}).keys())) if model.has_talker else (),
        max_context_tokens=plan.max_context,
    )
    log.info("loaded %s from %s on %s (%s): %s", info.architecture, path, device, dtype, what)
    pipeline = SpeechPipeline(
        model,
        _prompt_builder(model, tokenizer, features, images),
        info,
        max_slots=max_slots,
        max_context=info.max_context_tokens,
        max_audio_frames=max_audio_frames,
        audio_frames_per_token=audio_frames_per_token,
        stop_token_ids=_stop_tokens(model, tokenizer),
        vocoder=vocoder,
        cuda_graphs=cuda_graphs,
        prefill_worker=prefill_worker,
        prefill_chunk=prefill_chunk,
        prefix_cache=prefix_cache,
    )
    workers = default_compile_workers() if compile_workers is None else compile_workers
    pipeline.capture(compile_workers=workers)
    if warm_up:
        pipeline.warm_up()
    return pipeline


def _prompt_builder(model: Any, tokenizer: Any, features: Any, images: Any) -> PromptBuilder:
    tcfg = model.config.thinker_config
    return PromptBuilder(
        tokenizer,
        features,
        images,
        audio_token=tokenizer.convert_ids_to_tokens(int(tcfg.audio_token_id)),
        image_token=tokenizer.convert_ids_to_tokens(int(tcfg.image_token_id)),
        n_window=int(tcfg.audio_config.n_window),
        merge_size=int(tcfg.vision_config.spatial_merge_size),
    )


def _model_name(path: Path) -> str:
    """The folder's name, or a config file's name without ``.json`` / ``.config.json``."""
    if path.is_dir():
        return path.name
    return path.name.removesuffix(".json").removesuffix(".config")
