"""Qwen3-Omni code2wav weights, held under transformers' parameter names.

:class:`Code2WavModel` is a weight container: its ``state_dict`` keys are exactly those of
transformers' ``Qwen3OmniMoeCode2Wav`` (so a checkpoint's ``code2wav.*`` tensors load with the
prefix stripped), and it knows the stream geometry of the architecture. The streaming
computation itself lives in :mod:`.step`; the per-stream state in :mod:`.state`.

Where ``S * 1920 - 555`` comes from (default config, ``S`` frames). The causal convolutions
(stride 1, ``(kernel - 1) * dilation`` zeros on the left) keep the length; the two upsamplers'
transposed convolutions (kernel = stride = 2) trim nothing: ``S -> 2S -> 4S``. Each decoder
block's transposed convolution (kernel ``2r``, stride ``r``) makes ``(L + 1) * r`` samples from
``L`` and trims ``r`` at each end, leaving ``(L - 1) * r``:
``4S -> 32S - 8 -> 160S - 45 -> 640S - 184 -> 1920S - 555``.

Why that is streamable: after the trim, output block ``j`` (``r`` samples) is the sum of the
contributions of inputs ``j`` and ``j + 1``, so it is final as soon as input ``j + 1`` exists,
and the right-hand trim drops exactly the block still waiting for an input. Each such
convolution therefore lags its input by one input sample, and the lags compound to
``((((0 + 1) * 8 + 1) * 5 + 1) * 4 + 1) * 3 = 555`` output samples held back after every frame
(:attr:`Code2WavModel.held_back`); nothing else is held back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig

from ..streaming import rope_inv_freq


def head_dim(config: Qwen3OmniMoeCode2WavConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class CausalConv(nn.Module):
    """Weights of a causal ``Conv1d`` (stride 1): ``history`` past inputs are needed per output."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1,
                 groups: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation, groups=groups)
        self.dilation = dilation
        self.groups = groups
        self.history = (kernel_size - 1) * dilation


class TransConv(nn.Module):
    """Weights of a trimmed ``ConvTranspose1d`` whose kernel is a multiple of its stride.

    With kernel ``m * stride``, trimmed output block ``j`` depends on inputs ``j .. j + m - 1``:
    ``lookahead = m - 1`` inputs.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int) -> None:
        super().__init__()
        if kernel_size % stride:
            raise ValueError(f"transposed conv kernel {kernel_size} is not a multiple of its stride {stride}")
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride)
        self.stride = stride
        self.lookahead = kernel_size // stride - 1


class SnakeBeta(nn.Module):
    """Weights of SnakeBeta: ``x + 1 / (exp(beta) + 1e-9) * sin(x * exp(alpha)) ** 2`` per channel.

    ``exp_alpha`` and ``inv_beta`` (``[channels, 1]``, non-persistent) hold ``exp(alpha)`` and
    ``1 / (exp(beta) + 1e-9)`` in the weights' dtype; :meth:`Code2WavModel.rebuild_buffers`
    recomputes them from the weights.
    """

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))
        self.rebuild_buffers()

    @torch.no_grad()
    def rebuild_buffers(self) -> None:
        """Recomputes ``exp_alpha`` and ``inv_beta`` from ``alpha`` and ``beta`` (same device, dtype)."""
        self.exp_alpha = nn.Buffer(torch.exp(self.alpha.unsqueeze(-1)), persistent=False)
        self.inv_beta = nn.Buffer(1.0 / (torch.exp(self.beta.unsqueeze(-1)) + 0.000000001), persistent=False)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = CausalConv(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(1e-6 * torch.ones(dim))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


class LayerScale(nn.Module):
    def __init__(self, dim: int, initial_scale: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), initial_scale))


class Attention(nn.Module):
    def __init__(self, config: Qwen3OmniMoeCode2WavConfig) -> None:
        super().__init__()
        self.head_dim = head_dim(config)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)


class Mlp(nn.Module):
    def __init__(self, config: Qwen3OmniMoeCode2WavConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"code2wav hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)


class TransformerLayer(nn.Module):
    def __init__(self, config: Qwen3OmniMoeCode2WavConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = Mlp(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(config.hidden_size, config.layer_scale_initial_scale)
        self.mlp_layer_scale = LayerScale(config.hidden_size, config.layer_scale_initial_scale)


class Transformer(nn.Module):
    def __init__(self, config: Qwen3OmniMoeCode2WavConfig) -> None:
        super().__init__()
        rope = config.rope_parameters or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"code2wav rope_type {rope['rope_type']!r} is not supported (only 'default')")
        self.layers = nn.ModuleList(TransformerLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head_dim = head_dim(config)
        self.rope_theta = float(rope.get("rope_theta", 10000.0))
        self.inv_freq = nn.Buffer(rope_inv_freq(self.rope_theta, self.head_dim, None), persistent=False)
        self.sliding_window: int = config.sliding_window
        self.ring_index = nn.Buffer(torch.arange(self.sliding_window), persistent=False)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv(dim, dim, 1)


class DecoderBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, rate: int) -> None:
        super().__init__()
        self.block = nn.ModuleList(
            [SnakeBeta(in_dim), TransConv(in_dim, out_dim, 2 * rate, rate)]
            + [ResidualUnit(out_dim, dilation) for dilation in (1, 3, 9)]
        )


@dataclass(frozen=True)
class StreamGeometry:
    """Samples per frame at one point of the network, and how many of a stream's first step
    are before its start (pre-start positions, which the offline decode never computes)."""

    per_frame: int
    delay: int


class Code2WavModel(nn.Module):
    """Qwen3-Omni code2wav weights with transformers' names and the streaming geometry."""

    def __init__(self, config: Qwen3OmniMoeCode2WavConfig) -> None:
        super().__init__()
        if config.decoder_dim % 2 ** len(config.upsample_rates):
            raise ValueError("code2wav decoder_dim must divide by 2 ** len(upsample_rates)")
        self.config = config
        self.num_quantizers: int = config.num_quantizers
        self.codebook_size: int = config.codebook_size
        self.pre_transformer = Transformer(config)
        self.code_embedding = nn.Embedding(config.codebook_size * config.num_quantizers, config.hidden_size)
        self.code_offset = nn.Buffer(torch.arange(config.num_quantizers) * config.codebook_size,
                                     persistent=False)
        hidden = config.hidden_size
        self.upsample = nn.ModuleList(
            nn.ModuleList([TransConv(hidden, hidden, f, f), ConvNeXtBlock(hidden)])
            for f in config.upsampling_ratios
        )
        dims = [config.decoder_dim // 2**i for i in range(len(config.upsample_rates) + 1)]
        decoder: list[nn.Module] = [CausalConv(config.hidden_size, config.decoder_dim, 7)]
        decoder += [DecoderBlock(dims[i], dims[i + 1], r) for i, r in enumerate(config.upsample_rates)]
        decoder += [SnakeBeta(dims[-1]), CausalConv(dims[-1], 1, 7)]
        self.decoder = nn.ModuleList(decoder)

        # Geometry of every decoder block's input and of the output, in samples per frame.
        geometry = [StreamGeometry(math.prod(config.upsampling_ratios), 0)]
        for block in self.decoder_blocks:
            up = block.block[1]
            prev = geometry[-1]
            delay = (prev.delay + up.lookahead) * up.stride
            geometry.append(StreamGeometry(prev.per_frame * up.stride, delay))
        self.block_geometry: tuple[StreamGeometry, ...] = tuple(geometry)

    @property
    def decoder_blocks(self) -> list[DecoderBlock]:
        return [m for m in self.decoder if isinstance(m, DecoderBlock)]

    @property
    def samples_per_frame(self) -> int:
        """Output samples per frame of codes (1920 at 24 kHz for the published model)."""
        return self.block_geometry[-1].per_frame

    @property
    def held_back(self) -> int:
        """Output samples not yet final after each frame (555 for the published model)."""
        return self.block_geometry[-1].delay

    def offline_length(self, frames: int) -> int:
        """Samples transformers' offline decode returns for ``frames`` frames."""
        return max(0, frames * self.samples_per_frame - self.held_back)

    @classmethod
    def from_hf(cls, module: nn.Module) -> Code2WavModel:
        """Shares the weights of a loaded transformers ``Qwen3OmniMoeCode2Wav`` (no copy);
        for a whole ``Qwen3OmniMoeForConditionalGeneration`` pass its ``code2wav``."""
        return cls.from_state_dict(module.config, module.state_dict())

    @classmethod
    def from_state_dict(cls, config: Qwen3OmniMoeCode2WavConfig, tensors: Mapping[str, torch.Tensor],
                        prefix: str = "", device: torch.device | str | None = None,
                        dtype: torch.dtype | None = None) -> Code2WavModel:
        """Builds from the ``prefix``-named tensors of a state dict (``"code2wav."`` for a whole
        Qwen3-Omni one; other tensors are ignored), moved to ``device`` / ``dtype`` when given,
        shared otherwise. Raises ``ValueError`` when they do not match ``config``."""
        found = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        with torch.device("meta"):
            model = cls(config)
        expected = model.state_dict()
        missing = sorted(set(expected) - set(found))
        unexpected = sorted(set(found) - set(expected))
        misshapen = sorted(k for k in set(expected) & set(found) if expected[k].shape != found[k].shape)
        if missing or unexpected or misshapen:
            raise ValueError(f"code2wav weights do not match the config: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}, misshapen {misshapen[:5]}")
        found = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else None)
                 for k, v in found.items()}
        model.load_state_dict(found, strict=True, assign=True)
        return model.rebuild_buffers(model.code_embedding.weight.device).eval()

    def rebuild_buffers(self, device: torch.device | str) -> Code2WavModel:
        """Recomputes the non-persistent buffers on ``device``: after a meta-device build, after
        a cast to a low-precision dtype (the RoPE frequencies stay float32), and after the
        weights change (the SnakeBeta buffers are functions of them)."""
        cfg = self.config
        self.code_offset = nn.Buffer(
            torch.arange(cfg.num_quantizers, device=device) * cfg.codebook_size, persistent=False
        )
        t = self.pre_transformer
        t.inv_freq = nn.Buffer(rope_inv_freq(t.rope_theta, t.head_dim, device), persistent=False)
        t.ring_index = nn.Buffer(torch.arange(t.sliding_window, device=device), persistent=False)
        for module in self.modules():
            if isinstance(module, SnakeBeta):
                module.rebuild_buffers()
        return self
