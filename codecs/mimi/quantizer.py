"""Mimi's split residual vector quantizer (1 semantic + N acoustic codebooks), stateless.

It always computes in float32, whatever dtype the convolutions use: distances are taken in
float32 as transformers does (``cdist`` on ``.float()`` inputs), and the decoded latents are
cast to the convolution dtype by the caller.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import MimiCodecConfig

CODEBOOK_EPSILON = 1e-5


class SplitResidualQuantizer(nn.Module):
    """Codes [rows, K, frames] <-> latents [rows, hidden, frames] with K = ``num_quantizers``."""

    def __init__(self, config: MimiCodecConfig, num_quantizers: int) -> None:
        super().__init__()
        if not config.num_semantic_quantizers < num_quantizers <= config.num_quantizers:
            raise ValueError(
                f"num_quantizers must be in ({config.num_semantic_quantizers}, {config.num_quantizers}], "
                f"got {num_quantizers}"
            )
        self.num_quantizers = num_quantizers
        self.num_semantic = config.num_semantic_quantizers
        self.codebook_size = config.codebook_size
        dim, hidden = config.vector_quantization_hidden_dimension, config.hidden_size
        self.projected = dim != hidden
        shape_in, shape_out = (dim, hidden, 1), (hidden, dim, 1)
        zeros = torch.zeros
        self.semantic_input_proj = nn.Parameter(zeros(shape_in), requires_grad=False)
        self.semantic_output_proj = nn.Parameter(zeros(shape_out), requires_grad=False)
        self.acoustic_input_proj = nn.Parameter(zeros(shape_in), requires_grad=False)
        self.acoustic_output_proj = nn.Parameter(zeros(shape_out), requires_grad=False)
        self.register_buffer("codebooks", zeros(num_quantizers, config.codebook_size, config.codebook_dim))
        self.register_buffer("codebook_norms", zeros(num_quantizers, config.codebook_size))
        # where codebook k starts in the stacked tables (``decode`` looks all of them up at once)
        self.register_buffer(
            "code_offsets", torch.arange(num_quantizers) * config.codebook_size, persistent=False
        )

    def set_codebooks(self, embed_sums: list[torch.Tensor], cluster_usages: list[torch.Tensor]) -> None:
        """Codebook k is ``embed_sum / cluster_usage.clamp(min=1e-5)``, as transformers computes it."""
        tables = [
            s / u.clamp(min=CODEBOOK_EPSILON)[:, None]
            for s, u in zip(embed_sums, cluster_usages, strict=True)
        ]
        stacked = torch.stack(tables).float()
        self.codebooks.copy_(stacked)
        self.codebook_norms.copy_((stacked * stacked).sum(-1))

    def _project(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.conv1d(x, weight) if self.projected else x

    def encode(self, latents: torch.Tensor) -> torch.Tensor:
        x = latents.float()
        codes: list[torch.Tensor] = []
        residual = x
        for k in range(self.num_quantizers):
            if k == 0:
                residual = self._project(x, self.semantic_input_proj).transpose(1, 2)
            elif k == self.num_semantic:
                residual = self._project(x, self.acoustic_input_proj).transpose(1, 2)
            table = self.codebooks[k]
            flat = residual.reshape(-1, residual.shape[-1])
            # argmin of |r - e|^2 = |r|^2 - 2 r.e + |e|^2; |r|^2 is the same for every entry.
            index = torch.addmm(self.codebook_norms[k], flat, table.T, alpha=-2.0).argmin(dim=-1)
            index = index.view(residual.shape[:-1])
            codes.append(index)
            residual = residual - F.embedding(index, table)
        return torch.stack(codes, dim=1)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        # one lookup in the stacked tables for every codebook, then a sum per group
        offsets = self.code_offsets[:, None]
        vectors = F.embedding(codes + offsets, self.codebooks.view(-1, self.codebooks.shape[-1]))
        semantic = vectors[:, : self.num_semantic].sum(dim=1).transpose(1, 2)
        acoustic = vectors[:, self.num_semantic :].sum(dim=1).transpose(1, 2)
        out = self._project(semantic, self.semantic_output_proj)
        return out + self._project(acoustic, self.acoustic_output_proj)
