"""A decoder layer's projections that read one input, as one product each.

At the batch sizes of a decode step (1 to 128 rows) every matrix product is a small kernel, and a
graphed step's time is mostly how many kernels it runs (the talker's frame step ran 3,862 at 8
sessions, 2026-12-03): q, k and v as one product ``[q; k; v]``, and a SiLU-gated MLP's gate and
up as one ``[gate; up]`` followed by one ``silu(gate) * up`` launch (``kernels/swiglu.py``), take
three launches of each attention and three of each such MLP out of a step.

:func:`merge_layer` concatenates the weights once and hands each ``nn.Linear`` a view of its rows
of the merged tensor: nothing is stored twice, transformers' own forwards (the parity references,
any path that calls the modules) read the same weights, and a later in-place load writes through.
The product of the merged weight equals the separate products up to the order a GEMM kernel sums
in (cuBLAS may pick another kernel for the wider output), as any change of batch size does.
:meth:`MergedLayer.attention_output` is the layer's other decode product, the attention's output
projection, with a kernel of its own at one row (``kernels/gemv.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels import gemv as few_rows
from ...kernels import settings as kernel_settings
from ...kernels.swiglu import swiglu

#: The few-row kernel's launch for one row's attention output (BLOCK_N, BLOCK_K, warps, stages,
#: split): ``benchmarks/few_row_products.py`` on the H200 (2026-12-04), one row, 1024 x 2048.
ONE_ROW_LAUNCH = (16, 256, 4, 3, 4)
#: The largest output weight (elements) it takes: the talker's and code predictor's 1024 x 2048
#: (cuBLAS 10.0-12.4 us, the kernel 4.7); the thinker's 2048 x 4096 stays with cuBLAS (7.1 us, the
#: kernel 8.6).
ONE_ROW_MAX_WEIGHT = 1024 * 2048
#: The dtypes it runs in (measured in bf16; fp32 steps, the parity runs against transformers, keep
#: cuBLAS's products).
HALF = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class MergedLayer:
    """The merged weights of one decoder layer (``None`` where its modules could not merge)."""

    qkv: torch.Tensor | None  # [q + 2 kv, hidden]
    qkv_bias: torch.Tensor | None
    q_size: int
    kv_size: int
    gate_up: torch.Tensor | None  # [2 inner, hidden]
    inner: int

    def project(
        self, attn: nn.Module, h: torch.Tensor, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``h`` [B, T, hidden] -> q, k, v [B, T, heads, D] (views of one product where merged)."""
        batch, tokens = h.shape[:2]
        if self.qkv is None:
            return tuple(  # type: ignore[return-value]
                proj(h).view(batch, tokens, -1, head_dim) for proj in (attn.q_proj, attn.k_proj, attn.v_proj)
            )
        out = F.linear(h, self.qkv, self.qkv_bias)
        q, kv = self.q_size, self.kv_size
        return (
            out[..., :q].view(batch, tokens, -1, head_dim),
            out[..., q : q + kv].view(batch, tokens, -1, head_dim),
            out[..., q + kv :].view(batch, tokens, -1, head_dim),
        )

    def attention_output(self, attn: nn.Module, a: torch.Tensor) -> torch.Tensor:
        """``attn.o_proj`` of the attention's ``a`` [B, T, heads * D]. For one row (a decode step of
        one slot, on CUDA) the few-row kernel (``kernels/gemv.py``): cuBLAS's one-row kernel for
        the talker's and code predictor's 1024 x 2048 product took 10.0-12.4 us on the H200
        against the kernel's 4.7 (at 8 rows cuBLAS takes 5.1, and the kernel no less; larger
        weights: :data:`ONE_ROW_MAX_WEIGHT`; bf16 and fp16 only); another summation order, as any
        change of GEMM kernel (module docstring)."""
        o = attn.o_proj
        one_row = a.shape[0] * a.shape[1] == 1 and a.dtype in HALF and kernel_settings.FUSED != "off"
        if one_row and type(o) is nn.Linear and o.bias is None and o.weight.numel() <= ONE_ROW_MAX_WEIGHT:
            row = a.reshape(1, -1)
            if few_rows.kernel_applies(row, o.weight):
                return few_rows.gemv(row, o.weight, launch=ONE_ROW_LAUNCH).view(*a.shape[:2], -1)
        return o(a)

    def mlp(self, mlp: nn.Module, h: torch.Tensor) -> torch.Tensor:
        """The layer's MLP of ``h``: ``down(silu(gate(h)) * up(h))`` from the merged product where
        merged, else the module itself (a sparse MoE block, another activation)."""
        if self.gate_up is None:
            return mlp(h)
        out = F.linear(h, self.gate_up)
        return mlp.down_proj(swiglu(out[..., : self.inner], out[..., self.inner :]))


def _plain_linears(*modules: object) -> bool:
    """Whether these are ``nn.Linear`` of one dtype and device, all with a bias or none."""
    if not all(type(m) is nn.Linear for m in modules):
        return False
    weights = [m.weight for m in modules]  # type: ignore[union-attr]
    biased = {m.bias is not None for m in modules}  # type: ignore[union-attr]
    same = len({(w.dtype, w.device, w.shape[1]) for w in weights}) == 1
    return same and len(biased) == 1


def _merge(linears: list[nn.Linear], name: str) -> torch.Tensor:
    """One tensor of the weights (or biases: ``name``) of ``linears``, stacked by output rows; each
    module's parameter becomes a view of its rows."""
    merged = torch.cat([getattr(m, name).detach() for m in linears])
    start = 0
    for m in linears:
        rows = m.out_features
        setattr(m, name, nn.Parameter(merged[start : start + rows], requires_grad=False))
        start += rows
    return merged


def _silu_gated(mlp: nn.Module) -> bool:
    act = getattr(mlp, "act_fn", None)
    parts = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    silu = isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"
    if not silu or any(p is None for p in parts) or not _plain_linears(*parts[:2]):
        return False
    return parts[0].out_features == parts[1].out_features  # type: ignore[union-attr]


@torch.no_grad()
def merge_layer(layer: nn.Module) -> MergedLayer:
    """Merges ``layer.self_attn``'s q, k, v and, for a SiLU-gated dense ``layer.mlp``, its gate and up
    (see the module docstring); modules of another shape are left as they are."""
    attn = layer.self_attn
    qkv = bias = gate_up = None
    q_size = kv_size = inner = 0
    projections = [attn.q_proj, attn.k_proj, attn.v_proj]
    if _plain_linears(*projections) and attn.k_proj.out_features == attn.v_proj.out_features:
        q_size, kv_size = attn.q_proj.out_features, attn.k_proj.out_features
        qkv = _merge(projections, "weight")
        bias = _merge(projections, "bias") if attn.q_proj.bias is not None else None
    mlp = layer.mlp
    if _silu_gated(mlp) and mlp.gate_proj.bias is None:
        inner = mlp.gate_proj.out_features
        gate_up = _merge([mlp.gate_proj, mlp.up_proj], "weight")
    return MergedLayer(qkv, bias, q_size, kv_size, gate_up, inner)
