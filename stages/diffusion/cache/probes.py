"""What TeaCache measures, per model family: the modulated input of the first main transformer
block, computed from the call's state after ``start`` (the blocks themselves are not touched).

- Z-Image: ``layers[0].attention_norm1(x) * (1 + scale_msa)``, ``scale_msa`` the first chunk of
  ``layers[0].adaLN_modulation(adaln_input)``, over the image tokens (the leading ones of each
  row's unified sequence; the caption tokens after them do not change between steps);
- Wan: ``blocks[0].norm1(x) * (1 + scale_msa) + shift_msa`` with ``shift_msa, scale_msa`` the
  first two chunks of ``blocks[0].scale_shift_table + timestep_proj``.

Both return ``[rows, tokens, dim]``. The cached quantity (the residual of the main block stack)
is read from the state's ``hidden`` by :mod:`.state`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Probe = Callable[[Any], torch.Tensor]


def zimage_probe(transformer: Any, patch: int = 2, f_patch: int = 1) -> Probe:
    layer = transformer.layers[0]

    @torch.no_grad()
    def probe(state: Any) -> torch.Tensor:
        f, h, w = state.sizes[0]
        tokens = (f // f_patch) * (h // patch) * (w // patch)
        x = state.hidden[:, :tokens]
        scale = 1.0 + layer.adaLN_modulation(state.adaln_input).unsqueeze(1).chunk(4, dim=2)[0]
        return layer.attention_norm1(x) * scale

    return probe


def wan_probe(transformer: Any) -> Probe:
    block = transformer.blocks[0]

    @torch.no_grad()
    def probe(state: Any) -> torch.Tensor:
        shift, scale = (block.scale_shift_table + state.timestep_proj.float()).chunk(6, dim=1)[:2]
        return block.norm1(state.hidden.float()) * (1 + scale) + shift

    return probe


def probe_for(denoiser: Any) -> Probe | None:
    """The probe of ``denoiser``'s family, or None for a family without one."""
    transformer = getattr(denoiser, "transformer", None)
    family = getattr(denoiser, "family", None)
    if transformer is None:
        return None
    if family == "z-image":
        return zimage_probe(transformer)
    if family == "wan":
        return wan_probe(transformer)
    return None
