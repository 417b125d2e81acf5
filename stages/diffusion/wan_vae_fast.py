"""The Wan VAE decoder's fast path: diffusers' ``AutoencoderKLWan`` decoder with the memory-bound
work around its convolutions done by the kernels of ``kernels/conv_input.py``, installed per model
instance (the modules, their parameters and their feature-cache protocol stay diffusers').

Three levels (``kernels.settings.VAE_FAST``, ``omnirt serve --vae-fast``):

- ``exact`` (the default on CUDA): each causal convolution of the decoder (``conv_in``, the two of
  every residual block, the head's, the time convolutions of the 3D upsamplers) reads an input
  that one kernel assembled (normalisation, SiLU, cached frames and zero padding, with the next
  chunk's cache), and each upsampler's nearest 2x upsampling, time interleave and frames-first
  permutation is one gather; each convolution's bias and the residual add after it are one pass
  (ATen adds a bias after cuDNN's convolution, so the sums and their roundings are the same). The
  convolutions (``CHANNELS_LAST``: all four kinds) run channels-last, on inputs the kernels write
  in that layout: cuDNN runs NDHWC kernels either way and gives the same bits for NCDHW and NDHWC
  inputs at every decoder shape (measured on the H200, ``quant_vae.py --conv-layouts``), so this
  drops the layout transposes it puts around NCDHW tensors; the channel norms of channels-last
  frames are summed in ATen's order for NCDHW frames (``kernels/reduce_order.py``), which is the
  order diffusers' norms have. The attention runs diffusers' own code on NCDHW frames. The
  convolutions of :data:`GRAPH_CONV_SHAPES` (the top level's 96 -> 96, where ATen's choice of
  cuDNN kernel is slowest) run as cuDNN graphs whose plan gives ATen's bits
  (``kernels/cudnn_conv.conv_graph``). The decode is bitwise equal to diffusers' (81 frames, bf16:
  2.47x diffusers' speed at 480p and 2.45x at 720p on an H100; before the graphs 2.01x and 2.00x
  on the H200; ``docs/benchmarks.md``).
- ``fast``: ``exact``, and the 3x3x3 convolutions of :data:`FAST_CONV_SHAPES` (the top level's
  96 -> 96) in the form :data:`FAST_CONV` names (by default ``"stacked"``: one 2D convolution
  over the three time taps' frames, which the conv-input kernel writes side by side), their bias
  and residual added in cuDNN's epilogue (:data:`FUSED_EPILOGUE`, ``kernels/cudnn_conv.py``).
  Another summation order, so not bitwise: PSNR 55.6 dB against diffusers (81 frames, bf16;
  ``tests/gpu/test_wan_vae_gpu.py`` holds 40 dB), 2.66x diffusers' speed at 480p and 2.62x at
  720p on an H100 (``docs/benchmarks.md``).
- ``off``: diffusers' decoder untouched.

The convolution weights stay as diffusers holds them (ATen copies a weight to the input's layout
for cuDNN, a few hundred MB a decode), so diffusers' own calls of the modules are untouched.
The hooks apply to decodes that pass a feature cache (``AutoencoderKLWan._decode`` and
``WanDenoiser``'s decode in pieces) on CUDA (or on the CPU under ``TRITON_INTERPRET=1``, for the
tests); any other call, a module in training mode, or a norm with a learnt bias runs diffusers'
own forward.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels import conv_input, cudnn_conv, settings
from ...kernels.settings import HAVE_TRITON, check_vae_level

log = logging.getLogger(__name__)

_ATTR = "_omnirt_vae_level"


def _applies(x: torch.Tensor) -> bool:
    """Whether the kernels can run on ``x``: Triton on CUDA, or the interpreter on the CPU."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    return settings.kernel_device(x) or (HAVE_TRITON and settings.interpreted())


def _norm_applies(norm: nn.Module, x: torch.Tensor) -> bool:
    """A ``WanRMS_norm`` the kernel reproduces: channels first, no learnt bias, gain in ``x``'s dtype."""
    return (
        getattr(norm, "channel_first", False)
        and not isinstance(norm.bias, torch.Tensor)
        and float(norm.bias) == 0.0
        and norm.gamma.dtype == x.dtype
    )


_CL = "_omnirt_channels_last"

#: The decoder's convolutions by kind: ``causal`` (``conv_in``, each residual block's two, the
#: head's: 3x3x3), ``shortcut`` (a residual block's 1x1x1), ``time`` (an upsampler's 3x1x1) and
#: ``resample`` (an upsampler's 2D 3x3). The attention's 1x1 convolutions stay diffusers' (NCDHW).
CONV_KINDS = ("causal", "shortcut", "time", "resample")
#: The kinds each level runs channels-last. At ``exact``, those whose NCDHW and NDHWC outputs
#: the H200 measured bitwise equal at the decoder's shapes (``quant_vae.py --conv-layouts``).
CHANNELS_LAST: dict[str, frozenset[str]] = {
    "exact": frozenset(CONV_KINDS),
    "fast": frozenset(CONV_KINDS),
}


#: How the ``fast`` level runs the decoder's 3x3x3 causal convolutions of :data:`FAST_CONV_SHAPES`
#: for one video: ``"stacked"`` (the default): one 2D convolution over each output frame's three
#: input frames stacked along the channels, the stacked frames written by the conv-input kernel in
#: place of the padded ones (``conv_input.causal_conv_input(..., stack=3)``: twice the bytes
#: written, no copy after; where the frames are not dense channels-last, stacked by a copy);
#: another summation order, so not bitwise. ``"summed"``: one 2D convolution per time tap over a
#: view of the padded frames (no copy), the three outputs added (each rounded to the frames'
#: dtype). ``"3d"``: cuDNN's 3D convolution, as ``exact``. ``"graph"``: as ``exact`` runs the
#: convolutions of :data:`GRAPH_CONV_SHAPES` (bitwise), here at :data:`FAST_CONV_SHAPES`.
#: Measured on an H100 (``benchmarks/quant_vae.py``, bf16, channels-last, 2026-12-06): at the top
#: level's 96 -> 96 (480p, a chunk of 4 frames) ATen's 3D convolution takes 3.21 ms (247 TFLOP/s),
#: the bitwise cuDNN graph 2.09, the summed 2D ones 2.11, the stacked one 1.48 with ATen's kernel
#: and 1.40 as a cuDNN graph (569 TFLOP/s; the copy that stacked the frames took 0.73 more); at 192
#: and 384 channels the 3D kernel is as fast or faster. Whole decodes of 81 frames, with the
#: fused epilogues at 96 -> 96 (:data:`FUSED_EPILOGUE`): stacked 2.66x diffusers at 480p and 2.62x
#: at 720p, 3D 2.61x and 2.56x, PSNR 55.6 dB either way; stacked without them 2.58x and 2.59x
#: (PSNR 59.6 dB), ``exact`` 2.49x and 2.46x. The stacked frames cost about 0.5 GiB at 480p and
#: 1 GiB at 720p of peak memory (4.6 and 10.2 GiB against 4.1 and 9.2).
FAST_CONV = "stacked"
FAST_CONVS = ("3d", "summed", "stacked", "graph")
#: The (input, output) channels of the causal 3x3x3 convolutions that both levels run as cuDNN
#: graphs (``kernels/cudnn_conv.conv_graph``: the fastest of cuDNN's first plans that gives ATen's
#: bits on the shape's first call, where it beats ATen's time; else ATen's), their bias and
#: residual added after as ATen adds them, so the decode stays bitwise. On an H100 (2026-12-06,
#: ``quant_vae.py --conv-cudnn``): at 96 -> 96 the graph's plan 2.09 ms against ATen's 3.22, the
#: same bits; at the other shapes within 10% either way, so only 96 -> 96 (each new shape costs a
#: few plans' build and timing at its first call).
GRAPH_CONV_SHAPES: frozenset[tuple[int, int]] = frozenset({(96, 96)})
#: The (input, output) channels whose convolutions take :data:`FAST_CONV` (None: every 3x3x3
#: causal convolution of the decoder).
FAST_CONV_SHAPES: frozenset[tuple[int, int]] | None = frozenset({(96, 96)})
_FORM = "_omnirt_fast_conv"
_WEIGHTS = "_omnirt_fast_weights"
#: Which convolutions the ``fast`` level runs with their bias and residual in the convolution's
#: epilogue (``kernels/cudnn_conv.py``: fp32, rounded once; no pass of their own; the summed 2D
#: form's taps each add the sum so far), where cuDNN takes the graph (bf16 and fp16 frames); the
#: others add them in the ``exact`` level's bias + residual pass. ``"shapes"`` (the default): the
#: causal 3x3x3 ones of :data:`FAST_CONV_SHAPES`, in :data:`FAST_CONV`'s form (on an H100,
#: 2026-12-06: the stacked decode 2.58x -> 2.66x diffusers at 480p, the 3D one 2.50x -> 2.61x);
#: ``"all"``: every convolution of stride 1 (on an H100, with cuDNN's first plans: 1.3-2.0% off
#: the decode, its PSNR against diffusers from 55.2 to 46.1 dB; at several shapes the fused graph
#: is slower than the convolution alone, ``benchmarks/quant_vae.py --conv-cudnn``); ``"off"``.
FUSED_EPILOGUE = "shapes"
FUSED_EPILOGUES = ("off", "shapes", "all")
_EPILOGUE = "_omnirt_epilogue"
_EPILOGUE_WEIGHT = "_omnirt_epilogue_weight"


def _form_weights(conv: nn.Module, form: str) -> list[torch.Tensor]:
    """``conv``'s weight for ``form``, channels-last 2D: per time tap (``summed``) or with the
    taps stacked along the input channels (``stacked``); made once per weight version."""
    weight = conv.weight
    key = (form, weight.data_ptr(), weight._version, weight.dtype)
    held = getattr(conv, _WEIGHTS, None)
    if held is not None and held[0] == key:
        return held[1]
    taps = weight.shape[2]
    if form == "summed":
        made = [weight[:, :, k].contiguous(memory_format=torch.channels_last) for k in range(taps)]
    else:
        stacked = weight.permute(0, 2, 1, 3, 4).reshape(weight.size(0), -1, *weight.shape[3:])
        made = [stacked.contiguous(memory_format=torch.channels_last)]
    setattr(conv, _WEIGHTS, (key, made))
    return made


def _conv_2d_form(
    conv: nn.Module, x: torch.Tensor, form: str, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, bool]:
    """``conv(x)`` without its bias, for one channels-last padded video ``x`` [1, C, T, H, W], by
    2D convolutions (``form``); the output [1, C', T - 2, H', W'] channels-last, as cuDNN's. The
    flag: whether the output has the bias and ``residual`` in it already (``summed`` with the
    epilogue: each tap's convolution adds the sum so far, the last one the bias and residual)."""
    weights = _form_weights(conv, form)
    taps = conv.weight.shape[2]
    frames = x.size(2) - taps + 1
    if form == "summed":
        video = x[0]  # [C, T, H, W], strides (1, H W C, W C, C)
        planes = [video[:, k : k + frames].transpose(0, 1) for k in range(taps)]
        out = F.conv2d(planes[0], weights[0])
        if _epilogue_on(conv):
            out, done = _summed_epilogue(conv, planes, weights, out, residual)
            if done:
                return out.transpose(0, 1).unsqueeze(0), True
        else:
            for k in range(1, taps):
                out.add_(F.conv2d(planes[k], weights[k]))
    else:
        return _stacked_conv(conv, conv_input.stacked_reference(x, taps), residual)
    return out.transpose(0, 1).unsqueeze(0), False  # [F, C', H', W'] channels-last -> [1, C', F, H', W']


def _stacked_conv(
    conv: nn.Module, stacked: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, bool]:
    """``conv(x)`` over ``x``'s time taps stacked along the channels (``stacked`` [F, taps * C,
    H, W] channels-last, as ``conv_input`` writes it) as one 2D convolution, the output [1, C', F,
    H', W'] channels-last; with the epilogue on, the bias and ``residual`` added in it (the flag
    says whether they were)."""
    weight = _form_weights(conv, "stacked")[0]
    if _epilogue_on(conv):
        addends = () if residual is None else (residual[0].transpose(0, 1),)
        out = cudnn_conv.try_conv_epilogue(stacked, weight, (0, 0), bias=conv.bias, addends=addends)
        if out is not None:
            return out.transpose(0, 1).unsqueeze(0), True
    return F.conv2d(stacked, weight).transpose(0, 1).unsqueeze(0), False


def _summed_epilogue(
    conv: nn.Module, planes: list[torch.Tensor], weights: list[torch.Tensor], out: torch.Tensor,
    residual: torch.Tensor | None,
) -> tuple[torch.Tensor, bool]:  # fmt: skip
    """The summed 2D form's taps after the first, each convolution adding the sum so far ``out`` in
    cuDNN's epilogue, the last one also the bias and ``residual``; the flag: whether they all ran
    so (from the first tap cuDNN declines, the plain sums, without the bias)."""
    taps = len(planes)
    residual_2d = None if residual is None else residual[0].transpose(0, 1)
    for k in range(1, taps):
        last = k == taps - 1
        addends = (out,) if not last or residual_2d is None else (out, residual_2d)
        fused = cudnn_conv.try_conv_epilogue(
            planes[k], weights[k], (0, 0), bias=conv.bias if last else None, addends=addends
        )
        if fused is None:
            for j in range(k, taps):
                out = out + F.conv2d(planes[j], weights[j])
            return out, False
        out = fused
    return out, True


def _plain_3x3x3(conv: nn.Module) -> bool:
    """A 3x3x3 convolution of stride 1, no dilation, no groups, its padding in its input (as
    diffusers' ``WanCausalConv3d`` pads)."""
    shape = tuple(conv.kernel_size) == (3, 3, 3) and tuple(conv.padding) == (0, 0, 0)
    return shape and _plain_stride(conv)


def _plain_stride(conv: nn.Module) -> bool:
    """A convolution of stride 1, no dilation, no groups, its padding in numbers (what the epilogue
    graphs take)."""
    ones = (1,) * len(conv.stride)
    plain = tuple(conv.stride) == ones and tuple(conv.dilation) == ones and conv.groups == 1
    return plain and not isinstance(conv.padding, str)


def _form_applies(conv: nn.Module, x: torch.Tensor) -> str | None:
    form = getattr(conv, _FORM, None)
    if form is None or x.dim() != 5 or not x.is_contiguous(memory_format=torch.channels_last_3d):
        return None
    return form if form == "graph" or x.size(0) == 1 else None  # the 2D forms: one video


def _epilogue_on(conv: nn.Module) -> bool:
    return getattr(conv, _EPILOGUE, False)


def _graph_weight(conv: nn.Module) -> torch.Tensor:
    """``conv``'s weight channels-last (what the cuDNN graph reads), made once per weight version."""
    weight = conv.weight
    key = (weight.data_ptr(), weight._version, weight.dtype)
    held = getattr(conv, _EPILOGUE_WEIGHT, None)
    if held is None or held[0] != key:
        fmt = torch.channels_last_3d if weight.dim() == 5 else torch.channels_last
        held = (key, weight.contiguous(memory_format=fmt))
        setattr(conv, _EPILOGUE_WEIGHT, held)
    return held[1]


def _epilogue_conv(conv: nn.Module, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor | None:
    """``conv(x) + residual`` with the bias and the residual in cuDNN's epilogue
    (:mod:`~omnirt.kernels.cudnn_conv`), or None where it does not apply."""
    weight = _graph_weight(conv)
    padding = tuple(conv.padding)
    addends = () if residual is None else (residual,)
    return cudnn_conv.try_conv_epilogue(x, weight, padding, bias=conv.bias, addends=addends)


def _cl(conv: nn.Module) -> bool:
    """Whether ``conv`` runs channels-last (its input is made so)."""
    return getattr(conv, _CL, False)


def _conv(
    conv: nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None, *, stacked: bool = False
) -> torch.Tensor:
    """``conv(x)`` (``nn.Conv2d`` / ``nn.Conv3d``; the causal padding is in ``x``, in the layout
    ``conv`` runs in; ``stacked``: ``x`` is its time taps stacked, :func:`_stacked_conv`), plus
    ``residual`` if given. The convolution runs without its bias and the bias (and the residual)
    are added by one kernel, as ATen adds them after cuDNN's convolution: same bits, in either
    layout."""
    form = "stacked" if stacked else _form_applies(conv, x)
    if form in ("summed", "stacked"):
        out, whole = _stacked_conv(conv, x, residual) if stacked else _conv_2d_form(conv, x, form, residual)
        if whole:
            return out
        if conv.bias is None:
            return out if residual is None else out + residual
    elif _epilogue_on(conv) and (out := _epilogue_conv(conv, x, residual)) is not None:
        return out
    elif conv.bias is None:
        out = (nn.Conv3d.forward if isinstance(conv, nn.Conv3d) else nn.Conv2d.forward)(conv, x)
        return out if residual is None else out + residual
    else:
        out = None
        if form == "graph":
            out = cudnn_conv.conv_graph(x, _graph_weight(conv), tuple(conv.padding))
        if out is None:
            out = conv._conv_forward(x, conv.weight, None)
    frames = out if out.dim() == 5 else out.unsqueeze(2)  # [N, C, H, W] as N one-frame videos
    conv_input.add_bias_residual_(frames, conv.bias, residual)
    return out


def _causal_conv(
    conv: nn.Conv3d,
    x: torch.Tensor,
    norm: nn.Module | None,
    feat_cache: list,
    feat_idx: list,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``conv(x)`` (a ``WanCausalConv3d``, after ``norm`` and SiLU when given) with its cache slot,
    as diffusers' modules do it around the call; plus ``residual`` if given."""
    idx = feat_idx[0]
    pads = conv._padding  # (w, w, h, h, 2 * t, 0)
    # the stacked 2D form: its input written stacked by the kernel, not copied after
    stack = _cl(conv) and _form_applies(conv, x) == "stacked"
    stack = stack and conv_input.stacked_input_applies(x, feat_cache[idx])
    buf, feat_cache[idx] = conv_input.causal_conv_input(
        x,
        feat_cache[idx],
        time_pad=pads[4],
        spatial_pad=pads[0],
        norm=None if norm is None else (norm.gamma, norm.scale),
        channels_last=_cl(conv),
        stack=conv.weight.shape[2] if stack else 1,
    )
    feat_idx[0] += 1
    return _conv(conv, buf, residual, stacked=stack)


def _shortcut(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A residual block's shortcut: diffusers' call, on ``x`` in the layout the convolution runs in
    (cuDNN would run an NCDHW convolution channels-last on channels-last frames)."""
    if isinstance(module, nn.Conv3d) and not _cl(module):
        x = x.contiguous()
    return module(x)


def _residual_forward(
    self: Any, x: torch.Tensor, feat_cache: Any = None, feat_idx: list | None = None
) -> torch.Tensor:
    """diffusers' ``WanResidualBlock.forward`` (0.42) with both norm + SiLU + padding steps fused."""
    feat_idx = [0] if feat_idx is None else feat_idx
    if feat_cache is None or self.training or not _applies(x):
        return type(self).forward(self, x, feat_cache, feat_idx)
    if not (_norm_applies(self.norm1, x) and _norm_applies(self.norm2, x)):
        return type(self).forward(self, x, feat_cache, feat_idx)
    h = _shortcut(self.conv_shortcut, x)
    x = _causal_conv(self.conv1, x, self.norm1, feat_cache, feat_idx)
    return _causal_conv(self.conv2, x, self.norm2, feat_cache, feat_idx, residual=h)


def _resample_forward(
    self: Any, x: torch.Tensor, feat_cache: Any = None, feat_idx: list | None = None
) -> torch.Tensor:
    """diffusers' ``WanResample.forward`` (0.42) for the upsampling modes: the time convolution's
    input assembled by the kernel, the upsampling as one gather."""
    feat_idx = [0] if feat_idx is None else feat_idx
    if feat_cache is None or self.mode not in ("upsample2d", "upsample3d") or not _applies(x):
        return type(self).forward(self, x, feat_cache, feat_idx)
    b, _, t, _, _ = x.shape
    interleave = False
    if self.mode == "upsample3d":
        idx = feat_idx[0]
        previous = feat_cache[idx]
        if previous is None:  # the first chunk: no time convolution, the slot marked for the next
            feat_cache[idx] = "Rep"
        else:
            repeat = isinstance(previous, str)
            buf, cache = conv_input.causal_conv_input(
                x, None if repeat else previous, time_pad=2, spatial_pad=0, channels_last=_cl(self.time_conv)
            )
            if repeat and t < 2:  # diffusers caches a zero frame before the first one
                cache = buf[:, :, -2:].clone()
            x = _conv(self.time_conv, buf)
            feat_cache[idx] = cache
            interleave = True
        feat_idx[0] += 1
    frames = conv_input.upsample_frames(x, interleave=interleave, channels_last=_cl(self.resample[1]))
    out = _conv(self.resample[1], frames)
    return out.view(b, frames.shape[0] // b, out.size(1), out.size(2), out.size(3)).permute(0, 2, 1, 3, 4)


def _decoder_forward(
    self: Any,
    x: torch.Tensor,
    feat_cache: Any = None,
    feat_idx: list | None = None,
    first_chunk: bool = False,
) -> torch.Tensor:
    """diffusers' ``WanDecoder3d.forward`` and ``WanMidBlock.forward`` (0.42) with ``conv_in``'s
    padding and the head's norm + SiLU + padding fused, as :func:`decoder_stage`'s in turn; the
    attention (diffusers' own) reads NCDHW frames, as in diffusers (its norm sums them in ATen's
    order for that layout), and the output is contiguous."""
    feat_idx = [0] if feat_idx is None else feat_idx
    if feat_cache is None or not fast_decode_applies(self, x):
        return type(self).forward(self, x, feat_cache, feat_idx, first_chunk)
    for stage in range(decoder_stages(self)):
        x = _fast_stage(self, stage, x, feat_cache, feat_idx, first_chunk)
    return x


def fast_decode_applies(decoder: nn.Module, frame: torch.Tensor) -> bool:
    """Whether a decoder call on the latent frame ``frame`` takes the fast path (installed, and
    the kernels apply to it)."""
    installed = getattr(decoder, _ATTR, "off") != "off"
    return installed and _applies(frame) and _norm_applies(decoder.norm_out, frame)


def decoder_stages(decoder: nn.Module) -> int:
    """The stages of one call of a diffusers ``WanDecoder3d`` (:func:`decoder_stage`): one per
    up block; the first also runs ``conv_in`` and the middle block, the last the head."""
    return max(1, len(decoder.up_blocks))


def decoder_stage(
    decoder: nn.Module,
    stage: int,
    x: torch.Tensor,
    feat_cache: list[Any],
    feat_idx: list[int],
    first_chunk: bool,
    fast: bool,
) -> torch.Tensor:
    """Stage ``stage`` of one decoder call with a feature cache (``WanDecoder3d.forward`` cut
    between its up blocks): the stages run in turn over one latent frame give bitwise what the
    whole call gives, on diffusers' path and on the fast one. ``x``: the latent frame at stage 0,
    else the previous stage's output; ``fast``: :func:`fast_decode_applies` of the latent frame."""
    if fast:
        return _fast_stage(decoder, stage, x, feat_cache, feat_idx, first_chunk)
    return _diffusers_stage(decoder, stage, x, feat_cache, feat_idx, first_chunk)


def _fast_stage(
    self: Any, stage: int, x: torch.Tensor, feat_cache: Any, feat_idx: list, first_chunk: bool
) -> torch.Tensor:
    if stage == 0:
        x = _causal_conv(self.conv_in, x, None, feat_cache, feat_idx)
        mid = self.mid_block
        x = mid.resnets[0](x, feat_cache=feat_cache, feat_idx=feat_idx)
        for attn, resnet in zip(mid.attentions, mid.resnets[1:], strict=True):
            if attn is not None:
                x = attn(x.contiguous())
            x = resnet(x, feat_cache=feat_cache, feat_idx=feat_idx)
    if self.up_blocks:
        x = self.up_blocks[stage](x, feat_cache=feat_cache, feat_idx=feat_idx, first_chunk=first_chunk)
    if stage == decoder_stages(self) - 1:
        x = _causal_conv(self.conv_out, x, self.norm_out, feat_cache, feat_idx).contiguous()
    return x


def _cached_conv(
    conv: nn.Module, x: torch.Tensor, feat_cache: list[Any], feat_idx: list[int]
) -> torch.Tensor:
    """diffusers' ``WanDecoder3d.forward`` around ``conv_in`` and ``conv_out`` (0.42): the causal
    convolution over the cached frames, the cache refreshed with the last ``CACHE_T`` frames."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import CACHE_T

    idx = feat_idx[0]
    cache_x = x[:, :, -CACHE_T:, :, :].clone()
    if cache_x.shape[2] < 2 and feat_cache[idx] is not None:
        cache_x = torch.cat([feat_cache[idx][:, :, -1, :, :].unsqueeze(2).to(cache_x.device), cache_x], dim=2)
    x = conv(x, feat_cache[idx])
    feat_cache[idx] = cache_x
    feat_idx[0] += 1
    return x


def _diffusers_stage(
    self: Any, stage: int, x: torch.Tensor, feat_cache: list[Any], feat_idx: list[int], first_chunk: bool
) -> torch.Tensor:
    if stage == 0:
        x = _cached_conv(self.conv_in, x, feat_cache, feat_idx)
        x = self.mid_block(x, feat_cache=feat_cache, feat_idx=feat_idx)
    if self.up_blocks:
        x = self.up_blocks[stage](x, feat_cache=feat_cache, feat_idx=feat_idx, first_chunk=first_chunk)
    if stage == decoder_stages(self) - 1:
        x = self.nonlinearity(self.norm_out(x))
        x = _cached_conv(self.conv_out, x, feat_cache, feat_idx)
    return x


def _conv_kinds(decoder: nn.Module) -> dict[nn.Module, str]:
    """The decoder's convolutions (``CONV_KINDS``) by module."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanResample, WanResidualBlock

    kinds: dict[nn.Module, str] = {decoder.conv_in: "causal", decoder.conv_out: "causal"}
    for module in decoder.modules():
        if isinstance(module, WanResidualBlock):
            kinds[module.conv1] = kinds[module.conv2] = "causal"
            if isinstance(module.conv_shortcut, nn.Conv3d):
                kinds[module.conv_shortcut] = "shortcut"
        elif isinstance(module, WanResample) and module.mode in ("upsample2d", "upsample3d"):
            kinds[module.resample[1]] = "resample"
            if module.mode == "upsample3d":
                kinds[module.time_conv] = "time"
    return kinds


def _set_channels_last(conv: nn.Module, on: bool) -> None:
    """Marks ``conv`` to run channels-last (its weight stays as it is: ATen makes a copy of it in
    the input's layout for cuDNN, a few hundred MB a decode, so diffusers' own calls of the
    module, from anywhere else, are untouched)."""
    if on:
        setattr(conv, _CL, True)
    elif hasattr(conv, _CL):
        delattr(conv, _CL)


def install(vae: nn.Module, level: str | None = None) -> int:
    """Puts the fast path into ``vae`` (a diffusers ``AutoencoderKLWan``) at ``level`` (default:
    ``kernels.settings.VAE_FAST``); returns how many modules now use it (0: ``off``, or no Wan
    decoder). Installing again changes the level."""
    level = check_vae_level(settings.VAE_FAST if level is None else level)
    form = check_fast_conv(FAST_CONV) if level == "fast" else "3d"
    epilogue = check_fused_epilogue(FUSED_EPILOGUE) if level == "fast" else "off"
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanDecoder3d, WanResample, WanResidualBlock

    decoder = getattr(vae, "decoder", None)
    if not isinstance(decoder, WanDecoder3d):
        return 0
    uninstall(vae)
    if level == "off":
        return 0
    sites = 0
    for module in decoder.modules():
        forward = None
        if isinstance(module, WanResidualBlock):
            forward = _residual_forward
        elif isinstance(module, WanResample) and module.mode in ("upsample2d", "upsample3d"):
            forward = _resample_forward
        elif module is decoder:
            forward = _decoder_forward
        if forward is not None:
            module.forward = types.MethodType(forward, module)
            setattr(module, _ATTR, level)
            sites += 1
    shapes = FAST_CONV_SHAPES
    for conv, kind in _conv_kinds(decoder).items():
        pair = (conv.in_channels, conv.out_channels)
        taken = kind == "causal" and _plain_3x3x3(conv) and (shapes is None or pair in shapes)
        if kind in CHANNELS_LAST[level]:
            _set_channels_last(conv, True)
            if form != "3d" and taken:
                setattr(conv, _FORM, form)
            elif kind == "causal" and _plain_3x3x3(conv) and pair in GRAPH_CONV_SHAPES:
                setattr(conv, _FORM, "graph")
        if level == "fast" and _plain_stride(conv) and (epilogue == "all" or epilogue == "shapes" and taken):
            setattr(conv, _EPILOGUE, True)
    log.info(
        "Wan VAE decoder fast path: %s level in %d modules (convolutions: %s; fused epilogues: %s)",
        level, sites, form, epilogue,
    )  # fmt: skip
    return sites


def check_fast_conv(form: str) -> str:
    """``form`` if it is one of :data:`FAST_CONVS`, else ``ValueError``."""
    if form not in FAST_CONVS:
        raise ValueError(f"the fast level's convolutions are one of {', '.join(FAST_CONVS)}, not {form!r}")
    return form


def check_fused_epilogue(which: str) -> str:
    """``which`` if it is one of :data:`FUSED_EPILOGUES`, else ``ValueError``."""
    if which not in FUSED_EPILOGUES:
        raise ValueError(f"the fused epilogues are one of {', '.join(FUSED_EPILOGUES)}, not {which!r}")
    return which


def uninstall(vae: nn.Module) -> None:
    """Puts back diffusers' forwards."""
    decoder = getattr(vae, "decoder", None)
    if decoder is None:
        return
    for module in decoder.modules():
        if getattr(module, _ATTR, None) is not None:
            del module.forward
            delattr(module, _ATTR)
        if _cl(module):
            _set_channels_last(module, False)
        for attr in (_FORM, _WEIGHTS, _EPILOGUE, _EPILOGUE_WEIGHT):
            if hasattr(module, attr):
                delattr(module, attr)


def installed_level(vae: nn.Module) -> str:
    """The level in ``vae`` (``off`` when none)."""
    decoder = getattr(vae, "decoder", None)
    return getattr(decoder, _ATTR, "off") if decoder is not None else "off"
