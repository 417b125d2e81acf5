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
- **A row of the fused layer-norm kernels** (``layer_norm_kernel.cu`` ``compute_stats``: LayerNorm,
  and ``torch.nn.RMSNorm`` / ``F.rms_norm`` on CUDA): 128 threads (32 lanes x 4 warps) read the row
  in 4-element vectors, thread ``t`` the vectors ``t, t + 128, ...``, each element folded into the
  thread's running state in order; then a shuffle tree halves the 32 lanes of each warp
  (``l + 16``, ``l + 8``, ...) and shared memory halves the 4 warps. :func:`halving_sum` is the
  tree written out; Triton's own reduction of a [128] tensor over 4 warps of one value each is the
  same tree (a butterfly within the warp, then across warps; lane 0's result) and needs no layout
  changes, so the kernels use it (``TREE = "reduce"``; both measured bitwise). The kernels walk the
  row per thread themselves (their state is a sum of squares or a Welford triple).

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
