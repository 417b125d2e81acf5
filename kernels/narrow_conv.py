"""A 3D convolution with few output channels as one Triton kernel: the Wan VAE decoder's head
(96 -> 3, 3x3x3) at its ``fast`` level (``stages/diffusion/wan_vae_fast.py``).

Why: cuDNN runs the head at about 24 TFLOP/s whatever its form (H200, 480p: 1.04 ms a chunk of 4
frames, a tenth of the memory bandwidth for the 0.46 GB it reads; ``benchmarks/quant_vae.py
--conv-speed``): its kernels tile the output channels by 16 or more, so 13 of 16 lanes idle. Here
each program takes a run of pixels of one output row, and for each of the 27 taps a product of
[pixels, channels] by [channels, 16] on the tensor cores (3 output channels padded to 16), the
input read from cache-friendly neighbouring rows; the bias is added on the fp32 accumulator and the
output written in NCDHW order (what the decoder returns), so no layout copy follows.

Numerics: fp32 accumulation (bf16 and fp16 inputs on the tensor cores, fp32 inputs in IEEE fp32),
another summation order than cuDNN's, and the bias added before the one rounding: a ``fast``-level
change, not bitwise. :func:`narrow_conv3d_reference` is the convolution in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import settings

try:  # Triton ships with CUDA builds of torch only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

#: Output channels a program computes (the product's N: the output channels padded to it).
OUT_PAD = 16
#: The most output channels the kernel takes.
MAX_OUT = OUT_PAD
#: Input channels a product takes at a time.
CHANNEL_BLOCK = 32
#: Output pixels of a row a program takes.
PIXELS = 64


def narrow_conv3d_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The convolution of the padded frames ``x`` [N, C, T, H, W] by ``weight`` [K, C, kt, kh, kw]
    (stride 1, no padding) plus ``bias``, in fp32, rounded once to ``x``'s dtype; contiguous."""
    y = F.conv3d(x.float(), weight.float(), None if bias is None else bias.float())
    return y.to(x.dtype).contiguous()


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [K, C, kt, kh, kw] as the kernel reads it: [kt * kh * kw, C, OUT_PAD], the output
    channels zero-padded."""
    k, c = weight.shape[:2]
    taps = weight.permute(2, 3, 4, 1, 0).reshape(-1, c, k)
    return F.pad(taps, (0, OUT_PAD - k)).contiguous()


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`narrow_conv3d` takes these: a 5D convolution of at most :data:`MAX_OUT`
    outputs and a multiple of :data:`CHANNEL_BLOCK` input channels, on CUDA (or the interpreter),
    bf16 / fp16 / fp32 frames and weight alike."""
    if x.dim() != 5 or weight.dim() != 5 or weight.shape[0] > MAX_OUT or weight.shape[1] != x.shape[1]:
        return False
    if x.shape[1] % CHANNEL_BLOCK or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    if weight.dtype != x.dtype or any(n < k for n, k in zip(x.shape[2:], weight.shape[2:], strict=True)):
        return False
    return settings.kernel_device(x, weight) or (triton is not None and settings.interpreted())


if triton is not None:

    @triton.jit
    def _narrow_conv3d_kernel(
        X, WT, BIAS, OUT,
        T, H, W, K,
        sxn, sxc, sxt, sxh, sxw,
        son, sok, sot, soh, sow,
        C: tl.constexpr, KT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, HAS_BIAS: tl.constexpr,
        IEEE: tl.constexpr, BP: tl.constexpr, BC: tl.constexpr, KP: tl.constexpr,
    ):  # fmt: skip
        """Output row (n, t, h), pixels ``BP`` from ``program_id(1) * BP``: for each tap and each
        ``BC`` input channels, [BP, BC] frames by [BC, KP] weights into an fp32 [BP, KP]."""
        row = tl.program_id(0)
        h = (row % H).to(tl.int64)
        rest = row // H
        t = (rest % T).to(tl.int64)
        n = (rest // T).to(tl.int64)
        w = tl.program_id(1) * BP + tl.arange(0, BP)
        live = w < W
        c = tl.arange(0, BC)
        k = tl.arange(0, KP)
        acc = tl.zeros((BP, KP), dtype=tl.float32)
        base = X + n * sxn
        for dt in tl.static_range(KT):
            for dh in tl.static_range(KH):
                for dw in tl.static_range(KW):
                    tap = (dt * KH + dh) * KW + dw
                    pix = base + (t + dt) * sxt + (h + dh) * sxh + (w + dw).to(tl.int64) * sxw
                    for c0 in tl.static_range(0, C, BC):
                        a = tl.load(pix[:, None] + (c0 + c)[None, :] * sxc, mask=live[:, None], other=0.0)
                        b = tl.load(WT + (tap * C + c0 + c)[:, None] * KP + k[None, :])
                        if IEEE:
                            acc = tl.dot(a, b, acc, input_precision="ieee")
                        else:
                            acc = tl.dot(a, b, acc)
        if HAS_BIAS:
            acc += tl.load(BIAS + k, mask=k < K, other=0.0).to(tl.float32)[None, :]
        dst = OUT + n * son + t * sot + h * soh + k[None, :] * sok + w[:, None] * sow
        tl.store(dst, acc.to(OUT.dtype.element_ty), mask=live[:, None] & (k < K)[None, :])


def narrow_conv3d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """:func:`narrow_conv3d_reference` of ``x`` (any strides; channels-last reads best) as one
    Triton kernel; ``packed``: :func:`packed_weight` of ``weight``, if the caller keeps it. The
    output [N, K, T', H', W'] contiguous. Only where :func:`applies`; raises otherwise."""
    if not applies(x, weight):
        raise ValueError(
            f"narrow_conv3d takes a 5D convolution of at most {MAX_OUT} outputs and a multiple of "
            f"{CHANNEL_BLOCK} input channels on CUDA: frames {tuple(x.shape)} {x.dtype}, weight "
            f"{tuple(weight.shape)} {weight.dtype}"
        )
    n, c = x.shape[:2]
    k, _, kt, kh, kw = weight.shape
    t, h, w = (size - taps + 1 for size, taps in zip(x.shape[2:], weight.shape[2:], strict=True))
    out = torch.empty((n, k, t, h, w), dtype=x.dtype, device=x.device)
    wt = packed_weight(weight) if packed is None else packed
    pixels = max(16, triton.next_power_of_2(w)) if settings.interpreted() else PIXELS
    grid = (n * t * h, triton.cdiv(w, pixels))
    _narrow_conv3d_kernel[grid](
        x, wt, bias if bias is not None else wt, out,
        t, h, w, k, *x.stride(), *out.stride(),
        C=c, KT=kt, KH=kh, KW=kw, HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        BP=pixels, BC=CHANNEL_BLOCK, KP=OUT_PAD, num_warps=4,
    )  # fmt: skip
    return out
