"""Convolution inputs of the Wan VAE decoder, assembled in one pass where eager takes many.

- :func:`causal_conv_input`: the padded input of one of diffusers' ``WanCausalConv3d``: the
  cached last frames of the previous chunk, the new frames (in a residual block or the head, first
  through ``WanRMS_norm`` and SiLU) and the zero padding, written once into the tensor the
  convolution reads, with the cache for the next chunk. Eager materialises the frames in fp32, the
  quotient, three products, the SiLU, the concatenation with the cache and the padding: some
  twenty passes over the frames at bf16's width, against about three here. With ``stack=3`` the
  padded frames are written as the 2D frames of the ``fast`` level's stacked form (each output
  frame's three input frames side by side along the channels).
- :func:`add_bias_residual_`: a convolution's bias (which ATen adds after cuDNN's convolution, in a
  slow broadcast kernel) and a residual block's ``x + shortcut`` (slow and strided when the
  shortcut is an upsampler's frames-first view) as one in-place pass.
- :func:`upsample_frames`: ``WanResample``'s nearest 2x upsampling of each frame, with the
  temporal interleave of its time convolution's two halves and the frames-first permutation, as
  one gather (eager: a stack, a permuted copy, a copy to fp32, the upsampling and a copy back).

Numerics: ``exact`` at every dtype. The channel norms are the ones ATen takes of NCDHW frames
(``F.normalize(x.float(), dim=1)``, diffusers' layout): for NCDHW frames ATen's own
``torch.linalg.vector_norm`` (the H200 measured it bitwise equal to ``F.normalize``'s, for bf16
frames against their fp32 copy too); for channels-last frames :func:`channel_norms_cl`, a Triton
kernel that sums each pixel's squares in ATen's order for the NCDHW frames
(``reduce_order.channel_sumsq``: measured bitwise at every decoder shape, bf16 and fp32). The
elementwise chain then rounds where eager rounds (the quotient, the scale, the gain, the
``+ 0.0`` and the SiLU each rounded to the frames' dtype), with no contraction into fused
multiply-adds: in fp32 with IEEE division and CUDA's ``expf`` (libdevice); in bf16 the quotient
is ``v * RN(1 / n)`` (one reciprocal a pixel, taken by ATen: ``1.0 / n.clamp_min(eps)``)
wherever that rounds to the same bf16 as ``v / n`` (it is less than 2 ulps off: every element
of a block is checked against the bf16 rounding midpoints, and a block with one nearby takes
IEEE division), and the SiLU of a bf16 value is ATen's own, looked up in a table of all 65536
(:func:`~.silu.silu_table`). Copies are copies. So the convolution sees the same bits as in diffusers.
Under ``TRITON_INTERPRET=1`` (the CPU tests, fp32) the exponential is NumPy's, so the SiLU there
is close, not bitwise.

Layouts: the output is contiguous or channels-last (``channels_last_3d`` / ``channels_last``, as
the convolution after it runs); inputs may have any strides. Dense channels-last frames (and cache,
and for the bias + residual pass a residual of the same strides) go through flat kernels, whose
programs each take ``FLAT_BLOCK`` contiguous elements of a row of ``W * C``; other strides through
tiled ones (channels x columns). Both give the same bits; on the H200 the flat ones brought the
``exact`` Wan decode from 1.94x to 2.01x diffusers' at 480p (1.93x to 2.00x at 720p, bf16).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import reduce_order, settings
from .settings import interpreted
from .silu import silu_table

try:  # Triton ships with CUDA builds of torch only
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from .reduce_order import channel_sumsq
except ImportError:  # pragma: no cover - depends on the install
    triton = None

#: ``F.normalize``'s floor for a norm.
NORM_EPS = 1e-12


#: Pixels per program of the channel-norm kernel.
NORM_PIXELS = 128


def channel_norms(x: torch.Tensor, *, splits: int | None = None, fma: bool = True) -> torch.Tensor:
    """The fp32 L2 norm over the channels of ``x`` [B, C, T, H, W] (dim 1, kept; contiguous), as
    ``F.normalize(x.float(), dim=1)`` computes it on CUDA for the same frames in NCDHW memory
    (bitwise, without the fp32 copy). Frames whose channels are innermost (channels-last) go
    through :func:`channel_norms_cl` in ATen's NCDHW order (``reduce_order.channel_sumsq``);
    others, and the shapes ATen reduces otherwise, through ATen itself. ``splits`` and ``fma``
    force an order (probes and tests)."""
    b, c, t, h, w = x.shape
    if x.stride(1) == 1 and c > 1 and (settings.kernel_device(x) or (triton is not None and interpreted())):
        s = reduce_order.aten_channel_splits(c, t * h * w, b) if splits is None else splits
        if s in (1, 2, 4, 8, 16):
            return channel_norms_cl(x, splits=s, fma=fma)
        x = x.contiguous()  # an order the kernel does not model: ATen's own on NCDHW frames
    return torch.linalg.vector_norm(x, 2, dim=1, keepdim=True, dtype=torch.float32)


def channel_norms_cl(x: torch.Tensor, *, splits: int, fma: bool = True) -> torch.Tensor:
    """:func:`channel_norms` of ``x`` (any strides; meant for channels-last frames) by one Triton
    kernel that sums each pixel's squares in ATen's order for NCDHW frames with ``splits``
    threads a pixel, then takes the IEEE square root."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    b, c, t, h, w = x.shape
    out = torch.empty((b, 1, t, h, w), dtype=torch.float32, device=x.device)
    pixels = b * t * h * w
    dense = x.is_contiguous(memory_format=torch.channels_last_3d)
    grid = (triton.cdiv(pixels, NORM_PIXELS),)
    _channel_norm_kernel[grid](
        x, out, pixels, c, t, h, w, *x.stride(),
        S=splits, FMA=fma, DENSE=dense, BP=NORM_PIXELS, num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
    return out


def rms_norm_silu_reference(x: torch.Tensor, gamma: torch.Tensor, scale: float) -> torch.Tensor:
    """``SiLU(WanRMS_norm(x))`` as diffusers computes it (no bias: ``+ 0.0``)."""
    low = x.dtype in (torch.float16, torch.bfloat16)
    normalized = F.normalize(x.float() if low else x, dim=1).to(x.dtype)
    return F.silu(normalized * scale * gamma + 0.0)


def causal_conv_input_reference(
    x: torch.Tensor,
    cache: torch.Tensor | None,
    *,
    time_pad: int,
    spatial_pad: int,
    norm: tuple[torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager's padded input and next cache (what :func:`causal_conv_input` must equal)."""
    if norm is not None:
        x = rms_norm_silu_reference(x, *norm)
    new_cache = x[:, :, -2:].clone()
    if new_cache.shape[2] < 2 and cache is not None:
        new_cache = torch.cat([cache[:, :, -1:], new_cache], dim=2)
    pads = [spatial_pad, spatial_pad, spatial_pad, spatial_pad, time_pad, 0]
    if cache is not None and time_pad > 0:
        x = torch.cat([cache, x], dim=2)
        pads[4] -= cache.shape[2]
    return F.pad(x, pads), new_cache


if triton is not None:

    @triton.jit
    def _norm_silu(
        v, NORM_PTRS, r, g, SILU, inside, columns, scale, eps,
        dtype: tl.constexpr, LIBDEVICE: tl.constexpr, BF16: tl.constexpr,
    ):  # fmt: skip
        """``SiLU(v / max(n, eps) * scale * g + 0.0)`` rounded where eager rounds (``v`` fp32; the
        norms ``n`` at ``NORM_PTRS`` (masked by ``columns``), ``r`` = ``RN(1 / max(n, eps))``).
        ``BF16``: bf16 frames, whose quotient is rounded to bf16 before anything else sees it, so
        ``RN(v * r)`` (less than 2 ulps from ``v / n``, so at most 2 from ``RN(v / n)``) serves
        unless a bf16 rounding midpoint (low 16 bits 0x8000) is that near, the quotient is tiny
        (subnormal) or NaN: then the block takes IEEE division throughout; their SiLU is one of
        65536 values (``SILU``: ATen's own, looked up). Else IEEE division and CUDA's ``expf``."""
        if BF16:
            q = v * r
            low = q.to(tl.int32, bitcast=True) & 0xFFFF
            tiny = (tl.abs(q) < 1e-30) & (q != 0.0)  # 0 is exact: v is 0
            doubt = ((low >= 0x8000 - 3) & (low <= 0x8000 + 3)) | tiny | (q != q)
            if tl.max(doubt.to(tl.int32)) > 0:  # a block with one: IEEE division throughout
                n = tl.load(NORM_PTRS, mask=columns, other=1.0)
                q = tl.math.div_rn(v, tl.where(n < eps, eps, n))
            y = q.to(dtype).to(tl.float32)
        else:
            n = tl.load(NORM_PTRS, mask=columns, other=1.0)
            y = tl.math.div_rn(v, tl.where(n < eps, eps, n)).to(dtype).to(tl.float32)
        y = (y * scale).to(dtype).to(tl.float32)
        y = (y * g).to(dtype).to(tl.float32)
        y = tl.where(y == 0.0, 0.0, y)  # eager's ``+ 0.0``: -0 becomes +0
        if BF16:
            bits = y.to(dtype).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            out = tl.load(SILU + bits, mask=inside, other=0.0).to(tl.float32)
        else:
            if LIBDEVICE:
                e = libdevice.exp(-y)
            else:
                e = tl.exp(-y)
            out = tl.where(inside, tl.math.div_rn(y, 1.0 + e), 0.0)
        return out

    @triton.jit
    def _conv_input_cl_kernel(
        X, CACHE, NORM, RCP, GAMMA, SILU, OUT, NEXT,
        H, W, L, TP, HP, WP, PT, PH, PW, KEEP, FRAMES,
        sxb, sxt, sxh, scb, sct, sch, snb, snt, snh, snw, sob, sot, soh, skb, skt, skh,
        scale, eps,
        C: tl.constexpr, HAS_NORM: tl.constexpr, LIBDEVICE: tl.constexpr, BF16: tl.constexpr,
        BLOCK: tl.constexpr, STACK: tl.constexpr,
    ):  # fmt: skip
        """:func:`_conv_input_kernel` for dense channels-last tensors: one output row (b, tp, hp)
        is ``WP * C`` contiguous elements (column-major over channels), of which this program
        writes ``BLOCK``; the input row and the cache rows are contiguous the same way. ``STACK``
        > 1 (one video): the padded frame ``tp`` is written as the channels ``k * C ...`` of the
        ``FRAMES`` output frames ``tp - k`` (``k < STACK``) that read it, rows of
        ``WP * STACK * C`` (``sot``, ``soh``: the stacked frames' and rows' strides)."""
        pid = tl.program_id(0)
        hp = (pid % HP).to(tl.int64)
        rest = pid // HP
        tp = (rest % TP).to(tl.int64)
        b = (rest // TP).to(tl.int64)
        j = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # wp * C + c
        wp = j // C
        c = j % C
        h = hp - PH
        w = wp - PW
        hv = h + w * 0
        inside = (w >= 0) & (w < W) & (hv >= 0) & (hv < H)
        live = wp < WP
        at = j - PW * C  # the element's offset in an unpadded row
        dtype = OUT.dtype.element_ty
        if tp < PT:  # a cached frame, or zeros before the cached ones
            tv = tp + w * 0
            from_cache = inside & (tv >= PT - L) & (tv < PT)
            v = tl.load(CACHE + b * scb + (tp - (PT - L)) * sct + h * sch + at, mask=from_cache, other=0.0)
            v = v.to(dtype)
        else:  # a new frame
            t = tp - PT
            v = tl.load(X + b * sxb + t * sxt + h * sxh + at, mask=inside, other=0.0)
            if HAS_NORM:
                pix = b * snb + t * snt + h * snh + w * snw
                r = tl.load(RCP + pix, mask=inside, other=1.0)
                g = tl.load(GAMMA + c).to(tl.float32)
                v = v.to(tl.float32)
                v = _norm_silu(v, NORM + pix, r, g, SILU, inside, inside, scale, eps, dtype, LIBDEVICE, BF16)
            v = v.to(dtype)
        if STACK == 1:
            tl.store(OUT + b * sob + tp * sot + hp * soh + j, v, mask=live)
        else:
            row = OUT + hp * soh + wp * (STACK * C) + c
            for k in tl.static_range(STACK):
                if (tp - k >= 0) & (tp - k < FRAMES):
                    tl.store(row + (tp - k) * sot + k * C, v, mask=live)
        if tp >= TP - KEEP:
            tl.store(NEXT + b * skb + (tp - (TP - KEEP)) * skt + h * skh + at, v, mask=inside)

    @triton.jit
    def _bias_residual_cl_kernel(
        Y, BIAS, R, N, C: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, BLOCK: tl.constexpr
    ):
        """:func:`_bias_residual_kernel` for a dense channels-last ``y`` and ``r`` of the same
        strides: ``BLOCK`` contiguous elements, channel ``j % C``."""
        j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = j < N
        dtype = Y.dtype.element_ty
        v = tl.load(Y + j, mask=m, other=0.0).to(tl.float32)
        if HAS_BIAS:
            v = (v + tl.load(BIAS + j % C).to(tl.float32)).to(dtype).to(tl.float32)
        if HAS_RES:
            v = v + tl.load(R + j, mask=m, other=0.0).to(tl.float32)
        tl.store(Y + j, v.to(dtype), mask=m)

    @triton.jit
    def _conv_input_kernel(
        X, CACHE, NORM, RCP, GAMMA, SILU, OUT, NEXT,
        C, H, W, L, TP, HP, WP, PT, PH, PW, KEEP,
        sxb, sxc, sxt, sxh, sxw,
        scb, scc, sct, sch, scw,
        snb, snt, snh, snw,
        sob, soc, sot, soh, sow,
        skb, skc, skt, skh, skw,
        scale, eps,
        HAS_NORM: tl.constexpr, LIBDEVICE: tl.constexpr, BF16: tl.constexpr,
        BC: tl.constexpr, BW: tl.constexpr,
    ):  # fmt: skip
        """One output row (b, tp, hp) of [BC channels, BW columns]: zero padding, a cached frame
        or a new frame (normalised and SiLU'd with ``HAS_NORM``: :func:`_norm_silu`); the last
        ``KEEP`` frames also into ``NEXT``, the next chunk's cache."""
        pid = tl.program_id(0)
        hp = (pid % HP).to(tl.int64)
        rest = pid // HP
        tp = (rest % TP).to(tl.int64)
        b = (rest // TP).to(tl.int64)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        wp = tl.program_id(2) * BW + tl.arange(0, BW)
        h = hp - PH
        w = wp - PW
        hv = h + w * 0  # the row's scalars as vectors over the columns (masks must be tensors)
        columns = (w >= 0) & (w < W) & (hv >= 0) & (hv < H)  # this row's columns inside the frame
        inside = (c[:, None] < C) & columns[None, :]
        live = (c[:, None] < C) & (wp < WP)[None, :]
        dst = OUT + b * sob + tp * sot + hp * soh + c[:, None] * soc + wp[None, :] * sow
        dtype = OUT.dtype.element_ty
        if tp < PT:  # a cached frame, or zeros before the cached ones
            tv = tp + w * 0
            from_cache = inside & ((tv >= PT - L) & (tv < PT))[None, :]
            src = CACHE + b * scb + (tp - (PT - L)) * sct + h * sch + c[:, None] * scc + w[None, :] * scw
            v = tl.load(src, mask=from_cache, other=0.0).to(dtype)
            tl.store(dst, v, mask=live)
        else:  # a new frame
            t = tp - PT
            v = tl.load(
                X + b * sxb + t * sxt + h * sxh + c[:, None] * sxc + w[None, :] * sxw, mask=inside, other=0.0
            )
            if HAS_NORM:
                pix = b * snb + t * snt + h * snh + w * snw
                r = tl.load(RCP + pix, mask=columns, other=1.0)
                g = tl.load(GAMMA + c, mask=c < C, other=0.0).to(tl.float32)
                v = _norm_silu(
                    v.to(tl.float32), NORM + pix[None, :], r[None, :], g[:, None], SILU, inside,
                    columns[None, :], scale, eps, dtype, LIBDEVICE, BF16,
                )  # fmt: skip
            v = v.to(dtype)
            tl.store(dst, v, mask=live)
        if tp >= TP - KEEP:
            nxt = NEXT + b * skb + (tp - (TP - KEEP)) * skt + h * skh + c[:, None] * skc + w[None, :] * skw
            tl.store(nxt, v, mask=inside)

    @triton.jit
    def _bias_residual_kernel(
        Y, BIAS, R, C, T, H, W,
        syb, syc, syt, syh, syw,
        srb, src, srt, srh, srw,
        HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, BC: tl.constexpr, BW: tl.constexpr,
    ):  # fmt: skip
        """``y += bias`` then ``y += r``, each rounded to ``y``'s dtype, in place; one row (b, t, h)
        of [BC channels, BW columns]."""
        pid = tl.program_id(0)
        h = (pid % H).to(tl.int64)
        rest = pid // H
        t = (rest % T).to(tl.int64)
        b = (rest // T).to(tl.int64)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        w = tl.program_id(2) * BW + tl.arange(0, BW)
        live = (c[:, None] < C) & (w < W)[None, :]
        dst = Y + b * syb + t * syt + h * syh + c[:, None] * syc + w[None, :] * syw
        dtype = Y.dtype.element_ty
        v = tl.load(dst, mask=live, other=0.0).to(tl.float32)
        if HAS_BIAS:
            v = (
                (v + tl.load(BIAS + c, mask=c < C, other=0.0).to(tl.float32)[:, None])
                .to(dtype)
                .to(tl.float32)
            )
        if HAS_RES:
            r = tl.load(R + b * srb + t * srt + h * srh + c[:, None] * src + w[None, :] * srw, mask=live)
            v = v + r.to(tl.float32)
        tl.store(dst, v.to(dtype), mask=live)

    @triton.jit
    def _channel_norm_kernel(
        X, OUT, P, C, T, H, W, sxb, sxc, sxt, sxh, sxw,
        S: tl.constexpr, FMA: tl.constexpr, DENSE: tl.constexpr, BP: tl.constexpr,
    ):  # fmt: skip
        """The channel norms of ``BP`` pixels (b, t, h, w order; ``OUT`` [B, 1, T, H, W])."""
        p = tl.program_id(0) * BP + tl.arange(0, BP)
        live = p < P
        q = p.to(tl.int64)
        if DENSE:  # channels-last frames: pixel q at q * C
            base = X + q * sxw
        else:
            w = q % W
            r = q // W
            h = r % H
            r = r // H
            base = X + (r // T) * sxb + (r % T) * sxt + h * sxh + w * sxw
        acc = channel_sumsq(base, sxc, C, live, BP, S, FMA)
        tl.store(OUT + q, tl.math.sqrt_rn(acc), mask=live)

    @triton.jit
    def _upsample_kernel(
        X, OUT, C, T2, H, W,
        sxb, sxc, sxt, sxh, sxw,
        son, soc, soh, sow,
        INTERLEAVE: tl.constexpr, BC: tl.constexpr, BW: tl.constexpr,
    ):  # fmt: skip
        """One output row (frame n = b * T2 + t2, row oh) of [BC channels, BW columns]."""
        pid = tl.program_id(0)
        oh = (pid % (2 * H)).to(tl.int64)
        n = (pid // (2 * H)).to(tl.int64)
        b = n // T2
        t2 = n % T2
        if INTERLEAVE:  # the time convolution's output: frame 2t + s is half s of its channels at t
            src_t = t2 // 2
            c0 = (t2 % 2) * C
        else:
            src_t = t2
            c0 = t2 * 0
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        ow = tl.program_id(2) * BW + tl.arange(0, BW)
        live = (c[:, None] < C) & (ow < 2 * W)[None, :]
        src = X + b * sxb + src_t * sxt + (oh // 2) * sxh + (c0 + c[:, None]) * sxc + (ow[None, :] // 2) * sxw
        v = tl.load(src, mask=live, other=0.0)
        tl.store(OUT + n * son + oh * soh + c[:, None] * soc + ow[None, :] * sow, v, mask=live)


def _tile(channels: int, width: int, channels_last: bool) -> tuple[int, int]:
    """Channels and columns per program: the contiguous axis of the output gets the wider side
    (under the interpreter, whole rows: it pays per program, not per element)."""
    if interpreted():
        return triton.next_power_of_2(max(channels, 1)), triton.next_power_of_2(max(width, 1))
    if channels_last:  # the largest power of two up to 64 that divides the channels: no idle lanes
        bc = min(channels & -channels, 64) if channels >= 16 else triton.next_power_of_2(max(channels, 1))
        return bc, max(2048 // bc, 8)
    bw = min(triton.next_power_of_2(max(width, 1)), 1024)  # whole rows: best measured (H200, 480p)
    return max(2048 // bw, 1), bw


def causal_conv_input(
    x: torch.Tensor,
    cache: torch.Tensor | None,
    *,
    time_pad: int,
    spatial_pad: int,
    norm: tuple[torch.Tensor, float] | None = None,
    channels_last: bool = False,
    stack: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(padded input, next cache)`` of a causal 3D convolution over ``x`` [B, C, T, H, W]:
    ``time_pad`` frames before (the cached ones, ``cache`` [B, C, L, H, W], last; zeros first),
    ``spatial_pad`` zeros around each frame. With ``norm = (gamma, scale)`` the new frames go
    through ``WanRMS_norm`` (no bias) and SiLU first. The next cache is the last
    ``min(2, L + T)`` frames of ``[cache, frames]`` (eager's rule). Bitwise equal to
    :func:`causal_conv_input_reference` on CUDA; the output contiguous, or channels-last.

    ``stack`` > 1 (one video, channels-last, where :func:`stacked_input_applies`): the padded
    input as the 2D frames a convolution of ``stack`` time taps reads, output frame ``f`` being
    padded frames ``f .. f + stack - 1`` side by side along the channels: [F, stack * C, H', W']
    channels-last, ``F = time_pad + T - stack + 1`` (:func:`stacked_reference`)."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    b, c, t, h, w = x.shape
    length = 0 if cache is None else cache.shape[2]
    if cache is not None and (cache.shape[:2] != (b, c) or cache.shape[3:] != (h, w) or length > time_pad):
        raise ValueError(f"cache {tuple(cache.shape)} does not fit frames {tuple(x.shape)}")
    tp, hp, wp = time_pad + t, h + 2 * spatial_pad, w + 2 * spatial_pad
    frames = tp - stack + 1
    if stack > 1 and not (channels_last and frames > 0 and stacked_input_applies(x, cache)):
        raise ValueError(f"no stacked input of {stack} taps for frames {tuple(x.shape)} with this cache")
    fmt = torch.channels_last_3d if channels_last else torch.contiguous_format
    dims = (frames, stack * c, hp, wp) if stack > 1 else (b, c, tp, hp, wp)
    out_fmt = torch.channels_last if stack > 1 else fmt
    out = torch.empty(dims, dtype=x.dtype, device=x.device, memory_format=out_fmt)
    norms = gamma = None
    scale = 1.0
    if norm is not None:
        gamma, scale = norm
        gamma = gamma.reshape(-1)
        norms = channel_norms(x)
    src_cache = cache if length else x
    keep = min(2, length + t)  # the next cache: the last frames of [cache, frames] (eager's rule)
    next_cache = torch.empty((b, c, keep, h, w), dtype=x.dtype, device=x.device, memory_format=fmt)
    n_strides = norms.stride() if norms is not None else x.stride()
    bf16 = norm is not None and x.dtype == torch.bfloat16 and not interpreted()
    silu = silu_table(x.device) if bf16 else x
    rcp = 1.0 / norms.clamp_min(NORM_EPS) if bf16 else x  # IEEE: RN(1 / max(n, eps))
    if stack > 1 or FLAT_CHANNELS_LAST and channels_last and _dense_cl(x) and _dense_cl(src_cache):
        grid = (b * tp * hp, triton.cdiv(wp * c, FLAT_BLOCK))
        out_strides = (0, out.stride(0), out.stride(2)) if stack > 1 else (out.stride(0), *out.stride()[2:4])
        _conv_input_cl_kernel[grid](
            x, src_cache, norms if norms is not None else x, rcp, gamma if gamma is not None else x, silu,
            out, next_cache,
            h, w, length, tp, hp, wp, time_pad, spatial_pad, spatial_pad, keep, frames,
            x.stride(0), x.stride(2), x.stride(3), *(src_cache.stride(i) for i in (0, 2, 3)),
            n_strides[0], *n_strides[2:], *out_strides, *(next_cache.stride(i) for i in (0, 2, 3)),
            float(torch.tensor(scale, dtype=torch.float32)), NORM_EPS,
            C=c, HAS_NORM=norm is not None, LIBDEVICE=not interpreted(), BF16=bf16, BLOCK=FLAT_BLOCK,
            STACK=stack, num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
        return out, next_cache
    bc, bw = _tile(c, wp, channels_last)
    grid = (b * tp * hp, triton.cdiv(c, bc), triton.cdiv(wp, bw))
    _conv_input_kernel[grid](
        x, src_cache, norms if norms is not None else x, rcp, gamma if gamma is not None else x, silu,
        out, next_cache,
        c, h, w, length, tp, hp, wp, time_pad, spatial_pad, spatial_pad, keep,
        *x.stride(), *src_cache.stride(),
        n_strides[0], *n_strides[2:],
        *out.stride(), *next_cache.stride(),
        float(torch.tensor(scale, dtype=torch.float32)), NORM_EPS,
        HAS_NORM=norm is not None, LIBDEVICE=not interpreted(), BF16=bf16, BC=bc, BW=bw, num_warps=4,
        enable_fp_fusion=False,
    )  # fmt: skip
    return out, next_cache


#: Dense channels-last tensors go through the flat kernels (rows of ``W * C`` contiguous
#: elements, ``FLAT_BLOCK`` a program); ``False``: the tiled ones (a probe's switch).
FLAT_CHANNELS_LAST = True
FLAT_BLOCK = 2048


def _dense_cl(t: torch.Tensor) -> bool:
    return t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d) and t.shape[1] > 1


def stacked_input_applies(x: torch.Tensor, cache: torch.Tensor | None) -> bool:
    """Whether :func:`causal_conv_input` can write ``x``'s input stacked (``stack`` > 1): one
    video, its frames (and cache) dense channels-last."""
    return x.shape[0] == 1 and _dense_cl(x) and (cache is None or cache.shape[2] == 0 or _dense_cl(cache))


def stacked_reference(padded: torch.Tensor, stack: int) -> torch.Tensor:
    """A padded input [1, C, T', H', W'] as :func:`causal_conv_input` stacks it: [T' - stack + 1,
    stack * C, H', W'], output frame ``f`` the frames ``f .. f + stack - 1`` along the channels."""
    frames = padded.shape[2] - stack + 1
    thwc = padded[0].permute(1, 2, 3, 0)
    stacked = torch.cat([thwc[k : k + frames] for k in range(stack)], dim=-1)
    return stacked.permute(0, 3, 1, 2)


def add_bias_residual_(
    y: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """``y`` [B, C, T, H, W] plus ``bias`` [C] (per channel), then plus ``residual`` (any strides),
    in place, each sum rounded to ``y``'s dtype: what ATen does after a cuDNN convolution (the
    bias added to the output, ``output.add_(bias)``) and a residual block's ``x + shortcut``, in
    one pass where eager takes two (the first a slow broadcast, the second a slow strided add when
    the shortcut is an upsampler's frames-first view). Returns ``y``."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    b, c, t, h, w = y.shape
    if residual is not None and (residual.shape != y.shape or residual.dtype != y.dtype):
        raise ValueError(f"cannot add {tuple(residual.shape)} {residual.dtype} to {tuple(y.shape)} {y.dtype}")
    if bias is not None and bias.shape != (c,):
        raise ValueError(f"a bias of {tuple(bias.shape)} does not fit {c} channels")
    if bias is None and residual is None:
        return y
    r = residual if residual is not None else y
    if FLAT_CHANNELS_LAST and _dense_cl(y) and r.stride() == y.stride():
        _bias_residual_cl_kernel[(triton.cdiv(y.numel(), FLAT_BLOCK),)](
            y, bias if bias is not None else y, r, y.numel(), C=c,
            HAS_BIAS=bias is not None, HAS_RES=residual is not None, BLOCK=FLAT_BLOCK, num_warps=4,
            enable_fp_fusion=False,
        )  # fmt: skip
        return y
    bc, bw = _tile(c, w, y.stride(1) == 1 and c > 1)
    grid = (b * t * h, triton.cdiv(c, bc), triton.cdiv(w, bw))
    _bias_residual_kernel[grid](
        y, bias if bias is not None else y, r, c, t, h, w, *y.stride(), *r.stride(),
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, BC=bc, BW=bw, num_warps=4,
        enable_fp_fusion=False,
    )  # fmt: skip
    return y


def upsample_frames_reference(x: torch.Tensor, *, interleave: bool) -> torch.Tensor:
    """Eager's frames-first nearest 2x upsampling (``WanResample``, after its time convolution
    when ``interleave``): [B, C', T, H, W] -> [B * T2, C, 2H, 2W]."""
    if interleave:
        b, c2, t, h, w = x.shape
        x = x.reshape(b, 2, c2 // 2, t, h, w)
        x = torch.stack((x[:, 0], x[:, 1]), 3).reshape(b, c2 // 2, t * 2, h, w)
    b, c, t, h, w = x.shape
    frames = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
    return F.interpolate(frames.float(), scale_factor=(2.0, 2.0), mode="nearest-exact").type_as(frames)


def upsample_frames(x: torch.Tensor, *, interleave: bool, channels_last: bool = False) -> torch.Tensor:
    """:func:`upsample_frames_reference` as one gather (a copy: bitwise by construction)."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    b, c, t, h, w = x.shape
    if interleave:
        if c % 2:
            raise ValueError("an interleaved upsampling needs an even channel count")
        c, t = c // 2, t * 2
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    out = torch.empty((b * t, c, 2 * h, 2 * w), dtype=x.dtype, device=x.device, memory_format=fmt)
    bc, bw = _tile(c, 2 * w, channels_last)
    grid = (b * t * 2 * h, triton.cdiv(c, bc), triton.cdiv(2 * w, bw))
    _upsample_kernel[grid](
        x, out, c, t, h, w, *x.stride(), *out.stride(), INTERLEAVE=interleave, BC=bc, BW=bw, num_warps=4
    )
    return out
