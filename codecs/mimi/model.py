"""Streaming Mimi: encoder (audio -> codes) and decoder (codes -> audio) over slot-pooled state.

``StreamingMimi`` holds the weights (named as in the published checkpoint) and, after
``alloc_state``, the state of ``max_slots`` streams. ``encode_step`` / ``decode_step`` run a
chunk of whole frames for the first ``rows`` slots; rows whose exec-mask entry is False keep
their state and get zeros out. They do no validation and no host sync, so they can be
captured in a CUDA graph; ``MimiSlotPool`` (``pool.py``) is the checked API around them.
"""

from __future__ import annotations

import torch
from torch import nn

from ..streaming import streaming_modules
from .config import MimiCodecConfig
from .conv import SeanetDecoder, SeanetEncoder, StreamingConv1d, StreamingConvTranspose1d
from .quantizer import SplitResidualQuantizer
from .transformer import StreamingTransformer


class StreamingMimi(nn.Module):
    def __init__(self, config: MimiCodecConfig, num_quantizers: int | None = None) -> None:
        super().__init__()
        self.config = config
        stride = config.latent_stride
        hidden = config.hidden_size
        self.encoder = SeanetEncoder(config)
        self.encoder_transformer = StreamingTransformer(config, tokens_per_step=stride)
        self.downsample = StreamingConv1d(
            hidden, hidden, 2 * stride, stride, bias=False, pad_mode="replicate"
        )
        self.quantizer = SplitResidualQuantizer(config, num_quantizers or config.num_quantizers)
        self.upsample = StreamingConvTranspose1d(
            hidden, hidden, 2 * stride, stride, groups=config.upsample_groups, bias=False
        )
        self.decoder_transformer = StreamingTransformer(config, tokens_per_step=stride)
        self.decoder = SeanetDecoder(config)
        self.max_slots = 0

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the convolutions and transformers (the quantizer stays float32)."""
        return self.encoder.layers[0].conv.weight.dtype

    @property
    def num_quantizers(self) -> int:
        return self.quantizer.num_quantizers

    @property
    def frame_size(self) -> int:
        return self.config.frame_size

    def _halves(self) -> dict[str, list[nn.Module]]:
        return {
            "encoder": [self.encoder, self.encoder_transformer, self.downsample],
            "decoder": [self.upsample, self.decoder_transformer, self.decoder],
        }

    def alloc_state(self, max_slots: int) -> None:
        """Allocates the state of ``max_slots`` streams (all reset), on the weights' device/dtype."""
        if max_slots < 1:
            raise ValueError(f"max_slots must be at least 1, got {max_slots}")
        weight = self.encoder.layers[0].conv.weight
        for _, module in streaming_modules(self):
            module.alloc_state(max_slots, weight.device, weight.dtype)
        self.max_slots = max_slots

    def reset_slot(self, slot: int, encoder: bool = True, decoder: bool = True) -> None:
        halves = self._halves()
        for half in [h for h, on in (("encoder", encoder), ("decoder", decoder)) if on]:
            for part in halves[half]:
                for _, module in streaming_modules(part):
                    module.reset_slot(slot)

    def state_buffers(self) -> dict[str, torch.Tensor]:
        """Every state buffer by qualified name (for snapshots in tests and tools)."""
        return {
            f"{name}.{key}": buffer
            for name, module in streaming_modules(self)
            for key, buffer in module.state_buffers().items()
        }

    @torch.no_grad()
    def encode_step(self, audio: torch.Tensor, exec_mask: torch.Tensor) -> torch.Tensor:
        """Audio [rows, n * frame_size] (any float dtype) -> codes [rows, K, n] (int64)."""
        x = audio.to(self.dtype)[:, None, :]
        x = self.encoder(x, exec_mask)
        x = self.encoder_transformer(x.transpose(1, 2), exec_mask).transpose(1, 2)
        latents = self.downsample(x, exec_mask)
        codes = self.quantizer.encode(latents)
        return torch.where(exec_mask[:, None, None], codes, torch.zeros_like(codes))

    @torch.no_grad()
    def decode_step(self, codes: torch.Tensor, exec_mask: torch.Tensor) -> torch.Tensor:
        """Codes [rows, K, n] -> audio [rows, n * frame_size] (float32)."""
        x = self.quantizer.decode(codes).to(self.dtype)
        x = self.upsample(x, exec_mask)
        x = self.decoder_transformer(x.transpose(1, 2), exec_mask).transpose(1, 2)
        audio = self.decoder(x, exec_mask)[:, 0].float()
        return torch.where(exec_mask[:, None], audio, torch.zeros_like(audio))
