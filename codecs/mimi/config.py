"""Mimi codec configuration, read from a Hugging Face ``config.json``.

Only the fields the streaming codec needs are kept. Values the streaming code cannot serve
exactly (non-causal convolutions, a right-trim ratio other than 1, reflect padding, stereo,
non-default RoPE) are refused with a ``ValueError`` when the config is built, not discovered
half-way through a stream.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

_ACTIVATIONS = ("gelu", "relu", "silu")
_PAD_MODES = ("constant", "replicate")


@dataclass(frozen=True)
class MimiCodecConfig:
    """The architecture of one Mimi checkpoint (defaults: ``kyutai/mimi``)."""

    sampling_rate: int = 24_000
    audio_channels: int = 1
    hidden_size: int = 512
    num_filters: int = 64
    num_residual_layers: int = 1
    upsampling_ratios: tuple[int, ...] = (8, 6, 5, 4)
    kernel_size: int = 7
    last_kernel_size: int = 3
    residual_kernel_size: int = 3
    dilation_growth_rate: int = 2
    use_causal_conv: bool = True
    pad_mode: str = "constant"
    compress: int = 2
    trim_right_ratio: float = 1.0
    codebook_size: int = 2048
    codebook_dim: int = 256
    num_quantizers: int = 32
    num_semantic_quantizers: int = 1
    use_conv_shortcut: bool = False
    vector_quantization_hidden_dimension: int = 256
    upsample_groups: int = 512
    num_hidden_layers: int = 8
    intermediate_size: int = 2048
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    head_dim: int | None = None
    hidden_act: str = "gelu"
    norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    sliding_window: int = 250
    attention_bias: bool = False
    frame_rate: float | None = field(default=None)

    def __post_init__(self) -> None:
        problems: list[str] = []
        if self.audio_channels != 1:
            problems.append(f"audio_channels={self.audio_channels} (only mono is supported)")
        if not self.use_causal_conv:
            problems.append("use_causal_conv=False (streaming needs causal convolutions)")
        if self.trim_right_ratio != 1.0:
            problems.append(f"trim_right_ratio={self.trim_right_ratio} (only 1.0 streams exactly)")
        if self.pad_mode not in _PAD_MODES:
            problems.append(f"pad_mode={self.pad_mode!r} (supported: {', '.join(_PAD_MODES)})")
        if self.hidden_act not in _ACTIVATIONS:
            problems.append(f"hidden_act={self.hidden_act!r} (supported: {', '.join(_ACTIVATIONS)})")
        if self.num_semantic_quantizers >= self.num_quantizers:
            problems.append("num_semantic_quantizers must be lower than num_quantizers")
        if self.hidden_size % self.num_attention_heads:
            problems.append("hidden_size must be divisible by num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append("num_attention_heads must be a multiple of num_key_value_heads")
        if self.sliding_window < 1:
            problems.append("sliding_window must be at least 1")
        if self.latent_stride < 1 or self.encodec_frame_rate == self.codec_frame_rate:
            problems.append("Mimi needs a downsampling latent stride > 1 (frame_rate below the SEANet rate)")
        if problems:
            raise ValueError("unsupported Mimi config: " + "; ".join(problems))

    # Geometry -----------------------------------------------------------------------------
    @property
    def hop_length(self) -> int:
        """Audio samples per SEANet step (product of the up/down-sampling ratios)."""
        return math.prod(self.upsampling_ratios)

    @property
    def encodec_frame_rate(self) -> int:
        return math.ceil(self.sampling_rate / self.hop_length)

    @property
    def codec_frame_rate(self) -> float:
        """Frames of codes per second (12.5 for Mimi)."""
        if self.frame_rate is not None:
            return float(self.frame_rate)
        return self.sampling_rate / (self.hop_length * 2)

    @property
    def latent_stride(self) -> int:
        """Transformer tokens per code frame (the downsample stride, 2 for Mimi)."""
        return int(self.encodec_frame_rate / self.codec_frame_rate)

    @property
    def frame_size(self) -> int:
        """Audio samples per code frame (1920 for Mimi)."""
        return self.hop_length * self.latent_stride

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    # Construction -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MimiCodecConfig:
        """Builds from a ``config.json`` dict as transformers writes it (5.x or older 4.x)."""
        model_type = data.get("model_type", "mimi")
        if model_type != "mimi":
            raise ValueError(f"expected a Mimi config (model_type 'mimi'), got {model_type!r}")
        known = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {k: v for k, v in data.items() if k in known and v is not None}
        rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"unsupported Mimi config: rope_type={rope_type!r} (only 'default')")
        theta = rope.get("rope_theta", data.get("rope_theta"))
        if theta is not None:
            kwargs["rope_theta"] = float(theta)
        frame_rate = data.get("frame_rate", data.get("_frame_rate"))
        kwargs["frame_rate"] = None if frame_rate is None else float(frame_rate)
        if "upsampling_ratios" in kwargs:
            kwargs["upsampling_ratios"] = tuple(int(r) for r in kwargs["upsampling_ratios"])
        return cls(**kwargs)

    @classmethod
    def from_json(cls, path: str | Path) -> MimiCodecConfig:
        with open(path, encoding="utf-8") as handle:
            return cls.from_dict(json.load(handle))
