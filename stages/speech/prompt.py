"""Conversation messages -> the thinker's prompt tensors (what ``Qwen3OmniMoeProcessor`` produces).

The chat template renders each audio part as ``<|audio_start|><|audio_pad|><|audio_end|>`` and
each image as ``<|vision_start|><|image_pad|><|vision_end|>``; the single pad is then expanded
to as many tokens as the encoder will produce: for audio, from the Whisper feature length (the
processor's formula), for images from the patch grid over the merge size.

Tools and tool parts go through the template as Hugging Face expects them: ``tools=`` a list of
``{"type": "function", "function": {name, description, parameters}}``, an assistant's calls as
its message's ``tool_calls`` (arguments as a dict when they are a JSON object), each result as a
``tool`` message. Messages of text parts only are passed as one string (the published template
needs a string system message when there are tools).
"""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from jinja2 import TemplateError
from omnirt.codecs.audio import resample

from ..pipeline import RequestRejected
from ..types import (
    SAMPLE_RATE,
    AudioPart,
    ContextMessage,
    ImagePart,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    ToolSpec,
)
from .prefix_cache import media_key
from .tool_calls import CLOSE_TAG, OPEN_TAG

ENCODER_RATE = 16_000
#: Images whose token counts :meth:`PromptBuilder.length` keeps.
IMAGE_COUNTS_KEPT = 64


def audio_tokens_for_frames(frames: int, n_window: int) -> int:
    """Tokens the audio encoder makes of ``frames`` mel frames (the processor's own formula)."""
    chunk = n_window * 2
    leave = frames % chunk
    feat = (leave - 1) // 2 + 1
    return ((feat - 1) // 2 + 1 - 1) // 2 + 1 + (frames // chunk) * 13


def to_encoder_rate(pcm: np.ndarray) -> np.ndarray:
    """24 kHz -> 16 kHz, the audio encoder's rate."""
    return resample(pcm, SAMPLE_RATE, ENCODER_RATE)


@dataclass
class PromptInputs:
    input_ids: torch.Tensor  # [1, L]
    input_features: torch.Tensor | None = None  # [num_audios, mel, frames]
    feature_attention_mask: torch.Tensor | None = None  # [num_audios, frames]
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None  # [num_images, 3]
    audio_tokens: int = 0
    image_tokens: int = 0
    #: Each position's key [L] int64: the token id, or for an audio or image placeholder a
    #: negative digest of the part's content (:func:`~.prefix_cache.media_key`): prompts with
    #: equal keys up to a position have equal caches up to there. None: never reused.
    fingerprint: np.ndarray | None = None
    #: Messages of the request (after its leading system message) its truncation left out.
    dropped: int = 0

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def text_tokens(self) -> int:
        return self.length - self.audio_tokens - self.image_tokens

    def model_kwargs(self) -> dict[str, torch.Tensor]:
        kw: dict[str, torch.Tensor] = {}
        if self.input_features is not None:
            kw["input_features"] = self.input_features
            kw["feature_attention_mask"] = self.feature_attention_mask  # type: ignore[assignment]
        if self.pixel_values is not None:
            kw["pixel_values"] = self.pixel_values
            kw["image_grid_thw"] = self.image_grid_thw  # type: ignore[assignment]
        return kw


class PromptBuilder:
    """Holds the tokenizer and the audio / image preprocessors of one checkpoint."""

    def __init__(
        self,
        tokenizer: Any,
        feature_extractor: Any,
        image_processor: Any | None,
        *,
        audio_token: str,
        image_token: str,
        n_window: int,
        merge_size: int,
        max_audio_seconds: float = 600.0,
    ) -> None:
        self.tokenizer = tokenizer
        self.feature_extractor = feature_extractor
        self.image_processor = image_processor
        self.audio_token_id = tokenizer.convert_tokens_to_ids(audio_token)
        self.image_token_id = tokenizer.convert_tokens_to_ids(image_token)
        self.n_window = n_window
        self.merge_size = merge_size
        self.max_audio_seconds = max_audio_seconds
        self._special = [t for t in tokenizer.get_added_vocab() if len(t) > 1]
        #: Tokens of the images :meth:`length` has measured, by :func:`media_key` (oldest first).
        self._image_counts: dict[int, int] = {}
        self._image_counts_lock = threading.Lock()

    def build(self, messages: list[ContextMessage], tools: Sequence[ToolSpec] = ()) -> PromptInputs:
        if not messages:
            raise RequestRejected("the request has no messages")
        ids, audios, images = self._render(messages, tools)
        out = PromptInputs(input_ids=torch.empty(0))
        audio_counts: list[int] = []
        if audios:
            audio_counts = self._audio_features(audios, out)
        image_counts: list[int] = []
        if images:
            image_counts = self._image_features(images, out)
        expanded: list[int] = []
        keys: list[int] = []
        a = i = 0
        for tok in ids:
            if tok == self.audio_token_id and audios:
                if a >= len(audio_counts):
                    raise RequestRejected("the prompt has more audio placeholders than audio parts")
                expanded.extend([tok] * audio_counts[a])
                keys.extend([media_key(audios[a].tobytes())] * audio_counts[a])
                a += 1
            elif tok == self.image_token_id and images:
                if i >= len(image_counts):
                    raise RequestRejected("the prompt has more image placeholders than image parts")
                expanded.extend([tok] * image_counts[i])
                keys.extend([media_key(images[i])] * image_counts[i])
                i += 1
            else:
                expanded.append(tok)
                keys.append(tok)
        if a != len(audio_counts) or i != len(image_counts):
            raise RequestRejected("the chat template dropped an audio or image part")
        out.input_ids = torch.tensor([expanded], dtype=torch.long)
        out.fingerprint = np.array(keys, dtype=np.int64)
        out.audio_tokens = sum(audio_counts)
        out.image_tokens = sum(image_counts)
        return out

    def length(self, messages: list[ContextMessage], tools: Sequence[ToolSpec] = ()) -> int:
        """The tokens :meth:`build` makes of ``messages`` (none: the tools' part and the reply's
        header alone), without its audio and image features: the audio parts' tokens from their
        lengths, the images' from their patch grids (each image's count kept, by digest, for the
        next call)."""
        ids, audios, images = self._render(messages, tools)
        expanded = len(ids) - len(audios) - len(images)
        hop = int(self.feature_extractor.hop_length)
        for pcm in audios:
            frames = round(pcm.shape[0] * ENCODER_RATE / SAMPLE_RATE) // hop
            expanded += audio_tokens_for_frames(frames, self.n_window)
        for data in images:
            expanded += self._image_tokens(data)
        return expanded

    def _image_tokens(self, data: bytes) -> int:
        key = media_key(data)
        with self._image_counts_lock:  # prompts are prepared on several threads
            known = self._image_counts.get(key)
        if known is not None:
            return known
        count = self._image_features([data], PromptInputs(torch.empty(0)))[0]
        with self._image_counts_lock:
            if len(self._image_counts) >= IMAGE_COUNTS_KEPT:
                self._image_counts.pop(next(iter(self._image_counts)))
            self._image_counts[key] = count
        return count

    def _render(
        self, messages: list[ContextMessage], tools: Sequence[ToolSpec]
    ) -> tuple[list[int], list[np.ndarray], list[bytes]]:
        """The chat template's token ids (one pad per audio or image part) and the parts, in order."""
        chat: list[dict[str, Any]] = []
        audios: list[np.ndarray] = []
        images: list[bytes] = []
        for message in messages:
            results = [p for p in message.parts if isinstance(p, ToolResultPart)]
            if message.role == "tool" or results:
                chat.extend(self._tool_results(message, results))
                continue
            content: list[dict[str, Any]] = []
            calls: list[dict[str, Any]] = []
            for part in message.parts:
                if isinstance(part, TextPart):
                    allowed = (OPEN_TAG, CLOSE_TAG) if message.role == "assistant" else ()
                    self._check_text(part.text, allowed)
                    content.append({"type": "text", "text": part.text})
                elif isinstance(part, AudioPart):
                    audios.append(self._check_audio(part.pcm))
                    content.append({"type": "audio", "audio": f"audio{len(audios)}"})
                elif isinstance(part, ImagePart):
                    images.append(part.data)
                    content.append({"type": "image", "image": f"image{len(images)}"})
                elif isinstance(part, ToolCallPart):
                    if message.role != "assistant":
                        raise RequestRejected(f"a {message.role} message cannot hold a tool call")
                    calls.append(self._tool_call(part))
                else:
                    raise RequestRejected(f"unsupported message part {type(part).__name__}")
            entry: dict[str, Any] = {"role": message.role, "content": content}
            if all(c["type"] == "text" for c in content):
                entry["content"] = "".join(c["text"] for c in content)
            if calls:
                entry["tool_calls"] = calls
            chat.append(entry)
        kwargs: dict[str, Any] = {}
        if tools:
            kwargs["tools"] = [self._tool_spec(t) for t in tools]
        try:
            text = self.tokenizer.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=True, **kwargs
            )
        except (TemplateError, TypeError, ValueError, KeyError) as exc:
            raise RequestRejected(f"the chat template cannot render this conversation: {exc}") from None
        ids: list[int] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids, audios, images

    def _check_text(self, text: str, allowed: tuple[str, ...] = (), what: str = "text parts") -> None:
        for special in self._special:
            if special in text and special not in allowed:
                raise RequestRejected(f"{what} may not contain the special token {special!r}")

    def _tool_results(self, message: ContextMessage, results: list[ToolResultPart]) -> list[dict[str, Any]]:
        """A ``tool`` message's results, one template message each (the template joins them)."""
        if message.role != "tool":
            raise RequestRejected(f"a {message.role} message cannot hold a tool result")
        if len(results) != len(message.parts) or not results:
            raise RequestRejected("a tool message holds tool results only, at least one")
        out = []
        for result in results:
            self._check_text(result.output, what="tool results")
            out.append({"role": "tool", "tool_call_id": result.call_id, "content": result.output})
        return out

    def _tool_call(self, part: ToolCallPart) -> dict[str, Any]:
        """An assistant's call for the template: arguments as a dict when they are a JSON object
        (rendered with ``tojson``), else the text as written."""
        self._check_text(part.name, what="function names")
        self._check_text(part.arguments, what="tool call arguments")
        try:
            arguments: Any = json.loads(part.arguments)
        except ValueError:
            arguments = part.arguments
        if not isinstance(arguments, dict):
            arguments = part.arguments
        function = {"name": part.name, "arguments": arguments}
        return {"id": part.call_id, "type": "function", "function": function}

    def _tool_spec(self, tool: ToolSpec) -> dict[str, Any]:
        """A function for the template's ``tools``: what OpenAI's API takes."""
        function: dict[str, Any] = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        function["parameters"] = tool.parameters or {"type": "object", "properties": {}}
        try:
            self._check_text(json.dumps(function, ensure_ascii=False), what="tool definitions")
        except (TypeError, ValueError) as exc:
            raise RequestRejected(f"the function {tool.name!r} is not JSON: {exc}") from None
        return {"type": "function", "function": function}

    def _check_audio(self, pcm: np.ndarray) -> np.ndarray:
        pcm = np.asarray(pcm)
        if pcm.ndim != 1:
            raise RequestRejected(f"audio must be mono (1-D), got shape {pcm.shape}")
        if pcm.dtype.kind != "f":
            raise RequestRejected(f"audio must be float PCM, got {pcm.dtype}")
        if not np.isfinite(pcm).all():
            raise RequestRejected("audio contains NaN or infinite samples")
        seconds = pcm.shape[0] / SAMPLE_RATE
        if seconds < 0.05:
            raise RequestRejected(f"audio part too short ({seconds * 1000:.0f} ms, need at least 50 ms)")
        if seconds > self.max_audio_seconds:
            raise RequestRejected(f"audio part too long ({seconds:.1f} s > {self.max_audio_seconds:.0f} s)")
        return pcm.astype(np.float32, copy=False)

    def _audio_features(self, audios: list[np.ndarray], out: PromptInputs) -> list[int]:
        resampled = [to_encoder_rate(pcm) for pcm in audios]
        feats = self.feature_extractor(
            resampled,
            sampling_rate=ENCODER_RATE,
            padding=True,
            truncation=False,
            return_attention_mask=True,
            return_tensors="pt",
        )
        out.input_features = feats["input_features"]
        out.feature_attention_mask = feats["attention_mask"]
        frames = out.feature_attention_mask.sum(-1).tolist()
        return [audio_tokens_for_frames(int(f), self.n_window) for f in frames]

    def _image_features(self, images: list[bytes], out: PromptInputs) -> list[int]:
        if self.image_processor is None:
            raise RequestRejected("this model does not take images")
        from PIL import Image, UnidentifiedImageError

        decoded = []
        for k, data in enumerate(images):
            try:
                img = Image.open(io.BytesIO(data))
                img.load()
            except (UnidentifiedImageError, OSError, ValueError) as exc:
                raise RequestRejected(f"image {k + 1} could not be decoded: {exc}") from None
            decoded.append(img.convert("RGB"))
        processed = self.image_processor(images=decoded, return_tensors="pt")
        out.pixel_values = processed["pixel_values"]
        out.image_grid_thw = processed["image_grid_thw"]
        return [int(g.prod()) // self.merge_size**2 for g in out.image_grid_thw]
