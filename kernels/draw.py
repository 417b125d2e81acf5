"""A sampled token in one launch: ``stages.sampling.draw_prepared``'s tensor chain for vocabularies up
to 2048, the same tokens, bit for bit, as that chain computes on CUDA with ATen's kernels.

The talker's code predictor draws 15 tokens a frame from logits [B, 2048]. Each draw of the chain
is about 30 small launches (the flip and the division, ``torch.sort``, a gather, three
``searchsorted``, the mask, the softmax, the fixed-point cast, the ``cumsum``, clamps, ``where``s,
``argmax`` ...): about 1.5 ms of a 10.5 ms graphed frame step. :func:`draw` is one program per row
that computes what the chain computes, in the chain's arithmetic:

1. ``greedy``: ``torch.argmax`` of the row (compared in fp32, the exact widening of bf16/fp16): the
   first index of the maximum, or of the first NaN (ATen's ``greater_or_nan``).
2. The scores ``float32(logits[V-1-r]) / scale`` (IEEE division, ``div_rn``; Triton's ``/`` is
   ``div.full.f32``, approximate; ATen's ``DivFunctor`` is nvcc's ``/``, ``div.rn.f32``).
3. ``torch.sort(stable=True)``: a sort of unique int64 keys, a monotone int32 image of the score
   (``-0.0`` canonicalised to ``+0.0``, NaN last) shifted left by 32, or-ed with ``r``: ascending
   scores, ties in increasing ``r``. Every stable ascending sort gives that permutation; ATen's
   (``Sort.cpp`` ``sort_cuda_kernel`` -> ``Sort.cu`` ``sortKeyValueInplace`` for short rows, with
   ``stable``: cub's ``WarpMergeSort::StableSort`` up to 128, else ``SortUtils.cuh``
   ``radixSortKVInPlace``, cub's ``BlockRadixSort``) is stable and ties ``-0.0`` with ``+0.0``
   (cub's radix digits go through ``BaseDigitExtractor::ProcessFloatMinusZero``; the merge sort
   compares with ``<``). A width that is not a power of two is padded with keys that sort last;
   every later step reads only the first ``V`` sorted positions. (The network is ``tl.sort``'s,
   written with a minimum and a maximum per pair, which the interpreter runs as NumPy reductions.)
4. top-k: ``kth = ascending[V - k]``, ``cut_k`` = how many scores are below it.
5. ``softmax(-1)`` of the scores below ``kth`` set to ``-inf``, as ATen's CUDA kernel computes it,
   which is where the bits can go: summation order. Read from PyTorch's sources (2.10 and later,
   ``aten/src/ATen/native/cuda/SoftMax.cu`` ``host_softmax``): a contiguous row (the input is made
   contiguous, ``inner_size == 1``, no ``half_to_float``) with ``dim_size <= 2048 &&
   dim_size * sizeof(scalar_t) <= 8192`` goes to ``dispatch_softmax_forward``
   (``PersistentSoftmax.cuh``), one warp a row (``softmax_warp_forward``): ``WARP_SIZE =
   min(next_pow2(V), 32)``, ``WARP_ITERATIONS = next_pow2(V) / WARP_SIZE``; lane ``l`` holds
   elements ``l + it * WARP_SIZE`` (``-inf`` past ``V``); the row's maximum; then each lane, from
   ``sum = 0.0f`` and in order ``it = 0, 1, ...``, ``elements[it] = std::exp(elements[it] - max);
   sum += elements[it]``; ``warp_reduce<..., Add>``: ``for (offset = WARP_SIZE / 2; offset > 0;
   offset /= 2) sum = sum + WARP_SHFL_XOR(sum, offset)`` (lane 0's result is the halving tree,
   :func:`~.reduce_order.lanes_halving_sum`; every lane gets the same bits, as addition
   commutes); ``dst = elements[it] / sum`` (``sum == 0``: NaN, in newer releases). The kernel stores
   the exponentials to a scratch row, reloads them lane vector by lane vector in that order, and
   divides with ``div_rn``. ``std::exp(float)`` in device code is libdevice's ``__nv_expf`` (PyTorch
   is not built with fast math), which ``libdevice.exp`` is too; the kernel launches with
   ``enable_reflect_ftz=False``, libdevice's branch without flush-to-zero, as nvcc compiles it.
   Earlier releases bounded it at 1024 elements and 4096 bytes and sent wider rows to a block-wide
   kernel (``cunn_SoftMaxForward``): with those the kernel is not bitwise from 1025 on.
6. ``cdf = cumsum(int64(probs * 2**60))`` (exact), ``cut_p`` = how many are ``<= cut`` (top-p),
   ``first = min(max(cut_k, cut_p), V - 1)``.
7. The inverse CDF in integers: ``target = base + floor(span * m / 2**24)`` with ``m`` the uniform's
   24 bits, ``pick = min(#(cdf <= target), V - 1)``, the token ``V - 1 - order[pick]``.
8. ``sampled ? token : greedy``.

Not reproduced: sampled rows whose scaled scores are all ``-inf``, contain NaN or overflow to
``inf`` (the chain's NaN probabilities have no defined token either); their greedy token is.
Greedy rows are exact whatever the logits.

:func:`draw` takes the draw parameters as ``DrawParams`` keeps them (any strides: per-slot buffers'
views are read in place). Under ``TRITON_INTERPRET=1`` (the CPU tests, fp32) the exponential is
NumPy's: :func:`softmax_reference` is step 5 in NumPy with that exponential, the yardstick there.
"""

from __future__ import annotations

import numpy as np
import torch

from . import settings
from .philox import UNIFORM_BITS
from .settings import interpreted, kernel_device

try:  # Triton ships with CUDA builds of torch only
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from .reduce_order import lanes_halving_sum
except ImportError:  # pragma: no cover - depends on the install
    triton = None

#: The widest vocabulary the kernel takes (ATen's one-warp softmax of an fp32 row).
MAX_VOCAB = 2048
#: Fixed point of the integer CDF (probabilities <= 1 sum well below 2**63).
CDF_BITS = 60
#: Lanes of a warp (``C10_WARP_SIZE`` on CUDA).
WARP = 32
#: Smallest row a program holds (narrower vocabularies are padded).
_MIN_BLOCK = 32
_LOGIT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: The softmax's lane sums read this many of a lane's vectors per loop trip (a power of two).
_UNROLL = 4


def warp_layout(vocab: int) -> tuple[int, int]:
    """``(WARP_SIZE, WARP_ITERATIONS)`` of ``softmax_warp_forward`` for rows of ``vocab``: lane ``l``
    sums the elements ``l, l + WARP_SIZE, ...`` of the row padded to a power of two."""
    padded = 1 << max(vocab - 1, 0).bit_length()
    lanes = min(padded, WARP)
    return lanes, padded // lanes


def softmax_reference(scores: torch.Tensor) -> torch.Tensor:
    """``softmax(-1)`` of float32 rows [B, V] in ``softmax_warp_forward``'s order (module docstring,
    step 5), in NumPy float32 with NumPy's ``exp``: what the kernel computes under the interpreter
    (on CUDA its ``exp`` is ``expf``, and ATen's own kernel is the reference)."""
    x = scores.detach().cpu().numpy().astype(np.float32)
    rows, vocab = x.shape
    lanes, iters = warp_layout(vocab)
    padded = np.full((rows, lanes * iters), -np.inf, dtype=np.float32)
    padded[:, :vocab] = x
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(padded - padded.max(axis=1, keepdims=True))
        lane_sums = np.zeros((rows, lanes), dtype=np.float32)
        for it in range(iters):  # each lane in order, from 0
            lane_sums = lane_sums + e[:, it * lanes : (it + 1) * lanes]
        n = lanes
        while n > 1:  # the butterfly, as lane 0 sees it: lane l adds lane l + n / 2
            n //= 2
            lane_sums = lane_sums[:, :n] + lane_sums[:, n : 2 * n]
        probs = e[:, :vocab] / lane_sums[:, :1]
    return torch.from_numpy(probs).to(scores.device)


if triton is not None:

    @triton.jit
    def _indicator(N_DIMS: tl.constexpr, J: tl.constexpr):
        """0, 1 along the ``J``-th innermost dim of a ``[2] * N_DIMS`` hypercube."""
        return tl.reshape(tl.arange(0, 2), [1] * (N_DIMS - J - 1) + [2] + [1] * J)

    @triton.jit
    def _compare_and_swap(h, flip, J: tl.constexpr, N_DIMS: tl.constexpr):
        """Each pair of distinct keys along the ``J``-th innermost dim of ``h`` ordered: the minimum
        on the left and the maximum on the right, or the reverse where ``flip``."""
        low = tl.min(h, axis=N_DIMS - 1 - J, keep_dims=True)
        high = tl.max(h, axis=N_DIMS - 1 - J, keep_dims=True)
        return tl.where((flip ^ _indicator(N_DIMS, J)) != 0, high, low)

    @triton.jit
    def _bitonic_merge(h, STAGE: tl.constexpr, ALTERNATE: tl.constexpr, N_DIMS: tl.constexpr):
        """A merge stage of the bitonic sort of a ``[2] * N_DIMS`` hypercube (blocks of ``2**STAGE``
        ascending, or alternately ascending and descending)."""
        if ALTERNATE:
            flip = _indicator(N_DIMS, STAGE)
        else:
            flip = 0
        for i in tl.static_range(STAGE):
            h = _compare_and_swap(h, flip, STAGE - 1 - i, N_DIMS)
        return h

    @triton.jit
    def _sort_unique(x, N_DIMS: tl.constexpr):
        """``x`` [2**N_DIMS] of distinct keys, ascending: ``tl.sort``'s bitonic network with each
        compare-and-swap a minimum and a maximum over the pair, which Triton's interpreter runs as
        NumPy reductions (``tl.sort``'s XOR reduction it runs element by element: 2.5 s a row of
        2048, against 0.1 s)."""
        h = tl.reshape(x, [2] * N_DIMS)
        for stage in tl.static_range(1, N_DIMS + 1):
            h = _bitonic_merge(h, stage, stage < N_DIMS, N_DIMS)
        return tl.reshape(h, x.shape)

    @triton.jit
    def _draw_kernel(
        LOGITS, SAMPLED, SCALE, TOP_K, CUT, UNIFORM, OUT, SCRATCH, PROBS, vocab,
        stride_row, stride_col, stride_sampled, stride_scale, stride_k, stride_cut, stride_u,
        stride_prow, stride_pcol,
        BLOCK: tl.constexpr, N_DIMS: tl.constexpr, LANES: tl.constexpr, ITERS: tl.constexpr,
        UNROLL: tl.constexpr, CDF_ONE: tl.constexpr, U_BITS: tl.constexpr, LIBDEVICE: tl.constexpr,
        STORE_PROBS: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        pos = tl.arange(0, BLOCK)
        live = pos < vocab
        logits = LOGITS + row * stride_row
        # 1. greedy: torch.argmax (the first NaN, else the first maximum)
        x = tl.load(logits + pos.to(tl.int64) * stride_col, mask=live, other=float("-inf")).to(tl.float32)
        nan = x != x
        first_nan = tl.min(tl.where(nan, pos, BLOCK))
        top = tl.max(tl.where(nan, float("-inf"), x))
        greedy = tl.where(first_nan < BLOCK, first_nan, tl.min(tl.where(x == top, pos, BLOCK)))
        # 2. the reversed row's scores, IEEE-divided by the temperature
        back = tl.load(logits + (vocab - 1 - pos).to(tl.int64) * stride_col, mask=live, other=0.0)
        s = tl.math.div_rn(back.to(tl.float32), tl.load(SCALE + row * stride_scale))
        # 3. stable ascending sort: unique keys (monotone image of the score, position)
        bits = tl.where(s == 0.0, 0.0, s).to(tl.int32, bitcast=True)  # -0.0 ties with +0.0
        bits = tl.where(s != s, 0x7FC00000, bits)  # NaN sorts last
        image = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        key = (image.to(tl.int64) << 32) | pos.to(tl.int64)
        key = _sort_unique(tl.where(live, key, 0x7FFFFFFFFFFFFFFF), N_DIMS)  # padding: after every score
        image = (key >> 32).to(tl.int32)
        rank = (key & 0xFFFFFFFF).to(tl.int32)  # r: the token is vocab - 1 - r
        ascending = tl.where(image < 0, image ^ 0x7FFFFFFF, image).to(tl.float32, bitcast=True)
        # 4. top-k: the k-th best score and how many are below it
        top_k = tl.load(TOP_K + row * stride_k)
        k = tl.where(top_k > 0, tl.minimum(top_k, vocab), vocab)
        kth = tl.sum(tl.where(pos == vocab - k, image, 0))
        cut_k = tl.sum((live & (image < kth)).to(tl.int32))
        # 5. softmax_warp_forward: max, exp, per-lane sums in order, the butterfly, IEEE division
        masked = tl.where(live & (image >= kth), ascending, float("-inf"))
        if LIBDEVICE:
            e = libdevice.exp(masked - tl.max(masked))
        else:
            e = tl.exp(masked - tl.max(masked))
        scratch = SCRATCH + row * BLOCK
        tl.store(scratch + pos, e)
        tl.debug_barrier()
        lanes = tl.arange(0, LANES)
        acc = tl.zeros([LANES], tl.float32)
        # a loop, not unrolled whole: each of 64 unrolled loads cost Triton's coalescing pass a
        # walk over the whole kernel (5 of 11 s of a 2,048-wide compile); the same order of sums
        for it0 in range(0, ITERS, UNROLL):
            for j in tl.static_range(UNROLL):
                acc += tl.load(scratch + (it0 + j) * LANES + lanes)
        probs = tl.math.div_rn(e, lanes_halving_sum(tl.reshape(acc, (1, LANES)), LANES))
        if STORE_PROBS:
            tl.store(PROBS + row * stride_prow + pos.to(tl.int64) * stride_pcol, probs, mask=live)
        # 6. the fixed-point CDF, top-p, the first kept position
        cdf = tl.cumsum((probs * CDF_ONE).to(tl.int64), axis=0)
        cut_p = tl.sum((live & (cdf <= tl.load(CUT + row * stride_cut))).to(tl.int32))
        first = tl.minimum(tl.maximum(cut_k, cut_p), vocab - 1)
        # 7. the inverse CDF over the kept suffix, in integers
        base = tl.sum(tl.where(pos == first - 1, cdf, 0))
        span = tl.sum(tl.where(pos == vocab - 1, cdf, 0)) - base
        m = (tl.load(UNIFORM + row * stride_u) * (1 << U_BITS)).to(tl.int64)
        m = tl.minimum(tl.maximum(m, 0), (1 << U_BITS) - 1)
        target = base + (span >> U_BITS) * m + (((span & ((1 << U_BITS) - 1)) * m) >> U_BITS)
        pick = tl.minimum(tl.sum((live & (cdf <= target)).to(tl.int32)), vocab - 1)
        token = vocab - 1 - tl.sum(tl.where(pos == pick, rank, 0))
        # 8. sampled rows take the draw, the others argmax
        sampled = tl.load(SAMPLED + row * stride_sampled) != 0
        tl.store(OUT + row, tl.where(sampled, token, greedy).to(tl.int64))


def _check(
    logits: torch.Tensor,
    sampled: torch.Tensor,
    scale: torch.Tensor,
    top_k: torch.Tensor,
    cut: torch.Tensor,
    uniform: torch.Tensor,
    probs: torch.Tensor | None = None,
) -> str | None:
    if logits.dim() != 2:
        return f"logits must be 2-D [batch, vocab], got shape {tuple(logits.shape)}"
    rows, vocab = logits.shape
    if logits.dtype not in _LOGIT_DTYPES:
        return f"logits must be float32, float16 or bfloat16, got {logits.dtype}"
    if not 1 <= vocab <= MAX_VOCAB:
        return f"the vocabulary must have 1 to {MAX_VOCAB} entries, got {vocab}"
    wanted = {
        "sampled": (sampled, (rows,), torch.bool),
        "scale": (scale, (rows, 1), torch.float32),
        "top_k": (top_k, (rows,), torch.int64),
        "cut": (cut, (rows, 1), torch.int64),
        "uniform": (uniform, (rows,), torch.float32),
    }
    if probs is not None:
        wanted["probs"] = (probs, (rows, vocab), torch.float32)
    for name, (tensor, shape, dtype) in wanted.items():
        if tuple(tensor.shape) != shape:
            return f"{name} must have shape {shape} for {rows} rows of logits, got {tuple(tensor.shape)}"
        if tensor.dtype != dtype:
            return f"{name} must be {dtype}, got {tensor.dtype}"
        if tensor.device != logits.device:
            return f"{name} is on {tensor.device}, logits on {logits.device}"
    return None


def kernel_applies(
    logits: torch.Tensor,
    sampled: torch.Tensor,
    scale: torch.Tensor,
    top_k: torch.Tensor,
    cut: torch.Tensor,
    uniform: torch.Tensor,
) -> bool:
    """Whether the samplers' dispatcher (``stages.sampling.draw_prepared``) runs the kernel: CUDA
    tensors it takes (vocabularies up to 2048), with Triton, where :data:`~.settings.FUSED` is not
    ``off`` (it computes the chain's tokens: bitwise wherever it runs)."""
    usable = kernel_device(logits, sampled, scale, top_k, cut, uniform)
    return usable and _check(logits, sampled, scale, top_k, cut, uniform) is None and settings.wanted(True)


def draw(
    logits: torch.Tensor,
    sampled: torch.Tensor,
    scale: torch.Tensor,
    top_k: torch.Tensor,
    cut: torch.Tensor,
    uniform: torch.Tensor,
    *,
    probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """int64 [B]: one token per row of ``logits`` [B, V] (fp32, fp16 or bf16, V <= 2048) with the
    draw parameters of ``stages.sampling.DrawParams`` (``sampled`` [B] bool, ``scale`` [B, 1]
    float32, ``top_k`` [B] int64, ``cut`` [B, 1] int64) and ``uniform`` [B] float32: the tokens of
    ``draw_prepared``'s chain on CUDA. ``probs`` ([B, V] float32, tests) receives each row's
    softmax over its sorted scores, as the chain's ``softmax(-1)`` computes it. The kernel itself
    (CUDA, or the CPU under ``TRITON_INTERPRET=1``); ValueError for inputs it does not take."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    reason = _check(logits, sampled, scale, top_k, cut, uniform, probs)
    if reason:
        raise ValueError(reason)
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    constants, options = launch_config(vocab, gpu=not interpreted())
    scratch = torch.empty((rows, constants["BLOCK"]), dtype=torch.float32, device=logits.device)
    store_probs = probs is not None
    probs = scratch if probs is None else probs  # not written unless asked for
    _draw_kernel[(rows,)](
        logits, sampled, scale, top_k, cut, uniform, out, scratch, probs, vocab,
        logits.stride(0), logits.stride(1), sampled.stride(0), scale.stride(0), top_k.stride(0),
        cut.stride(0), uniform.stride(0), probs.stride(0), probs.stride(1),
        STORE_PROBS=store_probs, **constants, **options,
    )  # fmt: skip
    return out


def launch_config(vocab: int, *, gpu: bool = True) -> tuple[dict[str, object], dict[str, object]]:
    """The draw kernel's compile-time constants (but ``STORE_PROBS``) and launch options for rows of
    ``vocab`` codes: as compiled for CUDA (``gpu``), else as the interpreter runs it (one warp,
    NumPy's ``exp``). :func:`draw` launches with them; ``benchmarks/kernel_compile.py`` compiles
    with them."""
    lanes, iters = warp_layout(vocab)
    block = max(lanes * iters, _MIN_BLOCK)
    constants = dict(
        BLOCK=block, N_DIMS=block.bit_length() - 1, LANES=lanes, ITERS=iters, UNROLL=min(iters, _UNROLL),
        CDF_ONE=float(2**CDF_BITS), U_BITS=UNIFORM_BITS, LIBDEVICE=gpu,
    )  # fmt: skip
    options = dict(num_warps=max(1, min(8, block // 256)) if gpu else 1, enable_fp_fusion=False,
                   enable_reflect_ftz=False)  # fmt: skip
    return constants, options
