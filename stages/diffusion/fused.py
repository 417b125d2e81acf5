"""The fused kernels of ``kernels/`` inside diffusers' DiT models, installed per model instance.

- **Z-Image** (``ZImageTransformer2DModel``): each ``ZSingleStreamAttnProcessor`` is replaced by
  :class:`ZImageFusedProcessor`, which normalises and rotates the queries and keys with
  ``qk_norm_rope`` (per-head composite RMSNorm, complex64 rotary) and otherwise does what the
  original does, line for line. Each ``ZImageTransformerBlock`` runs :func:`zimage_block_forward`,
  diffusers' block with each RMSNorm and the product and sum after it (``norm(x) * scale``,
  ``x + gate * norm(out)``) as one ``rms_norm_modulate`` (with ``PAIRED_NORMS``, the update after
  the attention and the feed-forward's norm of the new stream as one ``rms_norm_modulate_pair``),
  and each ``FeedForward`` runs
  :func:`zimage_feed_forward` (``silu(w1(x)) * w3(x)`` in one ``swiglu`` launch). With W8A8
  weights, whose layers that read one input :func:`install` merges (``quant.merge_projections``:
  ``to_qkv``, ``w13``), the norm before the attention and the one before the feed-forward write
  their output quantized (``rms_norm_modulate_quantize``), q, k and v come from one product, and
  the gated unit writes ``w2``'s input quantized (``swiglu_w8a8``: where the Triton GEMM runs
  ``w13``, the gated unit is its epilogue and a pass quantizes it; else ``swiglu_quantize`` after
  the product). No other activation is quantized in a pass of its own but the attention's output,
  and with fp8 attention not that either (cuDNN writes it in e4m3 for the fp8 ``to_out``); with
  ``V_PEAK_IN_PRODUCT``, V's per-tensor scale for the fp8 attention comes from ``to_qkv``'s
  epilogue. (Both settings are off: on an H100 the paired norms gained nothing and V's peak is
  not yet measured in a whole step; docs/benchmarks.md.)
- **Wan** (``WanTransformer3DModel``): each self-attention's ``WanAttnProcessor`` is replaced by
  :class:`WanFusedProcessor` (RMSNorm across heads as ``torch.nn.RMSNorm`` computes it, fp32
  rotary); cross-attention keeps the original. Each ``WanTransformerBlock`` runs
  :func:`wan_block_forward`, diffusers' block with ``norm1``/``norm3`` and their modulation as one
  ``adaln_modulate`` each and its two gated residual adds as one ``gated_residual`` each.

The kernels' dispatchers decide per call: on the CPU, or where ``kernels.settings.FUSED`` does not
ask for a chain, the eager chain runs, which computes exactly what the original modules compute.
:func:`install` is what the loaders call; ``FUSED = "off"`` leaves the models untouched.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import torch

from ...kernels import fp8_attention, settings
from ...kernels.adaln import adaln_modulate
from ...kernels.gated_residual import gated_residual
from ...kernels.qk_norm_rope import qk_norm_rope, table_from_complex, table_from_interleaved
from ...kernels.rms_norm import rms_norm_modulate, rms_norm_modulate_pair, rms_norm_modulate_quantize
from ...kernels.settings import Preset
from ...kernels.swiglu import swiglu, swiglu_w8a8
from ...kernels.w8a8 import QuantizedRows
from .quant import W8A8Linear, merge_projections

log = logging.getLogger(__name__)


class _FusedProcessor:
    """A diffusers attention processor's replacement: keeps the original (for the calls it does
    not fuse, and for :func:`uninstall`) and its attention backend settings."""

    def __init__(self, original: Any, preset: Preset = "exact") -> None:
        self.original = original
        self.preset = preset
        self._attention_backend = getattr(original, "_attention_backend", None)
        self._parallel_config = getattr(original, "_parallel_config", None)


def _fp8_block(attn: Any) -> bool:
    """Whether ``attn``'s projections are fp8 W8A8 layers and :data:`~omnirt.kernels.settings.FP8_ATTENTION`
    asks for fp8 attention in such blocks."""
    if settings.FP8_ATTENTION != "on":
        return False
    projection = getattr(attn, "to_qkv", None) or getattr(attn, "to_q", None)
    return isinstance(projection, W8A8Linear) and projection.kind == "fp8"


#: Whether an fp8 block's attention hands its output to an fp8 ``to_out`` as cuDNN writes it, in
#: e4m3 at V's scale (``fp8_attention(..., quantized_out=True)``: no quantization pass of its own
#: before that product), or in the model's dtype (``benchmarks/quant_vae.py`` compares the two).
FP8_ATTENTION_E4M3_OUT = True


def _e4m3_out(attn: Any) -> bool:
    """Whether ``attn``'s fp8 attention writes its output in e4m3 for ``to_out`` (an fp8 W8A8 layer)."""
    to_out = attn.to_out[0] if isinstance(getattr(attn, "to_out", None), torch.nn.ModuleList) else None
    return FP8_ATTENTION_E4M3_OUT and isinstance(to_out, W8A8Linear) and to_out.kind == "fp8"


def _fp8_lengths(
    attn: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
    prefix_keys: bool,
) -> tuple[bool, torch.Tensor | None]:  # fmt: skip
    """Whether this attention runs in fp8 (an fp8 block, :func:`_fp8_block`, where cuDNN's fp8
    attention applies; ``query`` and ``key`` as they come from the projections), and the key
    lengths it takes: ``prefix_keys``, a 2D ``mask`` is [B, S_kv] booleans, each row's live keys a
    prefix (as diffusers' Z-Image builds them); any other mask keeps the attention in bf16."""
    keys_2d = prefix_keys and mask is not None and mask.ndim == 2 and mask.dtype == torch.bool
    if not _fp8_block(attn) or not (mask is None or keys_2d):
        return False, None
    lengths = None if mask is None else mask.sum(dim=-1, dtype=torch.int32)
    return fp8_attention.applies(query, key, value, lengths, quantized_out=_e4m3_out(attn)), lengths


def _qk_scales(attn: Any, elements: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed e4m3 scales of ``attn``'s normed, rotated queries and keys
    (``fp8_attention.normed_scale`` of its norms' weights, over ``elements`` each), kept on the
    module while its weights stay the ones they were taken from."""
    weights = (attn.norm_q.weight, attn.norm_k.weight)
    key = tuple(None if w is None else (w.data_ptr(), w._version) for w in weights) + elements
    kept = getattr(attn, "_omnirt_fp8_qk_scales", None)
    if kept is None or kept[0] != key:
        scales = tuple(fp8_attention.normed_scale(w, n) for w, n in zip(weights, elements, strict=True))
        kept = (key, scales)
        attn._omnirt_fp8_qk_scales = kept
    return kept[1]


def _attention(
    processor: _FusedProcessor, attn: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    table: torch.Tensor, mask: torch.Tensor | None, *, per_head: bool, norm: str, rope: str,
    prefix_keys: bool, v_peak: torch.Tensor | None = None,
) -> torch.Tensor | QuantizedRows:  # fmt: skip
    """Queries and keys (as projected, [B, S, H, D]) normed and rotated by :func:`qk_norm_rope`,
    then attention over ``value``: in fp8 where :func:`_fp8_lengths` says so (the norm writing e4m3
    at fixed scales, :func:`_qk_scales`; the output [B, S, H * D] in e4m3 for ``to_out`` where
    :func:`_e4m3_out`), else through diffusers' dispatcher with the processor's backend, as the
    original processor calls it (a 2D prefix ``mask`` given as [B, 1, 1, S_kv]). ``v_peak``:
    ``value``'s largest magnitude where its product found it (:func:`_v_peak`)."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    args = dict(eps=attn.norm_q.eps, interleaved=True, per_head=per_head, norm=norm, rope=rope)
    args["preset"] = processor.preset
    weights = (attn.norm_q.weight, attn.norm_k.weight)
    fp8, lengths = _fp8_lengths(attn, query, key, value, mask, prefix_keys)
    if fp8:
        heads = (1, 1) if per_head else (query.shape[-2], key.shape[-2])  # normed over a head, or all
        q_scale, k_scale = _qk_scales(attn, (query.shape[-1] * heads[0], key.shape[-1] * heads[1]))
        query, key = qk_norm_rope(query, key, *weights, table, out_scales=(q_scale, k_scale), **args)
        return fp8_attention.fp8_attention(
            query, key, value, lengths, q_scale=q_scale, k_scale=k_scale, quantized_out=_e4m3_out(attn),
            v_peak=v_peak,
        )
    query, key = qk_norm_rope(query, key, *weights, table, **args)
    if prefix_keys and mask is not None and mask.ndim == 2:
        mask = mask[:, None, None, :]
    return dispatch_attention_fn(
        query, key, value, attn_mask=mask, dropout_p=0.0, is_causal=False,
        backend=processor._attention_backend, parallel_config=processor._parallel_config,
    )  # fmt: skip


#: Whether a merged fp8 QKV product finds V's peak for an fp8 attention (:func:`_v_peak`); False:
#: V's quantization finds it in a pass of its own (the same bits). Off: no faster in a whole Z-Image
#: step on an H100 (61.9 ms by graph replays against 61.6 apart; docs/benchmarks.md, 2026-12-07).
V_PEAK_IN_PRODUCT = False


def _v_peak(attn: Any, hidden_states: torch.Tensor | QuantizedRows) -> torch.Tensor | None:
    """A zeroed fp32 [1] for V's peak where ``attn``'s merged fp8 QKV product on CUDA feeds an fp8
    attention (:func:`_fp8_block`) and :data:`V_PEAK_IN_PRODUCT` holds: the product (its epilogue,
    where the Triton GEMM runs it) finds V's largest magnitude, so V's per-tensor quantization
    reads V once, not twice; else None."""
    values = hidden_states.values if isinstance(hidden_states, QuantizedRows) else hidden_states
    if not (V_PEAK_IN_PRODUCT and values.is_cuda and _fp8_block(attn)):
        return None
    return torch.zeros(1, dtype=torch.float32, device=values.device)


class ZImageFusedProcessor(_FusedProcessor):
    """diffusers' ``ZSingleStreamAttnProcessor`` (0.42) with the QK norm and rotary fused."""

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        freqs_cis: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if freqs_cis is None or attn.norm_q is None or attn.norm_k is None:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, freqs_cis)
        to_qkv = getattr(attn, "to_qkv", None)
        v_peak = None
        if isinstance(to_qkv, W8A8Linear):  # merged W8A8 layers: one product (its input maybe quantized)
            v_peak = _v_peak(attn, hidden_states)  # (V: the last third of the product's columns)
            qkv = to_qkv(hidden_states, v_peak, to_qkv.out_features // 3 * 2)
            query, key, value = qkv.unflatten(-1, (3, attn.heads, -1)).unbind(-3)
        else:
            query = attn.to_q(hidden_states).unflatten(-1, (attn.heads, -1))
            key = attn.to_k(hidden_states).unflatten(-1, (attn.heads, -1))
            value = attn.to_v(hidden_states).unflatten(-1, (attn.heads, -1))
        out = _attention(
            self, attn, query, key, value, table_from_complex(freqs_cis), attention_mask, per_head=True,
            norm="composite", rope="complex", prefix_keys=True, v_peak=v_peak,
        )  # fmt: skip
        if not isinstance(out, QuantizedRows):  # (else e4m3 for the fp8 to_out)
            out = out.flatten(2, 3).to(value.dtype)
        out = attn.to_out[0](out)
        if len(attn.to_out) > 1:  # dropout
            out = attn.to_out[1](out)
        return out


class WanFusedProcessor(_FusedProcessor):
    """diffusers' ``WanAttnProcessor`` (0.42) for self-attention (text to video: no image keys),
    with the QK norm across heads and the rotary fused."""

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if rotary_emb is None or encoder_hidden_states is not None or attn.add_k_proj is not None:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        from diffusers.models.transformers.transformer_wan import _get_qkv_projections

        query, key, value = _get_qkv_projections(attn, hidden_states, None)
        heads = attn.heads
        # fp32 rotary tables (as loaded: ``rope`` is kept in fp32) rotate in fp32 with one
        # rounding; tables cast to the model's dtype round every product, as eager does then
        rope = "float32" if rotary_emb[0].dtype == torch.float32 else "io"
        out = _attention(
            self, attn, query.unflatten(2, (heads, -1)), key.unflatten(2, (heads, -1)),
            value.unflatten(2, (heads, -1)), table_from_interleaved(*rotary_emb), attention_mask,
            per_head=False, norm="fused", rope=rope, prefix_keys=False,
        )  # fmt: skip
        if not isinstance(out, QuantizedRows):  # (else e4m3 for the fp8 to_out)
            out = out.flatten(2, 3).type_as(value)
        out = attn.to_out[0](out)
        return attn.to_out[1](out)


def wan_block_forward(
    self: Any,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    rotary_emb: torch.Tensor,
) -> torch.Tensor:
    """diffusers' ``WanTransformerBlock.forward`` (0.42) with ``norm1``/``norm3`` and their
    modulation as one :func:`~omnirt.kernels.adaln.adaln_modulate` each and the two gated residual
    adds as one :func:`~omnirt.kernels.gated_residual.gated_residual` each (bound to a block by
    :func:`install`)."""
    if temb.ndim == 4:  # per-token modulation (Wan 2.2 TI2V): [B, S, 6, C]
        shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = (
            self.scale_shift_table.unsqueeze(0) + temb.float()
        ).chunk(6, dim=2)
        shift_msa, scale_msa, gate_msa = shift_msa.squeeze(2), scale_msa.squeeze(2), gate_msa.squeeze(2)
        c_shift_msa, c_scale_msa, c_gate_msa = (
            c_shift_msa.squeeze(2),
            c_scale_msa.squeeze(2),
            c_gate_msa.squeeze(2),
        )
    else:
        shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = (
            self.scale_shift_table + temb.float()
        ).chunk(6, dim=1)

    norm_hidden_states = adaln_modulate(hidden_states, scale_msa, shift_msa, eps=self.norm1.eps)
    attn_output = self.attn1(norm_hidden_states, None, None, rotary_emb)
    hidden_states = gated_residual(hidden_states, attn_output, gate_msa)

    norm_hidden_states = self.norm2(hidden_states.float()).type_as(hidden_states)
    attn_output = self.attn2(norm_hidden_states, encoder_hidden_states, None, None)
    hidden_states = hidden_states + attn_output

    norm_hidden_states = adaln_modulate(hidden_states, c_scale_msa, c_shift_msa, eps=self.norm3.eps)
    ff_output = self.ffn(norm_hidden_states)
    return gated_residual(hidden_states, ff_output, c_gate_msa)


#: Whether a Z-Image block's residual update after its attention and its feed-forward's norm of the
#: new stream run as one kernel (:func:`~omnirt.kernels.rms_norm.rms_norm_modulate_pair`, the
#: stream read once less) or as two (the same bits). Off: no faster on an H100 (docs/benchmarks.md).
PAIRED_NORMS = False


def zimage_block_forward(
    self: Any,
    x: torch.Tensor,
    attn_mask: torch.Tensor,
    freqs_cis: torch.Tensor,
    adaln_input: torch.Tensor | None = None,
    noise_mask: torch.Tensor | None = None,
    adaln_noisy: torch.Tensor | None = None,
    adaln_clean: torch.Tensor | None = None,
) -> torch.Tensor:
    """diffusers' ``ZImageTransformerBlock.forward`` (0.42) with each RMSNorm and the product and
    sum that follow it as one :func:`~omnirt.kernels.rms_norm.rms_norm_modulate` (bound to a
    block by :func:`install`); per-token modulation (``noise_mask``: the omni/edit path) runs the
    original."""
    if self.modulation and noise_mask is not None:
        return type(self).forward(
            self, x, attn_mask, freqs_cis, adaln_input, noise_mask, adaln_noisy, adaln_clean
        )
    n1, n2, f1, f2 = self.attention_norm1, self.attention_norm2, self.ffn_norm1, self.ffn_norm2
    scale_msa = gate_msa = scale_mlp = gate_mlp = None
    if self.modulation:
        mod = self.adaLN_modulation(adaln_input)
        scale_msa, gate_msa, scale_mlp, gate_mlp = mod.unsqueeze(1).chunk(4, dim=2)
        gate_msa, gate_mlp = gate_msa.tanh(), gate_mlp.tanh()
        scale_msa, scale_mlp = 1.0 + scale_msa, 1.0 + scale_mlp
    kind = _quantized_inputs(self)
    if kind is None:
        attn_in = rms_norm_modulate(x, n1.weight, n1.eps, scale_msa)
    else:
        attn_in = rms_norm_modulate_quantize(x, n1.weight, n1.eps, scale_msa, kind)
    attention = self.attention
    if isinstance(attention.processor, ZImageFusedProcessor) and not (
        attention._forward_hooks or attention._forward_pre_hooks
    ):  # our processor called as ``Attention.forward`` calls it (which inspects it on every call)
        attn_out = attention.processor(attention, attn_in, attention_mask=attn_mask, freqs_cis=freqs_cis)
    else:
        attn_out = attention(attn_in, attention_mask=attn_mask, freqs_cis=freqs_cis)
    if PAIRED_NORMS:  # the residual update and the feed-forward's norm of it in one launch
        x, ffn_in = rms_norm_modulate_pair(attn_out, n2.weight, n2.eps, gate_msa, x, f1.weight, f1.eps,
                                           scale_mlp, kind)  # fmt: skip
    else:
        x = rms_norm_modulate(attn_out, n2.weight, n2.eps, gate_msa, x)
        if kind is None:
            ffn_in = rms_norm_modulate(x, f1.weight, f1.eps, scale_mlp)
        else:
            ffn_in = rms_norm_modulate_quantize(x, f1.weight, f1.eps, scale_mlp, kind)
    hidden = self.feed_forward(ffn_in)
    return rms_norm_modulate(hidden, f2.weight, f2.eps, gate_mlp, x)


def _quantized_inputs(block: Any) -> str | None:
    """The W8A8 kind in which a Z-Image block's two normed inputs go to their products already
    quantized: where the attention's q, k and v and the feed-forward's ``w1`` and ``w3`` are merged
    layers of one kind read by this module's processor and feed-forward; else None (the norms
    write the model's dtype, and the layers quantize what they read)."""
    attention, ffn = block.attention, block.feed_forward
    to_qkv, w13 = getattr(attention, "to_qkv", None), getattr(ffn, "w13", None)
    if (
        isinstance(attention.processor, ZImageFusedProcessor)
        and attention.norm_q is not None
        and attention.norm_k is not None
        and getattr(ffn, "_omnirt_fused", False)
        and isinstance(to_qkv, W8A8Linear)
        and isinstance(w13, W8A8Linear)
        and to_qkv.kind == w13.kind
    ):
        return to_qkv.kind
    return None


def zimage_feed_forward(self: Any, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
    """diffusers' Z-Image ``FeedForward.forward`` (0.42), ``w2(silu(w1(x)) * w3(x))``, with the gated
    middle as one :func:`~omnirt.kernels.swiglu.swiglu`; with merged W8A8 ``w13`` one product for
    ``w1`` and ``w3`` and the middle written quantized for ``w2``
    (:func:`~omnirt.kernels.swiglu.swiglu_w8a8`)."""
    w13 = getattr(self, "w13", None)
    if isinstance(w13, W8A8Linear) and isinstance(self.w2, W8A8Linear):
        return self.w2(swiglu_w8a8(x, w13.qweight, w13.weight_scale, w13.bias, w13.kind, self.w2.kind))
    return self.w2(swiglu(self.w1(x), self.w3(x)))


def install(transformer: torch.nn.Module, preset: Preset = "exact") -> int:
    """Puts the fused paths into ``transformer`` (a diffusers Z-Image or Wan DiT) unless
    ``kernels.settings.FUSED`` is ``off``; returns how many sites now use them (0: none
    recognised, or off)."""
    if settings.FUSED == "off":
        return 0
    from diffusers.models.normalization import RMSNorm
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor, WanTransformerBlock
    from diffusers.models.transformers.transformer_z_image import FeedForward as ZImageFeedForward
    from diffusers.models.transformers.transformer_z_image import (
        ZImageTransformerBlock,
        ZSingleStreamAttnProcessor,
    )

    sites = 0
    for module in transformer.modules():
        if isinstance(module, ZImageTransformerBlock) and not getattr(module, "_omnirt_fused", False):
            norms = (module.attention_norm1, module.attention_norm2, module.ffn_norm1, module.ffn_norm2)
            if all(isinstance(n, RMSNorm) and n.weight is not None and n.bias is None for n in norms):
                module.forward = types.MethodType(zimage_block_forward, module)
                module._omnirt_fused = True
                sites += 1
        if isinstance(module, ZImageFeedForward) and not getattr(module, "_omnirt_fused", False):
            module.forward = types.MethodType(zimage_feed_forward, module)
            module._omnirt_fused = True
            sites += 1
        if isinstance(module, WanTransformerBlock) and not getattr(module, "_omnirt_fused", False):
            if isinstance(module.norm1, torch.nn.LayerNorm) and isinstance(module.norm3, torch.nn.LayerNorm):
                module.forward = types.MethodType(wan_block_forward, module)
                module._omnirt_fused = True
                sites += 1
            processor = getattr(module.attn1, "processor", None)
            if isinstance(processor, WanAttnProcessor) and isinstance(module.attn1.norm_q, torch.nn.RMSNorm):
                module.attn1.set_processor(WanFusedProcessor(processor, preset))
                sites += 1
        processor = getattr(module, "processor", None)
        if isinstance(processor, ZSingleStreamAttnProcessor):
            module.set_processor(ZImageFusedProcessor(processor, preset))
            sites += 1
    merged = merge_projections(transformer)
    log.info(
        "fused kernels in %s: %d sites (%s preset), %d merged W8A8 layers",
        type(transformer).__name__, sites, preset, merged,
    )  # fmt: skip
    return sites


def uninstall(transformer: torch.nn.Module) -> None:
    """Puts back the original processors and block forwards."""
    for module in transformer.modules():
        if getattr(module, "_omnirt_fused", False):
            del module.forward
            module._omnirt_fused = False
        processor = getattr(module, "processor", None)
        if isinstance(processor, _FusedProcessor):
            module.set_processor(processor.original)
