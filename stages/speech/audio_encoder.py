"""The thinker's audio encoder run without host syncs: what transformers' ``Qwen3OmniMoeAudioEncoder``
derives from the feature lengths (the chunks and their padding, the valid positions after the
convolutions, the attention windows) is computed on the host, where the lengths are, and handed to
the module as its precomputed inputs.

Called with device lengths, as ``get_audio_features`` calls it, the encoder reads them back several
times (``.tolist()`` to split the chunks, ``.item()`` for the longest, a Python loop over the
windows, per-window splits in every attention layer) and each read waits for every kernel queued
before it: a prompt's prefill then holds the engine thread until the GPU has drained. Here the
features are padded on the host and go up once, in stream order (:func:`~..graphs.upload`), with
the valid positions; the window boundaries stay on the host for the attention's splits (or go up
too, for flash attention, which reads them on the device). The module's own forward runs on them:
the same operations on the same values as ``get_audio_features``.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    chunk_and_pad_features,
    get_audio_cu_seqlens,
    get_valid_indices,
)
from transformers.utils.generic import get_max_seqlen, is_flash_attention_requested

from ..graphs import upload


def encode_audio(
    tower: nn.Module, features: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The audio tokens [N, H] of ``features`` [n, mel, frames] with their ``mask`` [n, frames]
    (the processor's ``input_features`` and ``feature_attention_mask``, on the host), as
    ``get_audio_features(features, mask).last_hidden_state``, in ``dtype`` on ``device``."""
    lengths = mask.sum(-1)
    flat = features.permute(0, 2, 1)[mask.bool()].permute(1, 0)  # [mel, frames of all parts]
    padded, chunks = chunk_and_pad_features(flat, lengths, tower.n_window)
    valid = get_valid_indices(chunks, tower.n_window)
    windows = get_audio_cu_seqlens(chunks, lengths, tower.n_window_infer, tower.n_window)
    flash = is_flash_attention_requested(tower.config)
    out = tower(
        None,
        feature_lens=lengths,
        padded_feature=upload(padded.to(dtype), device),
        chunk_lengths=chunks,
        valid_indices=upload(valid, device),
        cu_seqlens=upload(windows, device) if flash else windows,
        max_seqlen=get_max_seqlen(windows, tower.config) if flash else None,
        return_dict=True,
    )
    return out.last_hidden_state.to(device, dtype)
