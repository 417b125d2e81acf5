"""LayerNorm fused with adaptive scale/shift modulation: ``(LN(x) * (1 + scale) + shift)`` in one
launch.

``adaln_modulate(x, scale, shift, eps=...)`` with ``x`` [B, S, C] (any strides with a contiguous
last dim) and ``scale``/``shift`` broadcastable to it: shared ``(C,)``, ``(1, C)``, ``(1, 1, C)``,
per sample ``(B, 1, C)`` or per token ``(B, S, C)``, contiguous or strided views (Wan's
``(table + temb).chunk(6, dim=1)`` pieces are views at a ``6 C`` stride). Either may be None.
Optional LayerNorm ``weight``/``bias`` (C,). Returns ``x``'s shape and dtype, contiguous.

The chain is the DiT's (Wan's ``WanTransformerBlock`` norm1/norm3, diffusers 0.42): LayerNorm in
fp32 of ``x.float()`` (``FP32LayerNorm``), times ``1 + scale`` (an fp32 sum of its own), plus
``shift``, each in fp32, rounded once to ``x``'s dtype. Eager it is 5 launches and 5 passes over
the activations in fp32. ``exact`` reproduces each rounding, including the row statistics as ATen's
fused layer-norm kernel folds them (a Welford triple per thread in 4-element vectors, then a
halving tree, ``reduce_order``); ``fast`` computes the statistics in Triton's order and rounds
once.

:func:`adaln_modulate` dispatches through the custom op ``omnirt::adaln_modulate`` (traced by
``torch.compile``, captured by CUDA graphs) where the kernel applies, and runs the eager chain
(:func:`adaln_modulate_reference`) elsewhere.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F

from . import settings
from .reduce_order import LN_THREADS, LN_VEC
from .settings import Preset, check_preset, interpreted

try:  # Triton ships with CUDA builds of torch only
    import triton
    import triton.language as tl

    from .reduce_order import vector_items
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

#: Widest row the kernel holds in registers.
MAX_WIDTH = 16384
#: How nvcc contracted ``nA * A.mean + nB * B.mean`` in ATen's Welford combine (``"none"``,
#: ``"a"``: ``fma(nA, A.mean, nB * B.mean)``, ``"b"``: ``fma(nB, B.mean, nA * A.mean)``), and
#: whether the online update and the combine's ``sigma2`` are fused multiply-adds. Measured on
#: the H200 (``benchmarks/kernels.py --numerics``).
COMBINE_MEAN_FMA = "a"  # (the measured shapes do not tell the three apart)
_COMBINE_MEAN_FMAS = ("none", "a", "b")
ONLINE_FMA = True
#: How the kernel walks ATen's order: the halving tree as explicit splits (``"split"``) or as
#: Triton's own reduction over 4 warps (``"reduce"``); each thread's vectors as 4 loads
#: (``"items"``) or one [128, 4] tile (``"tile"``). All give the same bits; they differ in speed.
#: Rows of whole 512-element steps always read the tile, unmasked: compiled for sm_90 with the
#: launch's specialisation that is one 8-byte load a vector where the items are four 2-byte ones.
TREE = "reduce"
LOAD = "items"
#: Rows of whole 512-element steps: every combine of the tree joins two equal counts, so ATen's
#: ``nA = nB = count * (1 / total)`` is one constant for the row's width
#: (:func:`even_combine_coefficient`) and the kernel may take it instead of dividing at each of the
#: tree's 7 levels (the same bits; ``"known"``) or divide as ATen does (``"divide"``). Under the
#: interpreter Triton's reduction folds in order (unequal counts), so there ``"known"`` applies to
#: the explicit tree (``tree="split"``) only. ``"known"`` since the GPU measured it (an H100,
#: 2026-12-05: bitwise equal to eager in the GPU tests and ``benchmarks/kernels.py --variants``,
#: 0.073 against 0.080 ms at Wan 1.3B 480p; docs/benchmarks.md).
COMBINE = "known"
_COMBINES = ("divide", "known")
#: Where the ``exact`` kernel reads a row of whole 512-element steps for its output: again, chunk
#: by chunk, from cache (``"reload"``), or from the tiles its statistics loaded, held in registers
#: (``"held"``: the row read once, in the layout of ATen's threads, 8-byte vectors; rows of at
#: most :data:`HELD_STEPS` steps). The same bits; they differ in speed (``benchmarks/kernels.py
#: --variant-speed``). ``"held"`` since measured on an H100 (2026-12-05): bitwise equal to eager in
#: the GPU tests and at every numerics shape; 0.518 against 0.712 ms at Wan 14B 720p (75600 x
#: 5120, 1.30x torch.compile where the second read was 0.94x), 0.070 against 0.072 at Wan 1.3B.
OUTPUT_FROM = "held"
_OUTPUT_FROMS = ("reload", "held")
#: The longest row, in 512-element steps, whose tiles ``"held"`` keeps (4 fp32 registers a step
#: and thread once converted).
HELD_STEPS = 16
#: Rows a program of held rows takes (1, 2 or 4): every row's tiles are loaded before the first
#: row's statistics, so more bytes are in flight for narrow rows, each row summed in ATen's order
#: as alone (the same bits).
ROWS = 1
#: Whether ``exact`` is bitwise equal to eager on the GPU tests' shapes (measured on the H200,
#: without a LayerNorm weight and bias, as Wan's norm1/norm3); the dispatcher's ``auto`` setting
#: uses the kernel only then.
BITWISE = True


def adaln_modulate_reference(
    x: torch.Tensor,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    *,
    eps: float,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    scale_offset: float = 1.0,
) -> torch.Tensor:
    """The eager chain, as Wan's block writes it."""
    out = F.layer_norm(
        x.float(),
        (x.shape[-1],),
        weight.float() if weight is not None else None,
        bias.float() if bias is not None else None,
        eps,
    )
    if scale is not None:
        out = out * (scale_offset + scale.float())
    if shift is not None:
        out = out + shift.float()
    return out.to(x.dtype).contiguous()


if triton is not None:

    @triton.jit
    def _halves(x, R: tl.constexpr, N: tl.constexpr):
        """``x`` [R, N] as its first and second halves of columns, each [R, N / 2]."""
        return tl.split(tl.permute(tl.reshape(x, (R, 2, N // 2)), (0, 2, 1)))

    @triton.jit
    def _online_known(v, mean, m2, coef, ONLINE_FMA: tl.constexpr):
        """ATen's Welford update of one element given ``coef``, ``1 / new_count`` correctly
        rounded (:func:`_online` divides for it; a row of whole steps reads it from a table)."""
        delta = v - mean
        if ONLINE_FMA:
            new_mean = tl.fma(delta, coef, mean)
            new_m2 = tl.fma(delta, v - new_mean, m2)
        else:
            new_mean = mean + delta * coef
            new_m2 = m2 + delta * (v - new_mean)
        return new_mean, new_m2

    @triton.jit
    def _online(v, mean, m2, count, live, ONLINE_FMA: tl.constexpr):
        """ATen's ``cuWelfordOnlineSum`` of one element per thread (where ``live``)."""
        new_count = count + 1.0
        coef = tl.math.div_rn(tl.full(v.shape, 1.0, tl.float32), new_count)
        new_mean, new_m2 = _online_known(v, mean, m2, coef, ONLINE_FMA)
        return (
            tl.where(live, new_mean, mean),
            tl.where(live, new_m2, m2),
            tl.where(live, new_count, count),
        )

    @triton.jit
    def _join(own_mean, own_m2, mean, m2, count, n_a, n_b, MEAN_FMA: tl.constexpr):
        """The mean and ``m2`` of ATen's ``cuWelfordCombine`` given its coefficients ``nA``, ``nB``
        (``count``: the other state's)."""
        delta = own_mean - mean
        if MEAN_FMA == 1:
            new_mean = tl.fma(n_a, mean, n_b * own_mean)
        elif MEAN_FMA == 2:
            new_mean = tl.fma(n_b, own_mean, n_a * mean)
        else:
            new_mean = n_a * mean + n_b * own_mean
        return new_mean, tl.fma(delta * delta * count, n_b, m2 + own_m2)

    @triton.jit
    def _combine(own_mean, own_m2, own_count, mean, m2, count, MEAN_FMA: tl.constexpr):
        """ATen's ``cuWelfordCombine(own, other)``: ``A`` the other thread's state, ``B`` this one's."""
        total = count + own_count
        some = total > 0
        coef = tl.math.div_rn(tl.full(total.shape, 1.0, tl.float32), tl.where(some, total, 1.0))
        new_mean, new_m2 = _join(own_mean, own_m2, mean, m2, count, count * coef, own_count * coef, MEAN_FMA)
        return tl.where(some, new_mean, 0.0), tl.where(some, new_m2, 0.0), total

    @triton.jit
    def _combine_known(own_mean, own_m2, own_count, mean, m2, count, half, MEAN_FMA: tl.constexpr):
        """:func:`_combine` of two states with the same count: ``nA = nB = half``, the bits
        ``count * (1 / total)`` has at every level of the tree (:func:`even_combine_coefficient`)."""
        new_mean, new_m2 = _join(own_mean, own_m2, mean, m2, count, half, half, MEAN_FMA)
        return new_mean, new_m2, count + own_count

    @triton.jit
    def _halve(mean, m2, count, half, R: tl.constexpr, N: tl.constexpr, MEAN_FMA: tl.constexpr,
               KNOWN: tl.constexpr):  # fmt: skip
        m_own, m_other = _halves(mean, R, N)
        s_own, s_other = _halves(m2, R, N)
        c_own, c_other = _halves(count, R, N)
        if KNOWN:
            return _combine_known(m_own, s_own, c_own, m_other, s_other, c_other, half, MEAN_FMA)
        return _combine(m_own, s_own, c_own, m_other, s_other, c_other, MEAN_FMA)

    @triton.jit
    def _reduce_combine(mean_a, m2_a, count_a, mean_b, m2_b, count_b):
        """:func:`_combine` as a ``tl.reduce`` combine function (``a`` this lane's state)."""
        return _combine(mean_a, m2_a, count_a, mean_b, m2_b, count_b, 1)

    @triton.jit
    def _reduce_combine_known(mean_a, m2_a, count_a, half_a, mean_b, m2_b, count_b, half_b):
        """:func:`_combine_known` as a ``tl.reduce`` combine function (``half`` carried along)."""
        new_mean, new_m2, total = _combine_known(mean_a, m2_a, count_a, mean_b, m2_b, count_b, half_a, 1)
        return new_mean, new_m2, total, half_a

    @triton.jit
    def _whole_row(src, row, total, LN_K: tl.constexpr):
        """Row ``row`` (at ``src``) of whole 512-element steps as ATen's threads read it: one
        [128, 4] tile a step (thread ``t``'s vectors ``t, t + 128, ...``); zeros past ``total``."""
        thread = tl.arange(0, 128)
        ok = (row + thread * 0 < total)[:, None]
        tiles = ()
        for step in tl.static_range(LN_K):
            vector = src + (step * 512 + thread * 4)[:, None] + tl.arange(0, 4)[None, :]
            tiles = tiles + (tl.load(vector, mask=ok, other=0.0),)
        return tiles

    @triton.jit
    def _ln_order_stats(src, n, half, tiles, LN_K: tl.constexpr, ONLINE_FMA: tl.constexpr,
                        MEAN_FMA: tl.constexpr, TREE: tl.constexpr, LOAD: tl.constexpr, EVEN: tl.constexpr,
                        KNOWN: tl.constexpr, LOADED: tl.constexpr):  # fmt: skip
        """Mean and variance of the row ``src[0:n]`` as ATen's fused layer-norm kernel computes
        them (``reduce_order``): per thread its 4-element vectors ``t, t + 128, ...`` folded
        element by element, then lanes halved within each warp, then the 4 warps. ``EVEN``: the
        row is whole 512-element steps, so every thread's k-th update divides by k: ``1 / k`` is a
        compile-time constant (rounded once to fp32, as the division rounds it: checked for every
        ``k`` a row can have in ``tests/kernels/test_adaln.py``), and no division is left in the
        chain. ``LOADED`` (whole rows only): the row's tiles are ``tiles`` (:func:`_whole_row`)."""
        thread = tl.arange(0, 128)
        mean = tl.zeros([128], tl.float32)
        m2 = tl.zeros([128], tl.float32)
        count = tl.zeros([128], tl.float32)
        for step in tl.static_range(LN_K):  # unrolled: every vector's load issued up front
            first = step * 512 + thread * 4  # [128] each thread's vector
            live = first < n
            if EVEN or LOAD:  # one 8-byte vector a thread (sm_90: LDG.E.64, not four LDG.E.U16)
                vector = src + first[:, None] + tl.arange(0, 4)[None, :]
                if EVEN:  # whole rows: no mask (``LOADED``: the caller's ``tiles``, :func:`_whole_row`)
                    if LOADED:
                        tile = tiles[step]
                    else:
                        tile = tl.load(vector)
                    v0, v1, v2, v3 = vector_items(tile)
                else:
                    v0, v1, v2, v3 = vector_items(tl.load(vector, mask=live[:, None], other=0.0))
                if EVEN:
                    mean, m2 = _online_known(v0, mean, m2, 1.0 / (step * 4 + 1), ONLINE_FMA)
                    mean, m2 = _online_known(v1, mean, m2, 1.0 / (step * 4 + 2), ONLINE_FMA)
                    mean, m2 = _online_known(v2, mean, m2, 1.0 / (step * 4 + 3), ONLINE_FMA)
                    mean, m2 = _online_known(v3, mean, m2, 1.0 / (step * 4 + 4), ONLINE_FMA)
                else:
                    mean, m2, count = _online(v0, mean, m2, count, live, ONLINE_FMA)
                    mean, m2, count = _online(v1, mean, m2, count, live, ONLINE_FMA)
                    mean, m2, count = _online(v2, mean, m2, count, live, ONLINE_FMA)
                    mean, m2, count = _online(v3, mean, m2, count, live, ONLINE_FMA)
            else:
                for item in tl.static_range(4):
                    v = tl.load(src + first + item, mask=live, other=0.0).to(tl.float32)
                    mean, m2, count = _online(v, mean, m2, count, live, ONLINE_FMA)
        if EVEN:
            count = tl.full([128], LN_K * 4, tl.float32)
        if TREE and KNOWN:  # the combine's coefficient known (``COMBINE``), carried as a fourth value
            halves = tl.full([128], half, tl.float32)
            mean_all, m2_all, count_all, halves = tl.reduce(
                (mean, m2, count, halves), 0, _reduce_combine_known
            )
        elif TREE:
            # Triton's reduction of 128 values over 4 warps of one each: a butterfly within the
            # warp (xor 16, 8, ..., 1), then across the 4 warps; lane 0's result is the halving tree
            mean_all, m2_all, count_all = tl.reduce((mean, m2, count), 0, _reduce_combine)
        else:
            mean = tl.reshape(mean, (4, 32))
            m2 = tl.reshape(m2, (4, 32))
            count = tl.reshape(count, (4, 32))
            mean, m2, count = _halve(mean, m2, count, half, 4, 32, MEAN_FMA, KNOWN)
            mean, m2, count = _halve(mean, m2, count, half, 4, 16, MEAN_FMA, KNOWN)
            mean, m2, count = _halve(mean, m2, count, half, 4, 8, MEAN_FMA, KNOWN)
            mean, m2, count = _halve(mean, m2, count, half, 4, 4, MEAN_FMA, KNOWN)
            # [4, 1] after the last: lane 0 of each warp
            mean, m2, count = _halve(mean, m2, count, half, 4, 2, MEAN_FMA, KNOWN)
            mean = tl.reshape(mean, (1, 4))
            m2 = tl.reshape(m2, (1, 4))
            count = tl.reshape(count, (1, 4))
            mean, m2, count = _halve(mean, m2, count, half, 1, 4, MEAN_FMA, KNOWN)
            mean, m2, count = _halve(mean, m2, count, half, 1, 2, MEAN_FMA, KNOWN)
            mean_all = tl.sum(tl.reshape(mean, (1,)), axis=0)
            m2_all = tl.sum(tl.reshape(m2, (1,)), axis=0)
        return mean_all, tl.math.div_rn(m2_all, n.to(tl.float32))

    @triton.jit
    def _modulate(x, c, live, mean, rstd, b, s, W, BIAS, SCALE, SHIFT, ssc_b, ssc_s, ssc_c, ssh_b, ssh_s,
                  ssh_c, scale_offset, HAS_SCALE: tl.constexpr, HAS_SHIFT: tl.constexpr, HAS_W: tl.constexpr,
                  HAS_B: tl.constexpr):  # fmt: skip
        """``(LN(x) * (offset + scale) + shift)`` of one row chunk, each step rounded in fp32."""
        y = rstd * (x - mean)
        if HAS_W and HAS_B:  # gamma * y + beta, one rounding (as nvcc contracts ATen's)
            w = tl.load(W + c, mask=live, other=0.0).to(tl.float32)
            y = tl.fma(w, y, tl.load(BIAS + c, mask=live, other=0.0).to(tl.float32))
        elif HAS_W:
            y = tl.load(W + c, mask=live, other=0.0).to(tl.float32) * y
        elif HAS_B:
            y = y + tl.load(BIAS + c, mask=live, other=0.0).to(tl.float32)
        if HAS_SCALE:
            sc = tl.load(SCALE + b * ssc_b + s * ssc_s + c * ssc_c, mask=live, other=0.0).to(tl.float32)
            y = y * (scale_offset + sc)
        if HAS_SHIFT:
            y = y + tl.load(SHIFT + b * ssh_b + s * ssh_s + c * ssh_c, mask=live, other=0.0).to(tl.float32)
        return y

    @triton.jit
    def _adaln_kernel(
        X, OUT, SCALE, SHIFT, W, BIAS,
        S, C, total,
        sx_b, sx_s, so_b, so_s,
        ssc_b, ssc_s, ssc_c, ssh_b, ssh_s, ssh_c,
        eps, scale_offset, half,
        CB: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr, HAS_SCALE: tl.constexpr,
        HAS_SHIFT: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, EXACT: tl.constexpr,
        LN_K: tl.constexpr, ONLINE_FMA: tl.constexpr, MEAN_FMA: tl.constexpr, TREE: tl.constexpr,
        LOAD: tl.constexpr, EVEN: tl.constexpr, KNOWN: tl.constexpr, HELD: tl.constexpr,
        ROWS: tl.constexpr,
    ):  # fmt: skip
        if HELD:
            # ``ROWS`` rows a program (``total`` of them in all), every row's tiles loaded before
            # the first row's statistics: more bytes in flight, each row in ATen's order as alone
            first = tl.program_id(0).to(tl.int64) * ROWS
            loaded = ()
            for r in tl.static_range(ROWS):
                row = first + r
                src = X + (row // S) * sx_b + (row % S) * sx_s
                loaded = loaded + (_whole_row(src, row, total, LN_K),)
            thread = tl.arange(0, 128)
            for r in tl.static_range(ROWS):
                row = first + r
                b = row // S
                s = row % S
                src = X + b * sx_b + s * sx_s
                dst = OUT + b * so_b + s * so_s
                mean, var = _ln_order_stats(src, C + row * 0, half, loaded[r], LN_K, ONLINE_FMA, MEAN_FMA,
                                            TREE, LOAD, EVEN, KNOWN, True)  # fmt: skip
                rstd = tl.math.rsqrt(var + eps)
                for step in tl.static_range(LN_K):
                    c = step * 512 + thread[:, None] * 4 + tl.arange(0, 4)[None, :]  # [128, 4]
                    live = (c < C) & (row + c * 0 < total)
                    y = _modulate(loaded[r][step].to(tl.float32), c, live, mean, rstd, b, s, W, BIAS, SCALE,
                                  SHIFT, ssc_b, ssc_s, ssc_c, ssh_b, ssh_s, ssh_c, scale_offset, HAS_SCALE,
                                  HAS_SHIFT, HAS_W, HAS_B)  # fmt: skip
                    tl.store(dst + c, y.to(OUT.dtype.element_ty), mask=live)
            return
        row = tl.program_id(0).to(tl.int64)
        b = row // S
        s = row % S
        src = X + b * sx_b + s * sx_s
        dst = OUT + b * so_b + s * so_s
        n = C + row * 0
        if EXACT:
            # statistics in ATen's order, then the row again chunk by chunk (from cache)
            mean, var = _ln_order_stats(src, n, half, (), LN_K, ONLINE_FMA, MEAN_FMA, TREE, LOAD, EVEN,
                                        KNOWN, False)  # fmt: skip
            rstd = tl.math.rsqrt(var + eps)
            for chunk in tl.static_range(CHUNKS):  # unrolled, as the statistics' loads
                c = chunk * CHUNK + tl.arange(0, CHUNK)
                live = c < C
                x = tl.load(src + c, mask=live, other=0.0).to(tl.float32)
                y = _modulate(x, c, live, mean, rstd, b, s, W, BIAS, SCALE, SHIFT, ssc_b, ssc_s,
                              ssc_c, ssh_b, ssh_s, ssh_c, scale_offset, HAS_SCALE, HAS_SHIFT, HAS_W,
                              HAS_B)  # fmt: skip
                tl.store(dst + c, y.to(OUT.dtype.element_ty), mask=live)
        else:
            c = tl.arange(0, CB)
            live = c < C
            x = tl.load(src + c, mask=live, other=0.0).to(tl.float32)
            mean = tl.sum(x, axis=0) / C
            centred = tl.where(live, x - mean, 0.0)
            rstd = tl.math.rsqrt(tl.sum(centred * centred, axis=0) / C + eps)
            y = _modulate(x, c, live, mean, rstd, b, s, W, BIAS, SCALE, SHIFT, ssc_b, ssc_s, ssc_c,
                          ssh_b, ssh_s, ssh_c, scale_offset, HAS_SCALE, HAS_SHIFT, HAS_W, HAS_B)  # fmt: skip
            tl.store(dst + c, y.to(OUT.dtype.element_ty), mask=live)


@functools.cache  # (per width: the dispatcher's launches ask on every call)
def even_combine_coefficient(width: int) -> float:
    """``nA`` (= ``nB``) of ATen's Welford combine of two equal counts ``c``: ``c * (1 / (2 c))`` in
    fp32, each step rounded, for the per-thread count of a row ``width`` wide (whole 512-element
    steps). The same bits at every level of the tree, where the counts double: scaling ``c`` by a
    power of two scales ``1 / (2 c)`` by its inverse exactly (fp32 normal range), and the product
    rounds to the same value."""
    count = np.float32(width // LN_THREADS)
    return float(count * (np.float32(1.0) / (np.float32(2.0) * count)))


def fast_warps(block: int) -> int:
    """Warps of the ``fast`` kernel for a row padded to ``block`` (the ``exact`` one runs ATen's
    4: its order is 128 threads'). Measured on the H200 (``benchmarks/kernels.py
    --variant-speed``, 2026-12-04): 2 warps at 1536 wide (0.054 ms against 0.064 at 4), 4 at 5120
    (0.211 against 0.309 at 16, the rule before), 4 and 8 alike at 3072."""
    return 2 if block <= 2048 else (8 if block <= 4096 else 4)


def _modulation_strides(m: torch.Tensor | None, x: torch.Tensor) -> tuple[int, int, int]:
    if m is None:
        return 0, 0, 0
    strides = m.expand(x.shape).stride()
    return strides[0], strides[1], strides[2]


def _check(
    x: torch.Tensor,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> str | None:
    """Why the kernel cannot take these inputs, or None."""
    if x.dim() != 3:
        return "x must be [B, S, C]"
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"unsupported dtype {x.dtype}"
    width = x.shape[-1]
    if x.stride(-1) != 1 or width > MAX_WIDTH:
        return f"x must have a contiguous last dim of at most {MAX_WIDTH}"
    if (
        width % LN_VEC
        or (x.shape[1] > 1 and x.stride(1) % LN_VEC)
        or (x.shape[0] > 1 and x.stride(0) % LN_VEC)
    ):
        return "rows must be multiples of 4 elements apart (ATen's vectorised layer norm)"
    for m in (scale, shift):
        if m is None:
            continue
        if m.dim() > 3 or m.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return "scale and shift must be float tensors of at most 3 dims"
        try:
            m.expand(x.shape)
        except RuntimeError:
            return f"modulation of shape {tuple(m.shape)} does not broadcast to {tuple(x.shape)}"
    for p in (weight, bias):
        if p is not None and (p.shape != (width,) or not p.is_contiguous()):
            return "weight and bias must be contiguous (C,)"
    return None


def _launch(
    x: torch.Tensor,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    scale_offset: float,
    preset: str,
    online_fma: bool | None = None,
    combine_mean_fma: str | None = None,
    tree: str | None = None,
    load: str | None = None,
    warps: int | None = None,
    even: bool | None = None,
    combine: str | None = None,
    output_from: str | None = None,
    rows: int | None = None,
) -> torch.Tensor:
    """``even``: where the row is whole 512-element steps, take the Welford updates' ``1 / k`` as
    constants (None: the default, yes; False: divide as ATen does, for tests; the same bits).
    ``combine``: see :data:`COMBINE`; ``output_from``: see :data:`OUTPUT_FROM`; ``rows``: see
    :data:`ROWS`."""
    combine = combine or COMBINE
    if combine not in _COMBINES:
        raise ValueError(f"combine must be one of {_COMBINES}, got {combine!r}")
    output_from = output_from or OUTPUT_FROM
    if output_from not in _OUTPUT_FROMS:
        raise ValueError(f"output_from must be one of {_OUTPUT_FROMS}, got {output_from!r}")
    batch, seq, width = x.shape
    if preset == "exact" and x.data_ptr() % 16:
        # ATen reads a misaligned row unvectorised, in an order the kernel does not model
        return adaln_modulate_reference(
            x, scale, shift, eps=eps, weight=weight, bias=bias, scale_offset=scale_offset
        )
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block = triton.next_power_of_2(width)
    ssc = _modulation_strides(scale, x)
    ssh = _modulation_strides(shift, x)
    whole = width % (LN_THREADS * LN_VEC) == 0
    split = (tree or TREE) == "split"
    known = preset == "exact" and whole and combine == "known" and (split or not interpreted())
    even = preset == "exact" and whole and even is not False
    steps = triton.cdiv(width, LN_THREADS * LN_VEC)
    held = even and output_from == "held" and steps <= HELD_STEPS
    per_program = (rows or ROWS) if held else 1
    if per_program not in (1, 2, 4):
        raise ValueError(f"rows must be 1, 2 or 4, got {per_program}")
    _adaln_kernel[(triton.cdiv(batch * seq, per_program),)](
        x, out,
        scale if scale is not None else x, shift if shift is not None else x,
        weight if weight is not None else x, bias if bias is not None else x,
        seq, width, batch * seq,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        *ssc, *ssh,
        eps, scale_offset, even_combine_coefficient(width) if known else 0.0,
        CB=block, CHUNK=min(block, 1024), CHUNKS=triton.cdiv(width, min(block, 1024)),
        HAS_SCALE=scale is not None, HAS_SHIFT=shift is not None,
        HAS_W=weight is not None, HAS_B=bias is not None, EXACT=preset == "exact",
        LN_K=steps,
        ONLINE_FMA=ONLINE_FMA if online_fma is None else online_fma,
        MEAN_FMA=_COMBINE_MEAN_FMAS.index(combine_mean_fma or COMBINE_MEAN_FMA),
        TREE=("split", "reduce").index(tree or TREE), LOAD=("items", "tile").index(load or LOAD),
        EVEN=even, KNOWN=known, HELD=held, ROWS=per_program,
        num_warps=4 if preset == "exact" else warps or fast_warps(block),
        enable_fp_fusion=preset != "exact",
    )  # fmt: skip
    return out


def adaln_modulate_triton(
    x: torch.Tensor,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    *,
    eps: float,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    scale_offset: float = 1.0,
    preset: Preset = "exact",
    **variant: object,
) -> torch.Tensor:
    """The kernel itself, on any device Triton runs on (the CPU under ``TRITON_INTERPRET=1``);
    raises ValueError for inputs it does not support."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    reason = _check(x, scale, shift, weight, bias)
    if reason:
        raise ValueError(reason)
    return _launch(x, scale, shift, weight, bias, eps, scale_offset, check_preset(preset), **variant)


@torch.library.custom_op("omnirt::adaln_modulate", mutates_args=())
def _adaln_op(
    x: torch.Tensor,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    scale_offset: float,
    preset: str,
) -> torch.Tensor:
    return _launch(x, scale, shift, weight, bias, eps, scale_offset, preset)


@_adaln_op.register_fake
def _adaln_fake(x, scale, shift, weight, bias, eps, scale_offset, preset):
    return x.new_empty(x.shape)


def kernel_applies(
    x: torch.Tensor,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> bool:
    """Whether :func:`adaln_modulate` would run the kernel for these inputs."""
    if not settings.kernel_device(x, scale, shift, weight, bias):
        return False
    return _check(x, scale, shift, weight, bias) is None and settings.wanted(
        BITWISE and weight is None and bias is None
    )


def adaln_modulate(
    x: torch.Tensor,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    *,
    eps: float,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    scale_offset: float = 1.0,
    preset: Preset = "exact",
) -> torch.Tensor:
    """The fused kernel where it applies (:func:`kernel_applies`), else the eager chain."""
    if kernel_applies(x, scale, shift, weight, bias):
        return settings.dispatch(
            torch.ops.omnirt.adaln_modulate, _launch,
            x, scale, shift, weight, bias, eps, scale_offset, check_preset(preset),
        )  # fmt: skip
    return adaln_modulate_reference(
        x, scale, shift, eps=eps, weight=weight, bias=bias, scale_offset=scale_offset
    )
