"""W8A8 DiTs: a diffusers transformer's linear layers swapped for :class:`W8A8Linear` (8-bit
weights with one scale per output channel, activations quantized per token on every call:
``kernels/w8a8.py``), one layer at a time.

Which layers stay in the model's dtype is per model (:data:`KEEP`): embeddings and projections in
and out of the transformer, the timestep and caption paths, the modulation; the attention and
feed-forward layers of the blocks (nearly all the parameters and FLOPs) are quantized. ``keep``
adds name patterns (``fnmatch``: ``"layers.0.*"`` keeps the first block, if quality asks).

Layers that read one input can be merged (:func:`merge_projections`; ``fused.install`` does it
when the pipeline is built, so checkpoints and :func:`quantize_model` keep diffusers' layout): one
activation quantization and one product where there were three (attention's q, k and v:
``to_qkv``; Wan's cross-attention k and v: ``to_kv``) or two (Z-Image's gated feed-forward ``w1``
and ``w3``: ``w13``). The old names stay as :class:`W8A8Slice` views of the merged weight, so
diffusers' own processors still find them; ``stages/diffusion/fused.py``'s forwards use the merged
layer.

Quantizing online, each layer's weight goes to ``device``, is quantized there and the full-width
copy is dropped before the next layer: on a model loaded on the CPU, peak device memory stays near
the quantized model's size.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ...kernels.w8a8 import Kind, QuantizedRows, check_kind, quantize_rows, w8a8_linear

log = logging.getLogger(__name__)

QUANTIZATIONS = ("none", "int8", "fp8")

#: Layers kept in the model's dtype, per transformer class (``fnmatch`` patterns of module names).
KEEP: dict[str, tuple[str, ...]] = {
    "ZImageTransformer2DModel": (
        "all_x_embedder*", "cap_embedder*", "t_embedder*", "all_final_layer*", "siglip_embedder*",
        "*adaLN_modulation*",
    ),
    "WanTransformer3DModel": ("condition_embedder*", "proj_out", "patch_embedding"),
}  # fmt: skip


class W8A8Linear(nn.Module):
    """``nn.Linear`` with an 8-bit weight (``qweight`` [out, in], ``weight_scale`` [out, 1] fp32)
    and per-token activation quantization; returns the input's dtype."""

    def __init__(
        self, qweight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, kind: Kind
    ) -> None:
        super().__init__()
        self.kind = check_kind(kind)
        self.in_features = qweight.shape[1]
        self.out_features = qweight.shape[0]
        self.register_buffer("qweight", qweight)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, kind: Kind, device: torch.device | None = None) -> W8A8Linear:
        weight = linear.weight.detach()
        if device is not None:
            weight = weight.to(device)
        qweight, scale = quantize_rows(weight, kind)
        bias = None if linear.bias is None else linear.bias.detach().to(qweight.device)
        return cls(qweight, scale, bias, kind)

    def forward(
        self, x: torch.Tensor | QuantizedRows, peak: torch.Tensor | None = None, peak_from: int = 0
    ) -> torch.Tensor:
        """The product; ``peak`` (fp32 [1]): raised to the largest magnitude of its output columns
        ``peak_from`` on (:func:`~omnirt.kernels.w8a8.w8a8_linear`)."""
        return w8a8_linear(x, self.qweight, self.weight_scale, self.bias, self.kind, peak, peak_from)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}"


class W8A8Slice(nn.Module):
    """Output channels ``start:stop`` of a merged :class:`W8A8Linear` (``to_q`` once q, k and v are
    ``to_qkv``): the same product as the layer it replaced, on a view of the merged weight. It
    holds no tensors (the merged layer, a submodule of the same parent, owns them), so moving or
    counting the model sees each weight once."""

    def __init__(self, merged: W8A8Linear, start: int, stop: int) -> None:
        super().__init__()
        self._merged = (merged,)  # a tuple: not registered as a submodule
        self.start, self.stop = start, stop
        self.kind = merged.kind
        self.in_features = merged.in_features
        self.out_features = stop - start

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        m, part = self._merged[0], slice(self.start, self.stop)
        bias = None if m.bias is None else m.bias[part]
        return w8a8_linear(x, m.qweight[part], m.weight_scale[part], bias, m.kind)

    def extra_repr(self) -> str:
        return f"out_features {self.start}:{self.stop} of a merged {self.kind} layer"


def merge_layers(owner: nn.Module, names: Sequence[str], merged_name: str) -> W8A8Linear | None:
    """``owner``'s W8A8 layers ``names`` (one input width and kind, all with a bias or none) as one
    layer ``merged_name`` whose outputs are theirs side by side, the old names left as
    :class:`W8A8Slice` views of it; None (nothing changed) where they are not such layers."""
    layers = [getattr(owner, name, None) for name in names]
    if not all(type(layer) is W8A8Linear for layer in layers):
        return None
    first = layers[0]
    if any(
        layer.kind != first.kind or layer.in_features != first.in_features
        or layer.qweight.device != first.qweight.device or (layer.bias is None) != (first.bias is None)
        for layer in layers
    ):  # fmt: skip
        return None
    merged = W8A8Linear(
        torch.cat([layer.qweight for layer in layers]),
        torch.cat([layer.weight_scale for layer in layers]),
        None if first.bias is None else torch.cat([layer.bias for layer in layers]),
        first.kind,
    )
    setattr(owner, merged_name, merged)
    start = 0
    for name, layer in zip(names, layers, strict=True):
        setattr(owner, name, W8A8Slice(merged, start, start + layer.out_features))
        start += layer.out_features
    return merged


def merge_projections(model: nn.Module) -> int:
    """Merges the W8A8 layers of ``model`` that read one input (the module docstring lists them);
    returns how many merged layers were made."""
    from diffusers.models.transformers.transformer_wan import WanAttention
    from diffusers.models.transformers.transformer_z_image import FeedForward as ZImageFeedForward
    from diffusers.models.transformers.transformer_z_image import ZImageTransformerBlock

    made = 0
    for module in list(model.modules()):
        if isinstance(module, ZImageTransformerBlock):
            made += merge_layers(module.attention, ("to_q", "to_k", "to_v"), "to_qkv") is not None
        elif isinstance(module, ZImageFeedForward):
            made += merge_layers(module, ("w1", "w3"), "w13") is not None
        elif (
            isinstance(module, WanAttention)
            and not getattr(module, "fused_projections", False)  # (set by diffusers' fuse only)
            and module.add_k_proj is None
        ):
            # diffusers' own path reads the merged layers once ``fused_projections`` is set
            if module.is_cross_attention:
                merged = merge_layers(module, ("to_k", "to_v"), "to_kv")
            else:
                merged = merge_layers(module, ("to_q", "to_k", "to_v"), "to_qkv")
            if merged is not None:
                module.fused_projections = True
                made += 1
    return made


@dataclass(frozen=True)
class QuantizedModel:
    """What :func:`quantize_model` did."""

    kind: str
    layers: int
    kept: int
    bytes_before: int
    bytes_after: int


def _kept(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def quantize_model(
    model: nn.Module, kind: str, *, device: torch.device | str | None = None, keep: Iterable[str] = ()
) -> QuantizedModel:
    """Swaps ``model``'s linear layers for :class:`W8A8Linear` in place, except those of
    :data:`KEEP` for its class and ``keep``; each layer quantized on ``device`` (default: where
    its weight is). Refuses an unknown ``kind`` with ValueError."""
    kind = check_kind(kind)
    patterns = KEEP.get(type(model).__name__, ()) + tuple(keep)
    target = torch.device(device) if device is not None else None
    before = sum(p.numel() * p.element_size() for p in model.parameters())
    swapped = kept = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        if _kept(name, patterns):
            kept += 1
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, W8A8Linear.from_linear(module, kind, target))
        del module
        swapped += 1
    if target is not None:
        model.to(target)
    after = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers()
    )
    result = QuantizedModel(kind, swapped, kept, before, after)
    log.info(
        "%s: %d linear layers in %s (%d kept), %.2f -> %.2f GiB of weights",
        type(model).__name__, swapped, kind, kept, before / 2**30, after / 2**30,
    )  # fmt: skip
    return result

