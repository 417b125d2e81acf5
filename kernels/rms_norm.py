"""A decoder layer's residual add and RMSNorm in one launch: ``x + delta``, then transformers'
``RMSNorm`` of it, bitwise equal to the eager chain on CUDA.

``add_rms_norm(x, delta, weight, eps)`` with ``x`` [..., W] and ``delta`` (or None) of its shape
returns ``(x + delta, rms_norm(x + delta))``: the new residual stream and the next sublayer's
input. Eagerly that is 9 launches in bf16 (the add, a cast, ``pow``, ``mean``, ``+ eps``,
``rsqrt``, a product, the cast back, the weight), so in a speech decode step, where every tensor is
a few rows, the norms alone were about a third of the launches of the talker's frame
(``docs/benchmarks.md``, "Speech at real size on CUDA graphs").

**The chain** (``exact``, the default) is ``Qwen3OmniMoe*RMSNorm.forward`` line for line: the sum
of bf16 inputs rounded to bf16; their squares in fp32; the mean in ATen's order (below); ``+ eps``
and ``rsqrt`` in fp32; ``x * rstd`` rounded to the input dtype; times the weight, rounded.
``fast`` sums in Triton's order and rounds once. ``chain="moshi"`` is ``MoshiRMSNorm``'s chain
(the duplex LM): ATen's sums as ``exact``, then ``x * rstd * weight`` in fp32, rounded once.

**ATen's order for a mean over W >= 128 contiguous elements** (``Reduce.cuh``, read from the
headers; :mod:`.reduce_order`): the input is read as 4-element vectors (``vectorize_input``), a
block of ``lanes x height`` threads (``set_block_dimension(W / 4, rows)``), lane ``l`` folding the
vectors ``l, l + lanes, ...`` into four accumulators, one per item, in order; then ``((a0 + a1) +
a2) + a3``, then a halving tree over the lanes (shared memory down to a warp, then the warp's
shuffles, both halving). Narrower rows (32 and 64: the embedded demo model) are read element by
element. So the order depends on the number of rows of the call: the kernel takes it from its
own input, which is what eager reduces (:func:`~.reduce_order.aten_mean_config`).

**Modulated** (:func:`rms_norm_modulate`, the DiT blocks of Z-Image): diffusers' ``RMSNorm`` of
``x`` (the same chain), then times a per-sample vector and plus a residual, ``residual + mul *
norm(x)``, each product and sum rounded where eager rounds it: ``norm(x) * scale`` and ``x + gate
* norm(attn_out)`` in one launch each, where eagerly they are 9 and 11 (at 1024x1024 the norms and
their products were about a quarter of a Z-Image step's GPU time).

Where the order is not modelled (a width that is not a whole number of lanes' vectors, narrow
widths that are not a power of two, or ATen would split a row over warps), the dispatcher runs
the eager chain. :func:`add_rms_norm` dispatches (the kernel on CUDA where it
applies and :data:`~.settings.FUSED` wants it), :func:`add_rms_norm_triton` runs the kernel on
any device Triton runs on (CPU tensors under ``TRITON_INTERPRET=1`` in the tests), through the
custom ops ``omnirt::add_rms_norm`` and ``omnirt::rms_norm`` (without a delta), which CUDA graphs
capture and ``torch.compile`` traces.
"""

from __future__ import annotations

from typing import Literal

import torch

from . import settings, w8a8
from .reduce_order import aten_mean_config, mean_factor
from .settings import Preset, check_preset

try:  # Triton ships with CUDA builds of torch only
    import triton
    import triton.language as tl

    from .reduce_order import lanes_halving_sum, vec4_lanes_sum, warp_rows_sum
    from .w8a8 import quantize_values
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None


#: The RMSNorm chains :func:`add_rms_norm` computes: ``transformers`` (Qwen's: ``x * rstd`` rounded
#: to the input dtype, then times the weight, rounded) and ``moshi`` (``MoshiRMSNorm``: the product
#: with the weight in fp32, one rounding).
Chain = Literal["transformers", "moshi"]
#: The kernel preset of each chain: ATen's sums either way.
_CHAIN_PRESETS: dict[str, str] = {"transformers": "exact", "moshi": "exact_f32"}


def add_rms_norm_reference(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    chain: Chain = "transformers",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager chain: the residual add and transformers' ``RMSNorm`` (or ``MoshiRMSNorm``)."""
    if delta is not None:
        x = x + delta
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    if chain == "moshi":
        return x, (h * weight.float()).type_as(x)
    return x, weight * h.to(x.dtype)


if triton is not None:

    @triton.jit
    def _normed(v, W, M, R, base, at, m_base, rstd, DT: tl.constexpr, HAS_M: tl.constexpr,
                HAS_R: tl.constexpr, ROUNDS: tl.constexpr):  # fmt: skip
        """The output at ``at`` of a row whose values there are ``v`` (``residual + mul * weight *
        norm``) in fp32, before its last rounding to the input dtype (``ROUNDS``: each product and
        sum rounded before it, as transformers' and diffusers' chains; else none, as Moshi's)."""
        w = tl.load(W + at).to(tl.float32)
        if ROUNDS:  # each product and sum rounded to the input dtype, as eager
            y = (v.to(tl.float32) * rstd).to(DT).to(tl.float32) * w
            if HAS_M:
                y = y.to(DT).to(tl.float32) * tl.load(M + m_base + at).to(tl.float32)
            if HAS_R:
                y = tl.load(R + base + at).to(tl.float32) + y.to(DT).to(tl.float32)
        else:
            y = v.to(tl.float32) * rstd * w
            if HAS_M:
                y = y * tl.load(M + m_base + at).to(tl.float32)
            if HAS_R:
                y = tl.load(R + base + at).to(tl.float32) + y
        return y

    @triton.jit
    def _values(X, D, XO, at, DT: tl.constexpr, HAS_D: tl.constexpr, STORE: tl.constexpr):
        """The row's elements at ``at``: ``x + delta`` rounded to the input dtype with ``HAS_D``
        (stored to ``XO`` with ``STORE``), else ``x``."""
        v = tl.load(X + at)
        if HAS_D:
            v = (v.to(tl.float32) + tl.load(D + at).to(tl.float32)).to(DT)
            if STORE:
                tl.store(XO + at, v)
        return v

    @triton.jit
    def _again(X, D, XO, at, DT: tl.constexpr, HAS_D: tl.constexpr, PAIR: tl.constexpr):
        """A pass's values at ``at``, read again from memory: with ``PAIR`` the stream this program
        stored to ``XO`` (the same elements in the same layout, so the same threads), else ``x``
        (plus ``delta``, :func:`_values`)."""
        if PAIR:
            v = tl.load(XO + at)
        else:
            v = _values(X, D, XO, at, DT, HAS_D, False)
        return v

    @triton.jit
    def _accumulate(acc, v, LANES: tl.constexpr, VEC: tl.constexpr, ROWS_TREE: tl.constexpr):
        """``acc`` plus the squares of a slice's values, each into its lane's accumulator."""
        sq = v.to(tl.float32) * v.to(tl.float32)
        if ROWS_TREE:
            acc += sq
        else:
            acc += tl.reshape(sq, (LANES, VEC))
        return acc

    @triton.jit
    def _row_sum(acc, G: tl.constexpr, LANES: tl.constexpr, VEC: tl.constexpr, ATEN: tl.constexpr,
                 ROWS_TREE: tl.constexpr, WARP: tl.constexpr):  # fmt: skip
        """The row's sum of squares from its lanes' accumulators (``acc``), in ATen's order where
        ``ATEN``."""
        if ROWS_TREE:
            ss = warp_rows_sum(acc, G, WARP)
        elif ATEN and VEC == 4:
            ss = vec4_lanes_sum(acc, LANES)
        elif ATEN:
            ss = lanes_halving_sum(tl.reshape(acc, (1, LANES)), LANES)
        else:
            ss = tl.sum(tl.sum(acc, axis=1), axis=0)
        return ss

    @triton.jit
    def _output(v, W, M, R, W2, M2, base, at, m_base, rstd, DT: tl.constexpr, HAS_M: tl.constexpr,
                HAS_R: tl.constexpr, HAS_M2: tl.constexpr, PAIR: tl.constexpr,
                ROUNDS: tl.constexpr):  # fmt: skip
        """The kernel's output at ``at`` in fp32 from the row's values ``v`` there: the norm's
        (:func:`_normed`), or with ``PAIR`` the second norm's (``W2``, ``M2``, no residual) of the
        stream the first wrote."""
        if PAIR:
            y = _normed(v, W2, M2, R, base, at, m_base, rstd, DT, HAS_M2, False, ROUNDS)
        else:
            y = _normed(v, W, M, R, base, at, m_base, rstd, DT, HAS_M, HAS_R, ROUNDS)
        return y

    @triton.jit
    def _add_rms_norm_kernel(
        X, D, W, XO, Y, SS, M, R, QS, W2, M2, eps, eps2, factor, m_stride, m2_stride, tokens, INV_QMAX,
        WIDTH: tl.constexpr, STEPS: tl.constexpr, LANES: tl.constexpr, VEC: tl.constexpr,
        HAS_D: tl.constexpr, HAS_SS: tl.constexpr, HAS_M: tl.constexpr, HAS_R: tl.constexpr,
        ATEN: tl.constexpr, QUANT: tl.constexpr, INT8: tl.constexpr,
        QMAX: tl.constexpr, MIN_PEAK: tl.constexpr, ROUNDER: tl.constexpr, ROWS_TREE: tl.constexpr,
        WARP: tl.constexpr, ROUNDS: tl.constexpr, HOLD: tl.constexpr, PAIR: tl.constexpr,
        HAS_M2: tl.constexpr,
    ):  # fmt: skip
        # One program per row; the row read as STEPS slices of LANES vectors of VEC elements. With
        # HOLD the slices stay in registers after the first read (one read of the row from memory);
        # else the passes after it read them again. PAIR: the norm's output (``R + M * norm(X)``)
        # is a residual stream, stored to XO, and the output is a second norm's of it (W2, M2).
        row = tl.program_id(0).to(tl.int64)
        DT: tl.constexpr = X.dtype.element_ty
        SLICE: tl.constexpr = LANES * VEC
        base = row * WIDTH
        G: tl.constexpr = LANES // 32
        if ROWS_TREE:  # ATen's order with lanes as [G, 32] (lane g * 32 + t), each lane's vector last
            g = tl.arange(0, G)[:, None, None] * 32
            piece = (g + tl.arange(0, 32)[None, :, None]) * 4 + tl.arange(0, 4)[None, None, :]
            acc = tl.zeros([G, 32, 4], tl.float32)
        else:
            piece = tl.arange(0, SLICE)
            acc = tl.zeros([LANES, VEC], tl.float32)
        held = ()
        for step in tl.static_range(STEPS):
            v = _values(X, D, XO, base + step * SLICE + piece, DT, HAS_D, True)
            if HOLD:
                held = held + (v,)
            acc = _accumulate(acc, v, LANES, VEC, ROWS_TREE)
        ss = _row_sum(acc, G, LANES, VEC, ATEN, ROWS_TREE, WARP)
        if HAS_SS:
            tl.store(SS + row, ss)
        rstd = tl.math.rsqrt(ss * factor + eps)
        # The row again, slice by slice (the sum recomputed, not read back: another thread may
        # have stored it): the held values' indices, the stream's as stored (PAIR), else the
        # slice as one vector.
        if HOLD or PAIR:
            out_piece = piece
        else:
            out_piece = tl.arange(0, SLICE)
        m_base = (row // tokens) * m_stride
        if PAIR:  # the stream R + M * norm(X) written, its squares summed as the first's; held
            acc = tl.zeros_like(acc)
            stream = ()
            for step in tl.static_range(STEPS):
                at = step * SLICE + piece
                v = held[step] if HOLD else _values(X, D, XO, base + at, DT, HAS_D, False)
                x2 = _normed(v, W, M, R, base, at, m_base, rstd, DT, HAS_M, HAS_R, ROUNDS).to(DT)
                tl.store(XO + base + at, x2)
                if HOLD:
                    stream = stream + (x2,)
                acc = _accumulate(acc, x2, LANES, VEC, ROWS_TREE)
            rstd = tl.math.rsqrt(_row_sum(acc, G, LANES, VEC, ATEN, ROWS_TREE, WARP) * factor + eps2)
            m_base = (row // tokens) * m2_stride
            held = stream
        if QUANT:  # the output quantized per row (w8a8.quantize_rows of it): its peak, then the values
            peak = tl.zeros_like(out_piece).to(tl.float32)
            for step in tl.static_range(STEPS):
                at = step * SLICE + out_piece
                v = held[step] if HOLD else _again(X, D, XO, base + at, DT, HAS_D, PAIR)
                y = _output(v, W, M, R, W2, M2, base, at, m_base, rstd, DT, HAS_M, HAS_R, HAS_M2, PAIR,
                            ROUNDS)  # fmt: skip
                peak = tl.maximum(peak, tl.abs(y.to(DT).to(tl.float32)))
            scale = tl.maximum(tl.max(tl.reshape(peak, (SLICE,)), axis=0), MIN_PEAK) * INV_QMAX
            tl.store(QS + row, scale)
            for step in tl.static_range(STEPS):
                at = step * SLICE + out_piece
                v = held[step] if HOLD else _again(X, D, XO, base + at, DT, HAS_D, PAIR)
                y = _output(v, W, M, R, W2, M2, base, at, m_base, rstd, DT, HAS_M, HAS_R, HAS_M2, PAIR,
                            ROUNDS)  # fmt: skip
                tl.store(Y + base + at, quantize_values(y.to(DT).to(tl.float32), scale, QMAX, ROUNDER, INT8))
        else:
            for step in tl.static_range(STEPS):
                at = step * SLICE + out_piece
                v = held[step] if HOLD else _again(X, D, XO, base + at, DT, HAS_D, PAIR)
                y = _output(v, W, M, R, W2, M2, base, at, m_base, rstd, DT, HAS_M, HAS_R, HAS_M2, PAIR,
                            ROUNDS)  # fmt: skip
                tl.store(Y + base + at, y.to(DT))


def _check(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor) -> str | None:
    """Why the kernel cannot take these inputs, or None."""
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"unsupported dtype {x.dtype}"
    if not x.is_contiguous() or (delta is not None and (delta.shape != x.shape or not delta.is_contiguous())):
        return "x (and delta, of x's shape) must be contiguous"
    if delta is not None and delta.dtype != x.dtype:
        return "delta must have x's dtype"
    width = x.shape[-1]
    if weight.dtype != x.dtype or weight.shape != (width,) or not weight.is_contiguous():
        return "the weight must be contiguous [W], of x's dtype"
    if width > 8192 or (width < 128 and (width < 32 or width & (width - 1))) or width % 4:
        return f"width {width} is not a multiple of 4 in 128..8192 nor a power of two from 32"
    return None


def _fast_config(width: int) -> tuple[int, int, int]:
    """``(steps, lanes, vector)`` of the ``fast`` preset: 4-element vectors from 128 on, as many
    lanes (a power of two dividing the row's vectors, at most 512) as fit."""
    vec = 4 if width >= 128 else 1
    vectors = width // vec
    lanes = min(vectors & -vectors, 512)  # the largest power of two dividing it
    return vectors // lanes, lanes, vec


def _launch(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    preset: str,
    sumsq: torch.Tensor | None = None,
    mul: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    kind: str | None = None,
    then: tuple[torch.Tensor, float, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(x + delta, out, scale)``: ``out`` the norm's output, or with ``kind`` its 8-bit values
    [rows, W] and ``scale`` their per-row scales [rows, 1]. ``then`` (``(weight2, eps2, mul2)``):
    the norm's output is a residual stream, returned first, and ``out`` is ``mul2 * norm2`` of it."""
    width = x.shape[-1]
    rows = x.numel() // width
    if kind is None:
        out, scale = torch.empty_like(x), None
    else:
        out = torch.empty(rows, width, dtype=w8a8.STORAGE[kind], device=x.device)
        scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    summed = torch.empty_like(x) if delta is not None or then is not None else x
    if rows == 0:
        return summed, out, scale
    exact = preset in ("exact", "exact_f32")  # ATen's sums; "exact_f32": one rounding (Moshi's chain)
    config = aten_mean_config(width, rows) if exact else None
    steps, lanes, vec = config or _fast_config(width)
    rows_tree = ROWS_TREE and config is not None and vec == 4 and lanes >= 32
    weight2, eps2, mul2 = then if then is not None else (weight, eps, None)
    tokens = rows // x.shape[0] if x.ndim == 3 else 1  # rows a sample (a [B, 1, C] vector each)
    _add_rms_norm_kernel[(rows,)](
        x, delta if delta is not None else x, weight, summed, out,
        sumsq if sumsq is not None else out, mul if mul is not None else x,
        residual if residual is not None else x, scale if scale is not None else x, weight2,
        mul2 if mul2 is not None else x, eps, eps2, mean_factor(rows, width), _mul_stride(x, mul),
        _mul_stride(x, mul2), tokens,
        WIDTH=width, STEPS=steps, LANES=lanes, VEC=vec, HAS_D=delta is not None, HAS_SS=sumsq is not None,
        HAS_M=mul is not None, HAS_R=residual is not None, ATEN=config is not None, ROUNDS=preset == "exact",
        QUANT=kind is not None, **w8a8.quantize_constants(kind), ROWS_TREE=rows_tree,
        WARP=rows_tree and not settings.interpreted(), num_warps=1 if rows_tree else warps_for(lanes * vec),
        HOLD=holds(steps, lanes * vec, rows_tree), PAIR=then is not None, HAS_M2=mul2 is not None,
        enable_fp_fusion=not exact,
    )  # fmt: skip
    return summed, out, scale


#: Overrides :func:`warps_for` (``benchmarks/kernels.py --rms-warps`` sweeps it).
WARPS: int | None = None
#: ``exact`` rows of 4-element lanes summed as :func:`~.reduce_order.warp_rows_sum` does, by one warp
#: (the lanes' halving levels in registers, the last 32 by the warp's shuffles), rather than by
#: :func:`~.reduce_order.vec4_lanes_sum`'s levels through shared memory (the same sums).
ROWS_TREE = True


#: The most elements of a held row a thread keeps (:func:`holds`).
HOLD_PER_THREAD = 128


def holds(steps: int, tile: int, rows_tree: bool) -> bool:
    """Whether a program of ``steps`` slices of ``tile`` elements keeps its row in registers for the
    passes after its sum: with :data:`~.settings.HOLD_ROWS`, for rows summed by one warp
    (``rows_tree``) of at most :data:`HOLD_PER_THREAD` elements a thread (Z-Image's 3840: 120)."""
    return settings.HOLD_ROWS and rows_tree and steps * tile <= 32 * HOLD_PER_THREAD


def warps_for(tile: int) -> int:
    """Warps of a program whose row slices are ``tile`` elements: about 4 elements a thread
    (one warp for a warp-wide slice of 32 lanes' vectors: a DiT's many rows run side by side),
    up to 8 warps."""
    return WARPS or max(1, min(8, tile // 512))


def _mul_stride(x: torch.Tensor, mul: torch.Tensor | None) -> int:
    """How many elements apart ``mul``'s vectors for successive samples of ``x`` start: 0 for one
    vector for every row (or none), else its batch stride ([B, 1, C])."""
    if mul is None or mul.numel() == x.shape[-1]:
        return 0
    return mul.stride(0)


def add_rms_norm_triton(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    preset: Preset = "exact",
    sumsq: torch.Tensor | None = None,
    chain: Chain = "transformers",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel itself, on any device Triton runs on; raises ValueError for inputs it does not
    support. ``sumsq`` [rows] fp32, if given, receives each row's sum of squares (the tests check
    the summation order on it); ``chain`` (``exact``): whose output roundings."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    reason = _check(x, delta, weight)
    if reason:
        raise ValueError(reason)
    if chain not in _CHAIN_PRESETS:
        raise ValueError(f"chain must be one of {', '.join(_CHAIN_PRESETS)}, not {chain!r}")
    preset = check_preset(preset)
    return _launch(x, delta, weight, eps, _CHAIN_PRESETS[chain] if preset == "exact" else preset, sumsq)[:2]


def _add_rms_norm_impl(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, preset: str
) -> tuple[torch.Tensor, torch.Tensor]:
    summed, out, _ = _launch(x, delta, weight, eps, preset)
    return summed, out


_add_rms_norm_op = torch.library.custom_op("omnirt::add_rms_norm", _add_rms_norm_impl, mutates_args=())


@_add_rms_norm_op.register_fake
def _add_rms_norm_fake(x, delta, weight, eps, preset):
    return x.new_empty(x.shape), x.new_empty(x.shape)


def _rms_norm_impl(x: torch.Tensor, weight: torch.Tensor, eps: float, preset: str) -> torch.Tensor:
    return _launch(x, None, weight, eps, preset)[1]


_rms_norm_op = torch.library.custom_op("omnirt::rms_norm", _rms_norm_impl, mutates_args=())


@_rms_norm_op.register_fake
def _rms_norm_fake(x, weight, eps, preset):
    return x.new_empty(x.shape)


def kernel_applies(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor) -> bool:
    """Whether :func:`add_rms_norm` runs the kernel for these inputs (device, dtype, layout, and
    the :data:`~.settings.FUSED` setting: ``auto`` where ATen's order is modelled)."""
    if not settings.kernel_device(x, delta, weight) or _check(x, delta, weight) is not None:
        return False
    width = x.shape[-1]
    return settings.wanted(aten_mean_config(width, x.numel() // width) is not None)


def add_rms_norm(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    chain: Chain = "transformers",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + delta, RMSNorm(x + delta))`` (``delta`` None: ``(x, RMSNorm(x))``) in ``chain``'s
    roundings: the kernel where it applies (:func:`kernel_applies`, ``exact``), else the eager
    chain."""
    if not kernel_applies(x, delta, weight):
        return add_rms_norm_reference(x, delta, weight, eps, chain)
    preset = _CHAIN_PRESETS[chain]
    if delta is None:  # a custom op may not return its input: the norm alone
        return x, settings.dispatch(torch.ops.omnirt.rms_norm, _rms_norm_impl, x, weight, eps, preset)
    op = torch.ops.omnirt.add_rms_norm
    return settings.dispatch(op, _add_rms_norm_impl, x, delta, weight, eps, preset)


# -- modulated: residual + mul * RMSNorm(x) (the DiT blocks) ------------------------------------
def rms_norm_modulate_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    mul: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The eager chain: diffusers' ``RMSNorm`` of ``x``, times ``mul``, plus ``residual``."""
    h = x * torch.rsqrt(x.to(torch.float32).pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype in (torch.float16, torch.bfloat16):
        h = h.to(weight.dtype)
    h = h * weight
    if mul is not None:
        h = h * mul
    return h if residual is None else residual + h


def _check_modulation(x: torch.Tensor, mul: torch.Tensor | None, residual: torch.Tensor | None) -> str | None:
    """Why the kernel cannot take this ``mul`` and ``residual`` for ``x``, or None."""
    if residual is not None and (
        residual.shape != x.shape or residual.dtype != x.dtype or not residual.is_contiguous()
    ):
        return "the residual must be contiguous, of x's shape and dtype"
    if mul is None:
        return None
    width = x.shape[-1]
    if mul.dtype != x.dtype or mul.stride(-1) != 1:
        return "mul must have x's dtype and a contiguous last dim"
    if mul.numel() == width:
        return None  # one vector for every row: (C,), (1, C), (1, 1, C)
    if x.ndim != 3 or mul.shape != (x.shape[0], 1, width):
        return f"mul must be [C] or [B, 1, C] for x [B, L, C], not {tuple(mul.shape)} for {tuple(x.shape)}"
    return None


def rms_norm_modulate_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    mul: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    *,
    preset: Preset = "exact",
    sumsq: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernel itself, on any device Triton runs on; raises ValueError for inputs it does not
    support (``sumsq``: as :func:`add_rms_norm_triton`)."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    reason = _check(x, None, weight) or _check_modulation(x, mul, residual)
    if reason:
        raise ValueError(reason)
    return _launch(x, None, weight, eps, check_preset(preset), sumsq, mul, residual)[1]


def _modulate_impl(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    preset: str,
    mul: torch.Tensor | None,
    residual: torch.Tensor | None,
) -> torch.Tensor:
    return _launch(x, None, weight, eps, preset, None, mul, residual)[1]


_rms_norm_modulate_op = torch.library.custom_op("omnirt::rms_norm_modulate", _modulate_impl, mutates_args=())


@_rms_norm_modulate_op.register_fake
def _rms_norm_modulate_fake(x, weight, eps, preset, mul, residual):
    return x.new_empty(x.shape)


def modulate_applies(
    x: torch.Tensor, weight: torch.Tensor, mul: torch.Tensor | None, residual: torch.Tensor | None
) -> bool:
    """Whether :func:`rms_norm_modulate` runs the kernel for these inputs."""
    if not settings.kernel_device(x, weight, mul, residual):
        return False
    if _check(x, None, weight) is not None or _check_modulation(x, mul, residual) is not None:
        return False
    width = x.shape[-1]
    return settings.wanted(aten_mean_config(width, x.numel() // width) is not None)


def rms_norm_modulate(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    mul: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``residual + mul * RMSNorm(x)`` (either optional), as diffusers' eager chain computes it:
    the kernel where it applies (:func:`modulate_applies`, ``exact``), else that chain."""
    if not modulate_applies(x, weight, mul, residual):
        return rms_norm_modulate_reference(x, weight, eps, mul, residual)
    op = torch.ops.omnirt.rms_norm_modulate
    return settings.dispatch(op, _modulate_impl, x, weight, eps, "exact", mul, residual)


# -- modulated and quantized: mul * RMSNorm(x) as a W8A8 product's input -----------------------
def rms_norm_modulate_quantize_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    mul: torch.Tensor | None,
    kind: w8a8.Kind,
    *,
    preset: Preset = "exact",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel writing ``w8a8.quantize_rows(mul * RMSNorm(x))``: ``(values, scale)``, values
    [rows, W] 8-bit and scale [rows, 1] fp32, never the norm itself (ValueError for inputs it does
    not take)."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    reason = _check(x, None, weight) or _check_modulation(x, mul, None)
    if reason:
        raise ValueError(reason)
    preset, kind = check_preset(preset), w8a8.check_kind(kind)
    _, values, scale = _launch(x, None, weight, eps, preset, None, mul, None, kind)
    assert scale is not None
    return values, scale


def _modulate_quantize_impl(
    x: torch.Tensor, weight: torch.Tensor, eps: float, preset: str, mul: torch.Tensor | None, kind: str
) -> tuple[torch.Tensor, torch.Tensor]:
    _, values, scale = _launch(x, None, weight, eps, preset, None, mul, None, kind)
    assert scale is not None
    return values, scale


_rms_norm_modulate_quantize_op = torch.library.custom_op(
    "omnirt::rms_norm_modulate_quantize", _modulate_quantize_impl, mutates_args=()
)


@_rms_norm_modulate_quantize_op.register_fake
def _rms_norm_modulate_quantize_fake(x, weight, eps, preset, mul, kind):
    rows = x.numel() // x.shape[-1]
    return x.new_empty(rows, x.shape[-1], dtype=w8a8.STORAGE[kind]), x.new_empty(rows, 1, dtype=torch.float32)


def rms_norm_modulate_quantize(
    x: torch.Tensor, weight: torch.Tensor, eps: float, mul: torch.Tensor | None, kind: w8a8.Kind
) -> w8a8.QuantizedRows:
    """``mul * RMSNorm(x)`` quantized per token for the W8A8 products that read it (one pass where
    the kernel applies: :func:`modulate_applies`), else the eager chain and
    :func:`~.w8a8.quantize`; the same bits either way."""
    if not modulate_applies(x, weight, mul, None):
        return w8a8.quantize(rms_norm_modulate_reference(x, weight, eps, mul), kind)
    op = torch.ops.omnirt.rms_norm_modulate_quantize
    values, scale = settings.dispatch(op, _modulate_quantize_impl, x, weight, eps, "exact", mul, kind)
    return w8a8.QuantizedRows(values, scale, kind, tuple(x.shape), x.dtype)


# -- two in one: a residual stream's update, then the next sublayer's norm of it -----------------
def rms_norm_modulate_pair_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, mul: torch.Tensor | None, residual: torch.Tensor,
    weight2: torch.Tensor, eps2: float, mul2: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The eager chains: ``stream = residual + mul * RMSNorm(x)``, then ``mul2 * RMSNorm2(stream)``."""
    stream = rms_norm_modulate_reference(x, weight, eps, mul, residual)
    return stream, rms_norm_modulate_reference(stream, weight2, eps2, mul2)


def _check_pair(
    x: torch.Tensor, weight: torch.Tensor, mul: torch.Tensor | None, residual: torch.Tensor,
    weight2: torch.Tensor, mul2: torch.Tensor | None,
) -> str | None:  # fmt: skip
    return (
        _check(x, None, weight) or _check(x, None, weight2) or _check_modulation(x, mul, residual)
        or _check_modulation(x, mul2, None)
    )  # fmt: skip


def rms_norm_modulate_pair_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, mul: torch.Tensor | None, residual: torch.Tensor,
    weight2: torch.Tensor, eps2: float, mul2: torch.Tensor | None, kind: w8a8.Kind | None = None,
    *, preset: Preset = "exact",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """The kernel itself (ValueError for inputs it does not take): ``(stream, out, scale)``, the
    stream ``residual + mul * RMSNorm(x)`` and ``out = mul2 * RMSNorm2(stream)`` (with ``kind``,
    its 8-bit rows [rows, W] and their scales [rows, 1]; else ``scale`` None), in one launch."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    reason = _check_pair(x, weight, mul, residual, weight2, mul2)
    if reason:
        raise ValueError(reason)
    preset = check_preset(preset)
    kind = None if kind is None else w8a8.check_kind(kind)
    return _launch(x, None, weight, eps, preset, None, mul, residual, kind, (weight2, eps2, mul2))


def _pair_impl(
    x: torch.Tensor, weight: torch.Tensor, eps: float, mul: torch.Tensor | None, residual: torch.Tensor,
    weight2: torch.Tensor, eps2: float, mul2: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    stream, out, _ = _launch(x, None, weight, eps, "exact", None, mul, residual, None, (weight2, eps2, mul2))
    return stream, out


_pair_op = torch.library.custom_op("omnirt::rms_norm_modulate_pair", _pair_impl, mutates_args=())


@_pair_op.register_fake
def _pair_fake(x, weight, eps, mul, residual, weight2, eps2, mul2):
    return x.new_empty(x.shape), x.new_empty(x.shape)


def _pair_quantize_impl(
    x: torch.Tensor, weight: torch.Tensor, eps: float, mul: torch.Tensor | None, residual: torch.Tensor,
    weight2: torch.Tensor, eps2: float, mul2: torch.Tensor | None, kind: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    then = (weight2, eps2, mul2)
    stream, values, scale = _launch(x, None, weight, eps, "exact", None, mul, residual, kind, then)
    assert scale is not None
    return stream, values, scale


_pair_quantize_op = torch.library.custom_op(
    "omnirt::rms_norm_modulate_pair_quantize", _pair_quantize_impl, mutates_args=()
)


@_pair_quantize_op.register_fake
def _pair_quantize_fake(x, weight, eps, mul, residual, weight2, eps2, mul2, kind):
    rows = x.numel() // x.shape[-1]
    return (x.new_empty(x.shape), x.new_empty(rows, x.shape[-1], dtype=w8a8.STORAGE[kind]),
            x.new_empty(rows, 1, dtype=torch.float32))  # fmt: skip


def rms_norm_modulate_pair(
    x: torch.Tensor, weight: torch.Tensor, eps: float, mul: torch.Tensor | None, residual: torch.Tensor,
    weight2: torch.Tensor, eps2: float, mul2: torch.Tensor | None, kind: w8a8.Kind | None = None,
) -> tuple[torch.Tensor, torch.Tensor | w8a8.QuantizedRows]:  # fmt: skip
    """``stream = residual + mul * RMSNorm(x)`` (a DiT block's residual update after a sublayer),
    then ``mul2 * RMSNorm2(stream)`` (the next sublayer's input; with ``kind`` quantized per token
    for its W8A8 products), as :func:`rms_norm_modulate` and :func:`rms_norm_modulate_quantize`
    compute them one after the other, the same bits: one launch where the kernel applies to both
    (:func:`modulate_applies`), the stream read once less; else those two."""
    if not (
        modulate_applies(x, weight, mul, residual) and modulate_applies(x, weight2, mul2, None)
        and _check_pair(x, weight, mul, residual, weight2, mul2) is None
    ):  # fmt: skip
        stream = rms_norm_modulate(x, weight, eps, mul, residual)
        if kind is None:
            return stream, rms_norm_modulate(stream, weight2, eps2, mul2)
        return stream, rms_norm_modulate_quantize(stream, weight2, eps2, mul2, kind)
    args = (x, weight, eps, mul, residual, weight2, eps2, mul2)
    if kind is None:
        return settings.dispatch(torch.ops.omnirt.rms_norm_modulate_pair, _pair_impl, *args)
    stream, values, scale = settings.dispatch(
        torch.ops.omnirt.rms_norm_modulate_pair_quantize, _pair_quantize_impl, *args, kind
    )
    return stream, w8a8.QuantizedRows(values, scale, kind, tuple(x.shape), x.dtype)
