"""The summation orders of ATen's CUDA reductions, as Triton helpers, so that a fused kernel's
``exact`` preset adds the same numbers in the same order as the eager chain it replaces.

Floating-point addition is not associative: a fused RMSNorm that sums a row's squares in its own
order gets a variance one ulp away from eager's now and then, and after the rounding to bf16 a few
outputs in a million differ. Matching eager bit for bit means matching its order. Two reductions
matter for the DiT and speech chains (read from ATen's sources, then confirmed element for element
on the H200 with torch 2.11):

- **A ``mean(-1)`` over one head of 128** (the composite RMSNorm of transformers and diffusers:
  ``x.float().pow(2).mean(-1)``; ``Reduce.cuh``): 32 lanes share a row, lane ``l`` reads the
  4-element vector ``4l .. 4l + 3`` and adds its items in order; the warp then halves the lanes
  (``l + 16``, ``l + 8``, ...). The mean is the sum times ``float(rows) / float(numel)``. This is
  what the H200 measured (torch 2.11: ``benchmarks/kernels.py --variants``; the unvectorised
  order with an adjacent-pair tree, which ATen's source suggests for 128 and fewer elements, was
  20 to 50 elements in 8 million away). :func:`aten_reduce_config` gives the unvectorised
  configuration for other widths, which no bitwise claim covers.
- **A ``mean(-1)`` over a wider row** (a decoder's RMSNorm over its hidden size: 1024, 2048 ...;
  ``Reduce.cuh`` read from the headers, ``kernels/rms_norm.py``): the same vectorised walk, but a
  lane folds several vectors (``l, l + lanes, ...``) into four accumulators, and the block's
  width (:func:`aten_vec4_config`) depends on the number of rows reduced: 512 lanes for one row of
  2048, 32 from 16 rows on. :func:`vec4_lanes_sum` ends it; :func:`aten_mean_config` picks this or
  the element-wise walk of narrower rows, :func:`mean_sumsq_reference` is either in NumPy.
- **A row of the fused layer-norm kernels** (``layer_norm_kernel.cu`` ``compute_stats``: LayerNorm,
  and ``torch.nn.RMSNorm`` / ``F.rms_norm`` on CUDA): 128 threads (32 lanes x 4 warps) read the row
  in 4-element vectors, thread ``t`` the vectors ``t, t + 128, ...``, each element folded into the
  thread's running state in order; then a shuffle tree halves the 32 lanes of each warp
  (``l + 16``, ``l + 8``, ...) and shared memory halves the 4 warps. :func:`halving_sum` is the
  tree written out; Triton's own reduction of a [128] tensor over 4 warps of one value each is the
  same tree (a butterfly within the warp, then across warps; lane 0's result) and needs no layout
  changes, so the kernels use it (``TREE = "reduce"``; both measured bitwise). The kernels walk the
  row per thread themselves (their state is a sum of squares or a Welford triple).

- **A channel norm of NCDHW frames** (``torch.linalg.vector_norm(x, dim=1)``, as
  ``F.normalize(x.float(), dim=1)`` takes it in the Wan VAE's ``WanRMS_norm``; ``Reduce.cuh``,
  ``NormTwoOps``): the channel dim is not the innermost one, so ATen gives each thread its own
  outputs (vectorised by ``output_vec_size`` pixels) and splits the channels over the block's
  ``threadIdx.y`` when there are enough of them (:func:`aten_channel_splits`: ``S`` = 4 at the
  decoder's shapes). Thread ``y`` reads channels ``y, y + S, y + 2S, ...``, its ``j``-th one into
  accumulator ``j % 4`` (``vt0`` = 4, ``acc + x * x`` contracted into an FMA), combines the four
  in order (``((a0 + a1) + a2) + a3``), and shared memory halves the ``S`` threads (``y + S/2``,
  ...). :func:`channel_sumsq` is that order for frames whose channels are innermost
  (channels-last), so the Wan decoder can run its convolutions channels-last and still get the
  norms, bit for bit, that diffusers gets from NCDHW frames; :func:`channel_sumsq_reference` is
  the same order in NumPy (the CPU tests' yardstick).

Each fold's fused multiply-adds are where nvcc contracts them (``-fmad=true``, PyTorch's build):
the kernels that use these helpers are launched with ``enable_fp_fusion=False`` and write the
FMAs ATen's machine code has, explicitly, with ``tl.fma``.
"""

from __future__ import annotations

import functools

import numpy as np

try:  # Triton ships with CUDA builds of torch only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

#: Threads of ATen's fused layer-norm kernel (``num_threads()`` = 4 warps of 32) and its vector width.
LN_THREADS = 128
LN_VEC = 4
#: Lanes of a warp, which ATen's reduction gives a short row from 16 rows on.
REDUCE_LANES = 32


@functools.lru_cache(maxsize=256)
def _last_pow2(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


@functools.lru_cache(maxsize=1024)
def aten_reduce_config(width: int, rows: int) -> tuple[int, int] | None:
    """``(steps, lanes)`` of ATen's reduction of ``rows`` contiguous rows of ``width``
    (``setReduceConfig``: at most 512 threads a block, a warp's worth of lanes per row once there
    are 16 rows, more lanes for fewer rows), each lane reading ``steps`` elements at a
    ``lanes`` stride; None where the launch does something the kernels do not model: more
    than 128 elements (vectorised reads) or a width that is not ``steps * lanes`` with at most
    four steps."""
    if width > 128 or width < 32 or width & (width - 1):
        return None
    height = min(_last_pow2(rows), 512 // REDUCE_LANES)
    lanes = min(_last_pow2(width), 512 // height)
    steps = width // lanes
    if steps * lanes != width or steps > 4:
        return None
    return steps, lanes


@functools.lru_cache(maxsize=1024)
def aten_vec4_config(width: int, rows: int) -> tuple[int, int] | None:
    """``(steps, lanes)`` of ATen's reduction of ``rows`` contiguous fp32 rows of ``width`` >= 128
    elements, which it reads as 4-element vectors (``vectorize_input``; ``set_block_dimension(width
    / 4, rows)``: at most 512 threads, a warp's width first, then as many rows as fit, then the
    width widened into what is left): lane ``l`` of ``lanes`` folds the vectors ``l, l + lanes,
    ...`` (``steps`` of them) into one accumulator per item. None where that is not the whole
    walk: a width that is not a whole number of vectors for every lane (Z-Image's 3840 is: 30
    vectors for each of 32 lanes), or enough values a thread that ATen splits a row over the
    block's warps too (``values_per_thread >= min(16 * height, 256)``)."""
    if width < 128 or width % 4 or rows < 1:
        return None
    vectors = width // 4
    dim0 = _last_pow2(vectors) if vectors < 512 else 512
    dim1 = _last_pow2(rows) if rows < 512 else 512
    lanes = min(dim0, REDUCE_LANES)
    height = min(dim1, 512 // lanes)
    lanes = min(dim0, 512 // height)
    if -(-width // lanes) >= min(16 * height, 256) or vectors % lanes:
        return None
    return vectors // lanes, lanes


def aten_mean_config(width: int, rows: int) -> tuple[int, int, int] | None:
    """``(steps, lanes, vector)`` of ATen's ``mean(-1)`` over ``rows`` contiguous fp32 rows of
    ``width``: vectorised from 128 elements on (:func:`aten_vec4_config`, ``vector`` 4), element
    by element below (:func:`aten_reduce_config`, ``vector`` 1: lane ``l`` reads elements ``l, l +
    lanes, ...``); None where neither models the launch."""
    if width >= 128:
        config = aten_vec4_config(width, rows)
        return None if config is None else (*config, 4)
    config = aten_reduce_config(width, rows)
    return None if config is None else (*config, 1)


def mean_sumsq_reference(x: np.ndarray, steps: int, lanes: int, vector: int) -> np.ndarray:
    """The fp32 sum of squares of each row of ``x`` [rows, vector * steps * lanes] in the order of
    :func:`aten_mean_config` (``vector`` 4: :func:`vec4_lanes_sum`; 1: lanes of single elements,
    then :func:`lanes_halving_sum`), in NumPy fp32 arithmetic."""
    x = np.asarray(x, dtype=np.float32)
    sq = (x * x).reshape(x.shape[0], steps, lanes, vector)
    acc = sq[:, 0]
    for step in range(1, steps):
        acc = acc + sq[:, step]
    t = acc[..., 0]  # [rows, lanes]
    if vector == 4:
        t = ((acc[..., 0] + acc[..., 1]) + acc[..., 2]) + acc[..., 3]
    n = lanes
    while n > 1:  # halving: lane l adds lane l + n / 2
        n //= 2
        t = t[:, :n] + t[:, n : 2 * n]
    return t[:, 0]


@functools.lru_cache(maxsize=1024)
def aten_channel_splits(channels: int, inner: int, batch: int = 1) -> int | None:
    """``S``, the ``threadIdx.y`` split of ATen's reduction over dim 1 of contiguous NCDHW frames
    [batch, channels, inner (= T * H * W)] (``setReduceConfig`` for a reduction off the innermost
    dim: ``output_vec_size`` pixels a thread, at most ``512 / output_vec_size`` threads a block,
    32 wide; the channels split over the block's height when each thread keeps at least
    ``min(16 * height, 256)`` of them). None where ATen takes another path: one pixel a frame (the
    channels are then the innermost dim) or a split over blocks (256 or more channels a thread).
    Assumes the frames' storage is 16-byte aligned (fresh tensors: the caching allocator's
    blocks). An upsampler's frames-first view gives the same ``S``: its ``H * W`` is even twice."""
    if inner <= 1 or channels < 1:
        return None
    vec = 4
    while inner % vec:  # get_output_vec_size: the pixels' count and every other stride
        vec //= 2
    threads = 512 // vec
    dim0 = batch * inner // vec
    dim0_pow2 = _last_pow2(dim0) if dim0 < threads else threads
    dim1_pow2 = _last_pow2(channels) if channels < threads else threads
    width = min(dim0_pow2, REDUCE_LANES)
    height = min(dim1_pow2, threads // width)
    splits = height if channels >= min(16 * height, 256) else 1
    if -(-channels // splits) >= 256:  # ATen would split over blocks too
        return None
    return splits


def channel_sumsq_reference(x: np.ndarray, splits: int) -> np.ndarray:
    """The fp32 sum of squares of each row of ``x`` [pixels, channels] in the order of
    :func:`channel_sumsq` (ATen's, with ``splits`` threads a pixel), emulated with NumPy: each fold
    ``acc + x * x`` computed in float64 and rounded once to fp32 (a fused multiply-add, exactly so
    when ``x * x`` is an fp32 number, as for bf16 values), the rest fp32 additions."""
    x = np.asarray(x, dtype=np.float32)
    pixels, channels = x.shape
    acc = np.zeros((pixels, splits, 4), dtype=np.float32)
    for c in range(channels):
        y, j = c % splits, c // splits
        v = x[:, c].astype(np.float64)
        acc[:, y, j % 4] = (acc[:, y, j % 4].astype(np.float64) + v * v).astype(np.float32)
    t = ((acc[:, :, 0] + acc[:, :, 1]) + acc[:, :, 2]) + acc[:, :, 3]
    n = splits
    while n > 1:  # block_y_reduce: thread y adds thread y + n / 2
        n //= 2
        t = t[:, :n] + t[:, n : 2 * n]
    return t[:, 0]


@functools.lru_cache(maxsize=1024)
def mean_factor(rows: int, width: int) -> float:
    """ATen's ``mean`` factor: ``float(rows) / float(numel)`` in fp32, by which the sum is
    multiplied (for a power-of-two width it is exactly ``1 / width``)."""
    return float(np.float32(rows) / np.float32(rows * width))


if triton is not None:

    @triton.jit
    def pair_sum(x, R: tl.constexpr, N: tl.constexpr):
        """``[R, N] -> [R, N / 2]``: adjacent columns added, ``x[:, 2i] + x[:, 2i + 1]`` (one level
        of a warp's ``shfl_down`` tree read from lane 0 upwards)."""
        a, b = tl.split(tl.reshape(x, (R, N // 2, 2)))
        return a + b

    @triton.jit
    def vector_items(v):
        """The 4 columns of ATen's threads' vectors ``v`` [128, 4], each [128] in fp32."""
        even, odd = tl.split(tl.reshape(v.to(tl.float32), (128, 2, 2)))
        v0, v2 = tl.split(even)
        v1, v3 = tl.split(odd)
        return v0, v1, v2, v3

    @triton.jit
    def half_sum(x, R: tl.constexpr, N: tl.constexpr):
        """``[R, N] -> [R, N / 2]``: ``x[:, i] + x[:, i + N / 2]`` (one level of a halving tree)."""
        a, b = tl.split(tl.permute(tl.reshape(x, (R, 2, N // 2)), (0, 2, 1)))
        return a + b

    @triton.jit
    def halving_sum(per_thread):
        """ATen's layer-norm tree over the 128 threads' partial sums ``per_thread`` [128] (thread
        ``lane + 32 * warp``): each warp's 32 lanes halved, then the 4 warps. Returns a scalar."""
        acc = tl.reshape(per_thread, (4, 32))
        acc = half_sum(acc, 4, 32)
        acc = half_sum(acc, 4, 16)
        acc = half_sum(acc, 4, 8)
        acc = half_sum(acc, 4, 4)
        acc = half_sum(acc, 4, 2)  # [4, 1]: lane 0 of each warp
        acc = half_sum(tl.reshape(acc, (1, 4)), 1, 4)
        acc = half_sum(acc, 1, 2)
        return tl.sum(acc)  # a [1, 1] tile: its one element

    @triton.jit
    def lanes_halving_sum(t, LANES: tl.constexpr):
        """ATen's tree over the ``LANES`` partial sums ``t`` [1, LANES] of a block's row (a power
        of two up to 512): halving, in shared memory down to a warp, then the warp's shuffles.
        Returns a scalar."""
        if LANES >= 512:
            t = half_sum(t, 1, 512)
        if LANES >= 256:
            t = half_sum(t, 1, 256)
        if LANES >= 128:
            t = half_sum(t, 1, 128)
        if LANES >= 64:
            t = half_sum(t, 1, 64)
        if LANES >= 32:
            t = half_sum(t, 1, 32)
        if LANES >= 16:
            t = half_sum(t, 1, 16)
        if LANES >= 8:
            t = half_sum(t, 1, 8)
        if LANES >= 4:
            t = half_sum(t, 1, 4)
        if LANES >= 2:
            t = half_sum(t, 1, 2)
        return tl.sum(t)  # a [1, 1] tile: its one element

    @triton.jit
    def _halve_rows(x, G: tl.constexpr):
        """``[G, 32] -> [G / 2, 32]``: ``x[g] + x[g + G / 2]`` (a halving level of lanes ``g * 32 +
        t`` that pairs lanes of the same ``t``)."""
        a, b = tl.split(tl.permute(tl.reshape(x, (2, G // 2, 32)), (1, 2, 0)))
        return a + b

    @triton.jit
    def warp_rows_sum(acc, G: tl.constexpr, WARP: tl.constexpr):
        """:func:`vec4_lanes_sum` for ``acc`` [G, 32, 4] (lane ``g * 32 + t``'s four accumulators at
        ``[g, t]``; ``G * 32`` lanes, at most 512), with ``WARP`` for a program of one warp: each
        lane's items ``((a0 + a1) + a2) + a3``, the halving levels down to 32 lanes (rows ``g`` and
        ``g + G / 2``: the same ``t``, so the same thread where Triton keeps ``g`` in registers), then
        the warp's own reduction of the 32 (its shuffle butterfly from offset 16 down is the halving
        tree, lane 0's value; :func:`halving_sum`'s note). Without ``WARP`` (the interpreter, whose
        sum is NumPy's) the 32 are halved as :func:`lanes_halving_sum`. Launch with
        ``enable_fp_fusion=False``."""
        even, odd = tl.split(tl.reshape(acc, (G, 32, 2, 2)))  # items (0, 2) and (1, 3)
        a0, a2 = tl.split(even)
        a1, a3 = tl.split(odd)
        t = ((a0 + a1) + a2) + a3  # [G, 32]
        if G >= 16:
            t = _halve_rows(t, 16)
        if G >= 8:
            t = _halve_rows(t, 8)
        if G >= 4:
            t = _halve_rows(t, 4)
        if G >= 2:
            t = _halve_rows(t, 2)
        if WARP:
            return tl.sum(tl.reshape(t, (32,)), axis=0)
        return lanes_halving_sum(t, 32)

    @triton.jit
    def vec4_lanes_sum(acc, LANES: tl.constexpr):
        """The end of ATen's vectorised reduction (:func:`aten_vec4_config`): each lane's four
        accumulators ``acc`` [LANES, 4] combined in order, ``((a0 + a1) + a2) + a3``, then
        :func:`lanes_halving_sum`. Launch with ``enable_fp_fusion=False``."""
        even, odd = tl.split(tl.reshape(acc, (LANES, 2, 2)))  # items (0, 2) and (1, 3)
        a0, a2 = tl.split(even)
        a1, a3 = tl.split(odd)
        return lanes_halving_sum(tl.reshape(((a0 + a1) + a2) + a3, (1, LANES)), LANES)

    @triton.jit
    def channel_sumsq(base, stride_c, C, live, BP: tl.constexpr, S: tl.constexpr, FMA: tl.constexpr):
        """The fp32 sums of squares of ``BP`` pixels' ``C`` channels (``base`` [BP] pointers to
        channel 0, channels ``stride_c`` apart; ``live`` [BP] masks the pixels) in ATen's order for
        NCDHW frames with ``S`` threads a pixel (:func:`aten_channel_splits`; 1, 2, 4, 8 or 16).
        Column ``i * S + y`` of the [BP, 4S] accumulator is thread ``y``'s accumulator ``i``: each
        step loads the next ``4S`` channels (one vector a pixel) and folds them in, one FMA each
        (``FMA``; else a product and a sum). Launch with ``enable_fp_fusion=False``."""
        k = tl.arange(0, 4 * S)
        acc = tl.zeros((BP, 4 * S), tl.float32)
        ptrs = base[:, None] + k[None, :] * stride_c
        rows = live[:, None]
        for c0 in range(0, C, 4 * S):  # thread y's items 4j .. 4j + 3: channels c0 + i * S + y
            x = tl.load(ptrs + c0 * stride_c, mask=rows & (c0 + k < C)[None, :], other=0.0).to(tl.float32)
            if FMA:
                acc = tl.fma(x, x, acc)
            else:
                acc = acc + x * x
        # each thread's four accumulators combined in order: ((a0 + a1) + a2) + a3
        acc = tl.reshape(tl.permute(tl.reshape(acc, (BP, 4, S)), (0, 2, 1)), (BP, S, 2, 2))  # i = 2h + l
        even, odd = tl.split(acc)  # l = 0 (i = 0, 2), l = 1 (i = 1, 3): [BP, S, 2] over h
        a0, a2 = tl.split(even)
        a1, a3 = tl.split(odd)
        t = ((a0 + a1) + a2) + a3  # [BP, S]; a masked item added 0
        if S == 16:  # block_y_reduce: thread y adds thread y + S / 2, and so on down
            t = half_sum(t, BP, 16)
        if S >= 8:
            t = half_sum(t, BP, 8)
        if S >= 4:
            t = half_sum(t, BP, 4)
        if S >= 2:
            t = half_sum(t, BP, 2)
        return tl.reshape(t, (BP,))
