"""Streaming SEANet convolutions of Mimi: causal Conv1d, transposed Conv1d, residual blocks.

Module and parameter names follow the published checkpoint (``encoder.layers.3.conv.weight``,
``decoder.layers.3.block.1.conv.bias``...), so weights load by name. Strides, dilations and
paddings are Python ints: nothing here reads a device tensor on the host, so a step can be
captured in a CUDA graph.

Causal Conv1d state: the last ``(kernel-1)*dilation + 1 - stride`` input samples of the
stream (zeros at start, or the stream's first sample repeated for ``replicate`` padding). That
is exactly the left padding a whole-sequence causal convolution sees, so chunked output equals
whole-sequence output.

Transposed Conv1d state: the overlap tail, the last ``kernel - stride`` output samples of the
previous chunk (without bias), added to the head of the next chunk's output. With the causal
right trim of Mimi (``trim_right_ratio == 1``), the emitted samples are the whole-sequence ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..streaming import StateSpec, StreamingModule, commit
from .config import MimiCodecConfig


class StreamingConv1d(StreamingModule):
    """Causal Conv1d over chunks whose length is a multiple of the stride."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int = 1,
        dilation: int = 1,
        groups: int = 1,
        bias: bool = True,
        pad_mode: str = "constant",
    ) -> None:
        super().__init__()
        if pad_mode not in ("constant", "replicate"):
            raise ValueError(f"unsupported pad_mode {pad_mode!r}")
        self.conv = nn.Conv1d(
            in_channels, out_channels, kernel_size, stride, dilation=dilation, groups=groups, bias=bias
        )
        self.in_channels = in_channels
        self.stride = stride
        self.dilation = dilation
        self.groups = groups
        self.pad_mode = pad_mode
        self.context = (kernel_size - 1) * dilation + 1 - stride
        self.pointwise = kernel_size == 1 and stride == 1 and groups == 1

    def state_specs(self) -> dict[str, StateSpec]:
        if self.context <= 0:
            return {}
        specs = {"previous": StateSpec((self.in_channels, self.context))}
        if self.pad_mode == "replicate":
            specs["started"] = StateSpec((), False, torch.bool)
        return specs

    def forward(self, x: torch.Tensor, exec_mask: torch.Tensor) -> torch.Tensor:
        rows, _, length = x.shape
        if length % self.stride:
            raise ValueError(f"chunk of {length} samples is not a multiple of the stride {self.stride}")
        if self.context > 0:
            previous = self.state("previous", rows)
            context = previous
            if self.pad_mode == "replicate":
                started = self.state("started", rows)
                first = x[..., :1].expand(-1, -1, self.context)
                context = torch.where(started.view(-1, 1, 1), previous, first)
                commit(started, torch.ones_like(started), exec_mask)
            x = torch.cat([context, x], dim=-1)
            commit(previous, x[..., -self.context :], exec_mask)
        if self.pointwise:  # a 1x1 conv is a matmul; cuDNN would also convert layouts around it
            y = torch.matmul(self.conv.weight[:, :, 0], x)
            return y if self.conv.bias is None else y + self.conv.bias[:, None]
        return F.conv1d(x, self.conv.weight, self.conv.bias, self.stride, 0, self.dilation, self.groups)


class StreamingConvTranspose1d(StreamingModule):
    """Causal ConvTranspose1d (everything trimmed on the right) with an overlap-add tail."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int,
        groups: int = 1,
        bias: bool = True,
    ) -> None:
        super().__init__()
        if kernel_size < stride:
            raise ValueError("kernel_size must be at least the stride")
        self.conv = nn.ConvTranspose1d(
            in_channels, out_channels, kernel_size, stride, groups=groups, bias=bias
        )
        self.out_channels = out_channels
        self.stride = stride
        self.groups = groups
        self.tail = kernel_size - stride
        # kernel == 2 * stride (every Mimi layer): taps from one GEMM (dense) or a broadcast
        # multiply (one channel per group, Mimi's upsample), then a two-part overlap-add. cuDNN's
        # transposed convolutions picked kernels of 0.6 ms and more for some of these layers on
        # an H200. Other shapes go to cuDNN.
        self.mode = "cudnn"
        if kernel_size == 2 * stride and groups == 1:
            self.mode = "dense"
        elif kernel_size == 2 * stride and groups == in_channels == out_channels:
            self.mode = "depthwise"

    def state_specs(self) -> dict[str, StateSpec]:
        return {"tail": StateSpec((self.out_channels, self.tail))} if self.tail > 0 else {}

    def forward(self, x: torch.Tensor, exec_mask: torch.Tensor) -> torch.Tensor:
        rows, _, length = x.shape
        if self.mode == "dense":
            return self._two_part(self._dense_taps(x), exec_mask)
        if self.mode == "depthwise":
            return self._two_part(self._depthwise_taps(x), exec_mask)
        emitted = length * self.stride
        y = F.conv_transpose1d(x, self.conv.weight, None, self.stride, 0, 0, self.groups)
        if self.tail > 0:
            tail = self.state("tail", rows)
            y[..., : self.tail] += tail
            commit(tail, y[..., emitted:], exec_mask)
        y = y[..., :emitted]
        if self.conv.bias is not None:
            y = y + self.conv.bias[:, None]
        return y

    def _dense_taps(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, in, L] -> [rows, out, L, 2, stride]: every (input step, kernel tap) product."""
        rows, channels, length = x.shape
        kernel = self.conv.weight.shape[-1]
        # one GEMM over rows * L (a batched matmul would re-read the weight per row)
        flat = x.transpose(1, 2).reshape(rows * length, channels)
        taps = torch.mm(flat, self.conv.weight.reshape(channels, self.out_channels * kernel))
        return taps.view(rows, length, self.out_channels, 2, self.stride).permute(0, 2, 1, 3, 4)

    def _depthwise_taps(self, x: torch.Tensor) -> torch.Tensor:
        rows, channels, length = x.shape
        kernel = self.conv.weight.shape[-1]
        taps = x[..., None] * self.conv.weight.view(1, channels, 1, kernel)
        return taps.view(rows, channels, length, 2, self.stride)

    def _two_part(self, taps: torch.Tensor, exec_mask: torch.Tensor) -> torch.Tensor:
        """Overlap-add for kernel == 2 * stride: output step l = tap 0 of input l + tap 1 of input l-1."""
        rows, channels, length, _, stride = taps.shape
        tail = self.state("tail", rows)
        head, late = taps[:, :, :, 0], taps[:, :, :, 1]
        new_tail = late[:, :, -1].clone()
        out = torch.empty(rows, channels, length, stride, dtype=taps.dtype, device=taps.device)
        torch.add(head[:, :, :1], tail[:, :, None], out=out[:, :, :1])
        if length > 1:
            torch.add(head[:, :, 1:], late[:, :, :-1], out=out[:, :, 1:])
        commit(tail, new_tail, exec_mask)
        out = out.view(rows, channels, length * stride)
        if self.conv.bias is not None:
            out = out + self.conv.bias[:, None]
        return out


class ResnetBlock(nn.Module):
    """SEANet residual block: ELU, k-conv (dilated), ELU, 1x1 conv, plus the skip path."""

    def __init__(self, config: MimiCodecConfig, dim: int, dilation: int) -> None:
        super().__init__()
        hidden = dim // config.compress
        self.block = nn.ModuleList(
            [
                nn.ELU(),
                StreamingConv1d(
                    dim, hidden, config.residual_kernel_size, dilation=dilation, pad_mode=config.pad_mode
                ),
                nn.ELU(),
                StreamingConv1d(hidden, dim, 1, pad_mode=config.pad_mode),
            ]
        )
        self.shortcut = (
            StreamingConv1d(dim, dim, 1, pad_mode=config.pad_mode) if config.use_conv_shortcut else None
        )

    def forward(self, x: torch.Tensor, exec_mask: torch.Tensor) -> torch.Tensor:
        residual = x if self.shortcut is None else self.shortcut(x, exec_mask)
        return residual + _run(self.block, x, exec_mask)


def _run(layers: nn.ModuleList, x: torch.Tensor, exec_mask: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        if isinstance(layer, (StreamingConv1d, StreamingConvTranspose1d, ResnetBlock)):
            x = layer(x, exec_mask)
        else:
            x = layer(x)
    return x


class SeanetEncoder(nn.Module):
    """Audio [rows, 1, samples] -> features [rows, hidden, samples / hop_length]."""

    def __init__(self, config: MimiCodecConfig) -> None:
        super().__init__()
        pad = config.pad_mode
        layers: list[nn.Module] = [
            StreamingConv1d(config.audio_channels, config.num_filters, config.kernel_size, pad_mode=pad)
        ]
        scale = 1
        for ratio in reversed(config.upsampling_ratios):
            channels = scale * config.num_filters
            for j in range(config.num_residual_layers):
                layers.append(ResnetBlock(config, channels, config.dilation_growth_rate**j))
            layers.append(nn.ELU())
            layers.append(StreamingConv1d(channels, channels * 2, ratio * 2, stride=ratio, pad_mode=pad))
            scale *= 2
        layers.append(nn.ELU())
        layers.append(
            StreamingConv1d(
                scale * config.num_filters, config.hidden_size, config.last_kernel_size, pad_mode=pad
            )
        )
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor, exec_mask: torch.Tensor) -> torch.Tensor:
        return _run(self.layers, x, exec_mask)


class SeanetDecoder(nn.Module):
    """Features [rows, hidden, steps] -> audio [rows, 1, steps * hop_length]."""

    def __init__(self, config: MimiCodecConfig) -> None:
        super().__init__()
        pad = config.pad_mode
        scale = 2 ** len(config.upsampling_ratios)
        layers: list[nn.Module] = [
            StreamingConv1d(config.hidden_size, scale * config.num_filters, config.kernel_size, pad_mode=pad)
        ]
        for ratio in config.upsampling_ratios:
            channels = scale * config.num_filters
            layers.append(nn.ELU())
            layers.append(StreamingConvTranspose1d(channels, channels // 2, ratio * 2, ratio))
            for j in range(config.num_residual_layers):
                layers.append(ResnetBlock(config, channels // 2, config.dilation_growth_rate**j))
            scale //= 2
        layers.append(nn.ELU())
        layers.append(
            StreamingConv1d(config.num_filters, config.audio_channels, config.last_kernel_size, pad_mode=pad)
        )
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor, exec_mask: torch.Tensor) -> torch.Tensor:
        return _run(self.layers, x, exec_mask)
