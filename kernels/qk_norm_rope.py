"""RMSNorm of an attention site's queries and keys, then rotary embedding, in one launch.

``fused_qk_norm_rope(q, k, q_weight, k_weight, table, ...)`` with ``q`` [B, T, Hq, D] and ``k``
[B, T, Hk, D] (any strides with a contiguous last dim: separate projections, or views of one packed
QKV tensor, :func:`split_packed_qkv`), returns both normalised and rotated as contiguous
[B, T, H, D] tensors, the layout attention reads (``dispatch_attention_fn`` and SDPA after a
transpose view). Eager, this chain is about 20 launches and 8 passes over each tensor.

- **Norm** over each head (``per_head``: Qwen3, Z-Image) or over all heads of a token (Wan's
  ``rms_norm_across_heads``), with an optional weight of ``D`` or ``H * D``.
- **Rotary layouts**: ``interleaved`` pairs ``(2i, 2i + 1)`` (Wan, Z-Image), ``half`` pairs
  ``(i, i + D / 2)`` (transformers' ``rotate_half``). The ``table`` [Bt, T, D] (``Bt`` 1 or B)
  packs ``cos | sin`` of the ``D / 2`` frequencies per token; :func:`table_from_halves`,
  :func:`table_from_interleaved` and :func:`table_from_complex` build it from each model's own
  form.
- **Chains** (what ``exact`` reproduces): ``norm="composite"`` is transformers' and diffusers'
  ``RMSNorm`` (fp32 sum of squares in ATen's reduction order, ``x * rsqrt(mean + eps)`` rounded to
  the input dtype, times the weight, rounded); ``norm="fused"`` is ``torch.nn.RMSNorm`` on CUDA
  (ATen's fused kernel: its row order, ``weight * (rstd * x)`` rounded once). ``rope="io"``:
  transformers' ``apply_rotary_pos_emb`` (cos and sin in the input dtype, each product and sum
  rounded); ``rope="float32"``: Wan's (fp32 table, separate fp32 products and sums, one rounding);
  ``rope="complex"``: Z-Image's complex64 multiply (the FMAs nvcc gives ``c10::complex``).
- **Offsets** are 64-bit throughout: packed QKV at 75,600 tokens with a CFG batch of 2 passes
  2^31 elements.

The torch reference (:func:`qk_norm_rope_reference`) is the eager chain itself, written as the
models write it; :func:`qk_norm_rope` dispatches (kernel on CUDA where supported and wanted by
:data:`~.settings.FUSED`, the reference elsewhere) through the custom op ``omnirt::qk_norm_rope``,
which ``torch.compile`` traces (a fake implementation gives the output shapes) and CUDA graphs
capture (no host sync, no allocation outside the caching allocator).

A decode step (one token a row) can also have the launch store its keys, and copy its values,
into each row's entry of a slot cache (:func:`qk_norm_rope_to_cache`, custom op
``omnirt::qk_norm_rope_to_cache``, which declares the caches it writes): the speech decoders'
two cache assignments a layer are then no launches of their own.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from . import settings
from .reduce_order import aten_reduce_config, mean_factor
from .settings import Preset, check_preset
from .w8a8 import STORAGE, check_kind, quantize_constants, quantize_scaled

try:  # Triton ships with CUDA builds of torch only
    import triton
    import triton.language as tl

    from .reduce_order import half_sum, halving_sum, pair_sum, vector_items
    from .w8a8 import quantize_values
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

Norm = Literal["composite", "fused"]
Rope = Literal["io", "float32", "complex"]
NORMS: tuple[Norm, ...] = ("composite", "fused")
ROPES: tuple[Rope, ...] = ("io", "float32", "complex")

#: How nvcc compiles ``c10::complex<float>``'s product ``(a + bi)(c + di)`` (one of
#: ``_COMPLEX_FMAS``): ``"none"`` rounds each product; ``"ac"``: ``fma(a, c, -(b * d))`` and
#: ``fma(a, d, b * c)``; ``"bd"``: ``fma(-b, d, a * c)`` and ``fma(b, c, a * d)``. Measured on the H200
#: (``benchmarks/kernels.py --numerics``).
COMPLEX_FMA = "ac"
_COMPLEX_FMAS = ("none", "ac", "bd")
#: How ATen sums a head's squares in the composite chain: lanes of single elements or of
#: 4-element vectors, the warp's tree by adjacent pairs or by halves (the H200 numerics).
#: ``vec4_warp``: ``vec4_halving``'s sums with the 32 lanes added by Triton's own reduction of
#: each head's row (a warp's butterfly is the halving tree when the lanes sit one a thread in a
#: warp; on the GPU a candidate to measure, ``benchmarks/kernels.py --variants``: the same bits
#: without the layout changes of five halving levels, unless Triton lays the lanes out otherwise).
#: Measured on the H200 (2026-12-05): 2.7-3.3x faster and 1-49 elements in millions off (Triton
#: gives a thread 8 bf16 of a head, two lanes, and adds those first).
#: ``vec4_lanes``: ``vec4_warp`` with each head read and written at offsets Triton's axis analysis
#: sees as contiguous in runs of 4 only (``(d // 4) * 4 + d % 4``), so that a thread holds one
#: lane's 4-item vector (8-byte accesses) and the reduction over a head's 32 lanes is the warp's
#: butterfly alone (xor 16 first: ATen's halving tree). Compiled for sm_90 with Triton 3.6 (the GPU
#: image's), the reduction's input is one lane a thread, 32 threads a head (``vec4_warp``: two
#: lanes a thread, 16 threads). Measured on an H100 (2026-12-05, ``benchmarks/kernels.py --variants
#: --variant-speed`` and the fused GPU tests with it): bitwise equal to eager on every tested shape
#: (Z-Image, the Qwen3-Omni prefill and decode, the speech decode's cache writes), and 1.9x
#: ``vec4_halving``'s speed at Z-Image (0.049 against 0.095 ms), within 7% of ``vec4_warp``: the
#: default since. (``vec4_lane_reads``, a second read as [heads, 4, 32], measured 2026-12-05: 42-45
#: elements in millions off, removed.)
COMPOSITE_SUM = "vec4_lanes"
#: The layer-norm order's final tree as explicit splits or Triton's own reduction (same bits).
TREE = "reduce"
#: Where the ``exact`` fused norm over all of a token's heads (Wan's ``rms_norm_across_heads``,
#: interleaved pairs) reads the token for its output: again, head tiles from cache, after its
#: statistic's read (``"reload"``), or from the 4-element vectors that read loaded, held in
#: registers (``"held"``: the token read once, in the layout of ATen's threads, 8-byte vectors, no
#: head tile padded to a power of two; tokens of at most :data:`HELD_STEPS` 512-element steps).
#: The same bits; they differ in speed (``benchmarks/kernels.py --variant-speed``). ``"held"``
#: since measured on an H100 (2026-12-05): bitwise equal to eager in the GPU tests (Wan 14B packed
#: QKV included) and at Wan 1.3B 480p; 0.155 against 0.189 ms at Wan 1.3B 480p, 0.353 against
#: 0.427 at 720p, 1.101 against 1.162 at Wan 14B 720p.
OUTPUT_FROM = "held"
_OUTPUT_FROMS = ("reload", "held")
HELD_STEPS = 16
#: Tokens a program of held rows takes (1, 2 or 4): every token's vectors are loaded before the
#: first token's sum, so more bytes are in flight for narrow tokens (Wan 1.3B's 1,536 elements),
#: each token summed in ATen's order as alone (the same bits).
TOKENS = 1
#: How a program walks its token's heads outside the held rows: ``"runtime"``, a loop of
#: ``heads / HC`` turns, each tile loaded as its turn comes; ``"static"`` (where q and k have as
#: many heads), the turns unrolled and every tile loaded before the first is normed, so all of the
#: token's bytes are in flight at once (Z-Image: 30 heads, two tiles of 16). The same bits; they
#: differ in speed (``benchmarks/kernels.py --variant-speed``), not yet measured.
HEAD_LOOP = "runtime"
_HEAD_LOOPS = ("runtime", "static")
#: Each order's warp tree (the kernel's ``HALVING``).
_HALVING = {
    "lanes": 0, "vec4": 0, "lanes_halving": 1, "vec4_halving": 1, "vec4_warp": 2, "vec4_lanes": 3
}
_COMPOSITE_SUMS = tuple(_HALVING)
#: Chains ``(norm, rope, per_head)`` whose ``exact`` preset is bitwise equal to eager at head dim
#: :data:`BITWISE_DIM` (``benchmarks/kernels.py`` and the GPU tests, on the H200): the
#: dispatcher's ``auto`` setting uses the kernel on these only.
BITWISE: frozenset[tuple[str, str, bool]] = frozenset(
    {("composite", "io", True), ("composite", "complex", True), ("fused", "float32", False)}
)
BITWISE_DIM = 128


def split_packed_qkv(
    qkv: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views ``q`` [B, T, Hq, D], ``k`` and ``v`` [B, T, Hkv, D] of a packed ``qkv``
    [B, T, (Hq + 2 Hkv) D] (one projection's output): no copy; the kernel reads them in place."""
    width = (q_heads + 2 * kv_heads) * head_dim
    if qkv.shape[-1] != width:
        raise ValueError(f"packed qkv has {qkv.shape[-1]} features, heads make {width}")
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return (
        q.unflatten(-1, (q_heads, head_dim)),
        k.unflatten(-1, (kv_heads, head_dim)),
        v.unflatten(-1, (kv_heads, head_dim)),
    )


def table_from_halves(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The packed table from transformers' ``cos``/``sin`` [B, T, D] (each frequency in both
    halves)."""
    half = cos.shape[-1] // 2
    return torch.cat([cos[..., :half], sin[..., :half]], dim=-1)


def table_from_interleaved(freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """The packed table from Wan's ``freqs_cos``/``freqs_sin`` [1, T, 1, D] (each frequency
    repeated twice, interleaved)."""
    cos = freqs_cos[..., 0::2].flatten(-2) if freqs_cos.dim() == 4 else freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2].flatten(-2) if freqs_sin.dim() == 4 else freqs_sin[..., 1::2]
    return torch.cat([cos, sin], dim=-1)


def table_from_complex(freqs_cis: torch.Tensor) -> torch.Tensor:
    """The packed table from Z-Image's complex64 ``freqs_cis`` [B, T, D / 2]."""
    return torch.cat([freqs_cis.real, freqs_cis.imag], dim=-1).float()


# --- the eager chains --------------------------------------------------------------------------


def _norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float, per_head: bool, norm: Norm):
    shape = x.shape
    if not per_head:
        x = x.flatten(-2)
    if norm == "fused":
        out = F.rms_norm(x, (x.shape[-1],), weight, eps)
    else:  # transformers' Qwen3RMSNorm and diffusers' RMSNorm, line for line
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        out = (x * torch.rsqrt(variance + eps)).to(x.dtype)
        if weight is not None:
            out = out * weight
    return out.view(shape)


def _rope_reference(x: torch.Tensor, table: torch.Tensor, interleaved: bool, rope: Rope) -> torch.Tensor:
    half = x.shape[-1] // 2
    cos = table[..., :half].unsqueeze(-2)  # [Bt, T, 1, D / 2]
    sin = table[..., half:].unsqueeze(-2)
    if rope == "complex":  # Z-Image's apply_rotary_emb (interleaved pairs)
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        rotated = torch.view_as_real(pairs * torch.complex(cos.float(), sin.float()))
        return rotated.flatten(-2).type_as(x)
    if interleaved:
        x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    else:
        x1, x2 = x[..., :half], x[..., half:]
    if rope == "io":  # transformers: x * cos + rotate_half(x) * sin, in the input dtype
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        first, second = x1 * cos + (-x2) * sin, x2 * cos + x1 * sin
    else:  # Wan: fp32 products of the input and the table, one rounding
        cos, sin = cos.float(), sin.float()
        first, second = x1 * cos - x2 * sin, x1 * sin + x2 * cos
    out = torch.empty_like(x)
    if interleaved:
        out[..., 0::2], out[..., 1::2] = first, second
    else:
        out[..., :half], out[..., half:] = first, second
    return out


def qk_norm_rope_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    table: torch.Tensor,
    *,
    eps: float,
    interleaved: bool,
    per_head: bool = True,
    norm: Norm = "composite",
    rope: Rope = "io",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager chain the kernel replaces (module docstring), as contiguous [B, T, H, D]."""
    out = []
    for x, w in ((q, q_weight), (k, k_weight)):
        y = _norm_reference(x, w, eps, per_head, norm)
        out.append(_rope_reference(y, table, interleaved, rope).contiguous())
    return out[0], out[1]


# --- the kernel --------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _rnd(x, DT: tl.constexpr):
        """``x`` rounded to ``DT`` (round to nearest even), back in fp32."""
        return x.to(DT).to(tl.float32)

    @triton.jit
    def _written(out, scale, DT: tl.constexpr, QUANT: tl.constexpr, QMAX: tl.constexpr,
                 ROUNDER: tl.constexpr, INT8: tl.constexpr):  # fmt: skip
        """What is stored of ``out``: rounded to ``DT``, then (``QUANT``) over ``scale`` as 8-bit
        values (``w8a8.quantize_values``)."""
        if QUANT:
            v = quantize_values(out.to(DT).to(tl.float32), scale, QMAX, ROUNDER, INT8)
        else:
            v = out.to(DT)
        return v

    @triton.jit
    def _head_sums(x, base, live, HC: tl.constexpr, STEPS: tl.constexpr, LANES: tl.constexpr,
                   VEC: tl.constexpr, HALVING: tl.constexpr):  # fmt: skip
        """Each head's sum of squares [HC, 1] in ATen's reduction order (``reduce_order``): lane
        ``l`` of ``LANES`` adds its ``STEPS`` elements in order (elements ``l * STEPS ..`` of the
        loaded heads ``x`` [HC, D] for vectorised reads, else ``s * LANES + l``, read again as
        coalesced tiles), lanes beyond a warp are halved, then the warp's tree (``HALVING``: 0 by
        adjacent pairs, 1 by halves, 2 or more by Triton's reduction)."""
        if VEC:
            lanes = tl.reshape(x * x, (HC, LANES, STEPS))
            if STEPS == 4:
                even, odd = tl.split(tl.reshape(lanes, (HC, LANES, 2, 2)))  # items (0, 2), (1, 3)
                s0, s2 = tl.split(even)
                s1, s3 = tl.split(odd)
                acc = ((s0 + s1) + s2) + s3
            elif STEPS == 2:
                s0, s1 = tl.split(lanes)
                acc = s0 + s1
            else:
                acc = tl.reshape(lanes, (HC, LANES))
        else:
            lane = tl.arange(0, LANES)[None, :]
            v = tl.load(base + lane, mask=live, other=0.0).to(tl.float32)
            acc = v * v
            for step in tl.static_range(1, STEPS):
                v = tl.load(base + step * LANES + lane, mask=live, other=0.0).to(tl.float32)
                acc = acc + v * v
        if LANES == 128:
            acc = half_sum(acc, HC, 128)
        if LANES >= 64:
            acc = half_sum(acc, HC, 64)
        if HALVING >= 2:  # Triton's reduction of each head's 32 lanes
            return tl.sum(acc, axis=1)[:, None]
        if HALVING:
            acc = half_sum(acc, HC, 32)
            acc = half_sum(acc, HC, 16)
            acc = half_sum(acc, HC, 8)
            acc = half_sum(acc, HC, 4)
            acc = half_sum(acc, HC, 2)
        else:
            acc = pair_sum(acc, HC, 32)
            acc = pair_sum(acc, HC, 16)
            acc = pair_sum(acc, HC, 8)
            acc = pair_sum(acc, HC, 4)
            acc = pair_sum(acc, HC, 2)
        return acc  # [HC, 1]

    @triton.jit
    def _sums(base, live, x, HC: tl.constexpr, STEPS: tl.constexpr, LANES: tl.constexpr, VEC: tl.constexpr,
              HALVING: tl.constexpr):  # fmt: skip
        """Each head's sum of squares [HC, 1]: in ATen's order where ``STEPS`` > 0, else Triton's."""
        if STEPS > 0:
            return _head_sums(x, base, live, HC, STEPS, LANES, VEC, HALVING)
        else:
            return tl.sum(x * x, axis=1)[:, None]

    @triton.jit
    def _ln_order_sum_squares(src, s_h, n, D: tl.constexpr, LN_K, TREE: tl.constexpr):
        """The sum of squares of a token's ``n`` elements (heads ``0..`` of ``D`` at a ``s_h``
        stride, read as one row) in ATen's fused layer-norm order (``reduce_order``): thread
        ``t`` of 128 folds its 4-element vectors ``t, t + 128, ...`` in order, then the tree."""
        thread = tl.arange(0, 128)
        acc = tl.zeros([128], tl.float32)
        for step in range(0, LN_K):
            first = (step * 512 + thread * 4).to(tl.int64)  # each thread's vector
            at = src + (first // D) * s_h + first % D  # a vector never straddles a head
            live = first < n
            for item in tl.static_range(4):
                v = tl.load(at + item, mask=live, other=0.0).to(tl.float32)
                acc = tl.fma(v, v, acc)
        if TREE:  # Triton's reduction over 4 warps of one value each: the same halving tree
            total = tl.sum(acc, axis=0)
        else:
            total = halving_sum(acc)
        return total

    @triton.jit
    def _normed(x, rstd, w, DT: tl.constexpr, HAS_W: tl.constexpr, EXACT: tl.constexpr, NORM: tl.constexpr):
        """``x`` normalised by ``rstd`` and weighted by ``w``, rounded where the chain rounds."""
        if EXACT and NORM == 0:
            y = _rnd(x * rstd, DT)
            if HAS_W:
                y = _rnd(y * w, DT)
        elif EXACT:
            y = rstd * x
            if HAS_W:
                y = w * y
            y = _rnd(y, DT)
        else:
            y = x * rstd
            if HAS_W:
                y = y * w
        return y

    @triton.jit
    def _rotated(x1, x2, c, s, DT: tl.constexpr, EXACT: tl.constexpr, ROPE: tl.constexpr, CPLX: tl.constexpr):
        """The pairs ``(x1, x2)`` rotated by ``(c, s)`` as the chain ``ROPE`` computes them."""
        if EXACT and ROPE == 0:
            o1 = _rnd(_rnd(x1 * c, DT) - _rnd(x2 * s, DT), DT)
            o2 = _rnd(_rnd(x2 * c, DT) + _rnd(x1 * s, DT), DT)
        elif EXACT and ROPE == 2 and CPLX == 1:
            o1 = tl.fma(x1, c, -(x2 * s))
            o2 = tl.fma(x1, s, x2 * c)
        elif EXACT and ROPE == 2 and CPLX == 2:
            o1 = tl.fma(-x2, s, x1 * c)
            o2 = tl.fma(x2, c, x1 * s)
        else:
            o1 = x1 * c - x2 * s
            o2 = x1 * s + x2 * c
        return o1, o2

    @triton.jit
    def _held_tiles(src, s_h, n, row, rows, D: tl.constexpr, LN_K: tl.constexpr):
        """Token ``row``'s ``n`` elements (heads of ``D`` at a ``s_h`` stride, from ``src``) as
        ATen's fused-norm threads read them: thread ``t`` of 128 its 4-element vectors ``t, t +
        128, ...``, one [128, 4] tile a step; zeros past ``rows`` tokens."""
        thread = tl.arange(0, 128)
        tiles = ()
        for step in tl.static_range(LN_K):
            p = (step * 512 + thread * 4).to(tl.int64)[:, None] + tl.arange(0, 4)[None, :]  # [128, 4]
            live = (p < n) & (row + p * 0 < rows)
            tiles = tiles + (tl.load(src + (p // D) * s_h + p % D, mask=live, other=0.0),)
        return tiles

    @triton.jit
    def _held_rows(tiles, dst, w_ptr, tab, n, eps, row, rows, out_scale, D: tl.constexpr, DT: tl.constexpr,
                   LN_K: tl.constexpr, HAS_W: tl.constexpr, ROPE: tl.constexpr, CPLX: tl.constexpr,
                   TREE: tl.constexpr, QUANT: tl.constexpr, QMAX: tl.constexpr, ROUNDER: tl.constexpr,
                   INT8: tl.constexpr):  # fmt: skip
        """The exact fused norm over all of a token's ``n`` elements, then interleaved rotation,
        from the ``tiles`` :func:`_held_tiles` loaded (ATen's order, as
        :func:`_ln_order_sum_squares`), written to ``dst`` ([H, D] contiguous) in their layout:
        each vector holds two whole pairs."""
        thread = tl.arange(0, 128)
        acc = tl.zeros([128], tl.float32)
        for step in tl.static_range(LN_K):
            v0, v1, v2, v3 = vector_items(tiles[step])
            acc = tl.fma(v0, v0, acc)
            acc = tl.fma(v1, v1, acc)
            acc = tl.fma(v2, v2, acc)
            acc = tl.fma(v3, v3, acc)
        if TREE:  # Triton's reduction over 4 warps of one value each: the same halving tree
            total = tl.sum(acc, axis=0)
        else:
            total = halving_sum(acc)
        rstd = tl.math.rsqrt(tl.math.div_rn(total, n.to(tl.float32)) + eps)
        for step in tl.static_range(LN_K):
            first = (step * 512 + thread * 4).to(tl.int64)
            p = first[:, None] + tl.arange(0, 4)[None, :]
            live = (p < n) & (row + p * 0 < rows)
            if HAS_W:
                w = tl.load(w_ptr + p, mask=live, other=0.0).to(tl.float32)
            else:
                w = p  # (no weight: never read)
            y = _normed(tiles[step].to(tl.float32), rstd, w, DT, HAS_W, True, 1)
            x1, x2 = tl.split(tl.reshape(y, (128, 2, 2)))  # items (0, 2) and (1, 3): two pairs
            f = ((first % D) // 2)[:, None] + tl.arange(0, 2)[None, :]  # [128, 2] their frequencies
            ok = row + f * 0 < rows
            c = tl.load(tab + f, mask=ok, other=0.0).to(tl.float32)
            s = tl.load(tab + D // 2 + f, mask=ok, other=0.0).to(tl.float32)
            o1, o2 = _rotated(x1, x2, c, s, DT, True, ROPE, CPLX)
            out = tl.reshape(tl.join(o1, o2), (128, 4))
            tl.store(dst + p, _written(out, out_scale, DT, QUANT, QMAX, ROUNDER, INT8), mask=live)

    @triton.jit
    def _head_tile(x, h, heads, which, src, s_h, dst, d_h, dx, d, c, s, w_ptr, rstd_all, factor, eps,
                   out_scale, D: tl.constexpr, HC: tl.constexpr, DT: tl.constexpr, HAS_W: tl.constexpr,
                   PER_HEAD: tl.constexpr, INTERLEAVED: tl.constexpr, EXACT: tl.constexpr, NORM: tl.constexpr,
                   ROPE: tl.constexpr, Q_STEPS: tl.constexpr, Q_LANES: tl.constexpr,
                   K_STEPS: tl.constexpr, K_LANES: tl.constexpr, CPLX: tl.constexpr, VEC: tl.constexpr,
                   HALVING: tl.constexpr, QUANT: tl.constexpr, QMAX: tl.constexpr, ROUNDER: tl.constexpr,
                   INT8: tl.constexpr):  # fmt: skip
        """Heads ``h`` [HC, 1] of a token, loaded as ``x`` [HC, D] (fp32) from ``src``: normed (their
        own statistic, or ``rstd_all``), rotated by ``(c, s)``, written to ``dst`` (see
        :func:`_written`)."""
        live = h < heads
        base = src + h.to(tl.int64) * s_h
        # -- RMSNorm
        if PER_HEAD:
            if which == 0:
                ss = _sums(base, live, x, HC, Q_STEPS, Q_LANES, VEC, HALVING)
            else:
                ss = _sums(base, live, x, HC, K_STEPS, K_LANES, VEC, HALVING)
            if EXACT and NORM == 1:
                rstd = tl.math.rsqrt(tl.math.div_rn(ss, D * 1.0) + eps)
            else:
                rstd = tl.math.rsqrt(ss * factor + eps)
        else:
            rstd = rstd_all
        if HAS_W:
            if PER_HEAD:
                w = tl.load(w_ptr + d).to(tl.float32)
            else:
                w = tl.load(w_ptr + h * D + d, mask=live, other=0.0).to(tl.float32)
        else:
            w = x  # (no weight: never read)
        y = _normed(x, rstd, w, DT, HAS_W, EXACT, NORM)
        # -- rotary embedding
        if INTERLEAVED:
            x1, x2 = tl.split(tl.reshape(y, (HC, D // 2, 2)))
        else:
            x1, x2 = tl.split(tl.permute(tl.reshape(y, (HC, 2, D // 2)), (0, 2, 1)))
        o1, o2 = _rotated(x1, x2, c, s, DT, EXACT, ROPE, CPLX)
        if INTERLEAVED:
            out = tl.reshape(tl.join(o1, o2), (HC, D))
        else:
            out = tl.reshape(tl.permute(tl.join(o1, o2), (0, 2, 1)), (HC, D))
        tl.store(dst + h.to(tl.int64) * d_h + dx, _written(out, out_scale, DT, QUANT, QMAX, ROUNDER, INT8),
                 mask=live)  # fmt: skip

    @triton.jit
    def _qk_norm_rope_kernel(
        Q, K, QO, KO, QW, KW, TAB, V, VO, POS, QS, KS,
        T, HQ, HK, BT,
        sq_b, sq_t, sq_h, sk_b, sk_t, sk_h,
        so_qb, so_qt, so_kb, so_kt, so_kh,
        sv_b, sv_h, so_vb, so_vt, so_vh,
        stab_b, stab_t,
        eps, q_factor, k_factor,
        D: tl.constexpr, HC: tl.constexpr, HAS_W: tl.constexpr, PER_HEAD: tl.constexpr,
        INTERLEAVED: tl.constexpr, EXACT: tl.constexpr, NORM: tl.constexpr, ROPE: tl.constexpr,
        Q_STEPS: tl.constexpr, Q_LANES: tl.constexpr, K_STEPS: tl.constexpr, K_LANES: tl.constexpr,
        CPLX: tl.constexpr, VEC: tl.constexpr, HALVING: tl.constexpr, TREE: tl.constexpr,
        CACHE: tl.constexpr, LANE_READS: tl.constexpr, HELD: tl.constexpr, LN_K: tl.constexpr,
        TOKENS: tl.constexpr, HEAD_TILES: tl.constexpr,
        QUANT: tl.constexpr, QMAX: tl.constexpr, ROUNDER: tl.constexpr, INT8: tl.constexpr,
    ):  # fmt: skip
        # One program per (token, q or k), its heads ``HC`` at a time as [HC, D] tiles. ``CACHE``
        # (one token per row): keys go to row ``b``'s cache entry ``POS[b]`` (``KO`` a cache,
        # ``so_kt`` its entry stride, ``so_kh`` its head stride) and the k program copies the
        # row's values ``V`` to the same entry of ``VO``.
        # ``LANE_READS`` (``vec4_lanes``): heads read and written at offsets Triton knows to be
        # contiguous in runs of 4 only (see :data:`COMPOSITE_SUM`). ``HELD`` (see
        # :data:`OUTPUT_FROM`): ``TOKENS`` tokens a program (``BT`` in all), every token's vectors
        # loaded before the first token's sum. ``QUANT``: the outputs 8-bit, over the scales ``QS``
        # and ``KS`` ([1] each), as :func:`_written` makes them (the rounding dtype is the input's).
        if HELD:
            which_h = tl.program_id(1)
            DT_H: tl.constexpr = Q.dtype.element_ty
            first_row = tl.program_id(0).to(tl.int64) * TOKENS
            zero = first_row * 0  # (64-bit integers on both branches)
            if which_h == 0:
                x_ptr, o_ptr, w_h, s_ptr = Q, QO, QW, QS
                sx_b, sx_t, sx_h = zero + sq_b, zero + sq_t, zero + sq_h
                sxo_b, sxo_t, n_h = zero + so_qb, zero + so_qt, zero + HQ * D
            else:
                x_ptr, o_ptr, w_h, s_ptr = K, KO, KW, KS
                sx_b, sx_t, sx_h = zero + sk_b, zero + sk_t, zero + sk_h
                sxo_b, sxo_t, n_h = zero + so_kb, zero + so_kt, zero + HK * D
            held_scale = tl.load(s_ptr) if QUANT else eps
            loaded = ()
            for r in tl.static_range(TOKENS):
                rr = first_row + r
                at = x_ptr + (rr // T) * sx_b + (rr % T) * sx_t
                loaded = loaded + (_held_tiles(at, sx_h, n_h, rr, BT, D, LN_K),)
            for r in tl.static_range(TOKENS):
                rr = first_row + r
                bb = rr // T
                tt = rr % T
                _held_rows(loaded[r], o_ptr + bb * sxo_b + tt * sxo_t, w_h, TAB + bb * stab_b + tt * stab_t,
                           n_h, eps, rr, BT, held_scale, D, DT_H, LN_K, HAS_W, ROPE, CPLX, TREE, QUANT, QMAX,
                           ROUNDER, INT8)  # fmt: skip
            return
        row = tl.program_id(0).to(tl.int64)
        which = tl.program_id(1)
        b = row // T
        t = row % T
        DT: tl.constexpr = Q.dtype.element_ty
        if which == 0:
            src = Q + b * sq_b + t * sq_t
            s_h = row * 0 + sq_h
            dst = QO + b * so_qb + t * so_qt
            d_h = row * 0 + D
            w_ptr = QW
            heads = row * 0 + HQ
            factor = q_factor
            out_scale = tl.load(QS) if QUANT else eps
        else:
            src = K + b * sk_b + t * sk_t
            s_h = row * 0 + sk_h
            if CACHE:
                dst = KO + b * so_kb + tl.load(POS + b).to(tl.int64) * so_kt
                d_h = row * 0 + so_kh
            else:
                dst = KO + b * so_kb + t * so_kt
                d_h = row * 0 + D
            w_ptr = KW
            heads = row * 0 + HK
            factor = k_factor
            out_scale = tl.load(KS) if QUANT else eps
        d = tl.arange(0, D)[None, :]
        f = tl.arange(0, D // 2)[None, :]
        if LANE_READS:  # ``d``, known contiguous in runs of 4 only: a thread reads one lane's vector
            dx = (d // 4) * 4 + d % 4
        else:
            dx = d
        tab = TAB + b * stab_b + t * stab_t
        c = tl.load(tab + f).to(tl.float32)
        s = tl.load(tab + D // 2 + f).to(tl.float32)

        rstd_all = eps * 0.0  # (per head: never read)
        if not PER_HEAD:  # one norm over all heads: its statistic first
            n = heads * D
            if EXACT and NORM == 1:
                ss = _ln_order_sum_squares(src, s_h, n, D, (n + 511) // 512, TREE)
                rstd_all = tl.math.rsqrt(tl.math.div_rn(ss, n.to(tl.float32)) + eps)
            else:
                total = tl.zeros([HC, D], tl.float32)
                for h0 in range(0, heads, HC):
                    h = h0 + tl.arange(0, HC)[:, None]
                    x = tl.load(src + h.to(tl.int64) * s_h + d, mask=h < heads, other=0.0).to(tl.float32)
                    total += x * x
                rstd_all = tl.math.rsqrt(tl.sum(tl.sum(total, axis=1), axis=0) * factor + eps)

        if HEAD_TILES:  # every head tile loaded before the first is normed (see :data:`HEAD_LOOP`)
            tiles = ()
            for i in tl.static_range(HEAD_TILES):
                h = i * HC + tl.arange(0, HC)[:, None]
                tiles = tiles + (tl.load(src + h.to(tl.int64) * s_h + dx, mask=h < heads, other=0.0),)
            for i in tl.static_range(HEAD_TILES):
                h = i * HC + tl.arange(0, HC)[:, None]
                _head_tile(tiles[i].to(tl.float32), h, heads, which, src, s_h, dst, d_h, dx, d, c, s, w_ptr,
                           rstd_all, factor, eps, out_scale, D, HC, DT, HAS_W, PER_HEAD, INTERLEAVED, EXACT,
                           NORM, ROPE, Q_STEPS, Q_LANES, K_STEPS, K_LANES, CPLX, VEC, HALVING, QUANT, QMAX,
                           ROUNDER, INT8)  # fmt: skip
        else:
            for h0 in range(0, heads, HC):
                h = h0 + tl.arange(0, HC)[:, None]
                x = tl.load(src + h.to(tl.int64) * s_h + dx, mask=h < heads, other=0.0).to(tl.float32)
                _head_tile(x, h, heads, which, src, s_h, dst, d_h, dx, d, c, s, w_ptr,
                           rstd_all, factor, eps, out_scale, D, HC, DT, HAS_W, PER_HEAD, INTERLEAVED, EXACT,
                           NORM, ROPE, Q_STEPS, Q_LANES, K_STEPS, K_LANES, CPLX, VEC, HALVING, QUANT, QMAX,
                           ROUNDER, INT8)  # fmt: skip
        if CACHE:
            if which == 1:  # the values, copied as they are
                v_src = V + b * sv_b
                v_dst = VO + b * so_vb + tl.load(POS + b).to(tl.int64) * so_vt
                for v0 in range(0, heads, HC):
                    vh = (v0 + tl.arange(0, HC)[:, None]).to(tl.int64)
                    # (at ``dx``: Triton's coalescing gives memory ops of one shape the widest
                    # vectors among them, so reads at ``d`` here would widen the heads' too)
                    v = tl.load(v_src + vh * sv_h + dx, mask=vh < heads, other=0.0)
                    tl.store(v_dst + vh * so_vh + dx, v, mask=vh < heads)


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    table: torch.Tensor,
    per_head: bool,
) -> str | None:
    """Why the kernel cannot take these inputs, or None."""
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        return "q and k must be [B, T, H, D] with the same B, T and D"
    dim = q.shape[-1]
    if dim < 16 or dim > 256 or dim & (dim - 1):
        return f"head dim {dim} is not a power of two in 16..256"
    if q.dtype != k.dtype or q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"unsupported dtypes {q.dtype}, {k.dtype}"
    if q.stride(-1) != 1 or k.stride(-1) != 1 or table.stride(-1) != 1:
        return "the last dims must be contiguous"
    if (q_weight is None) != (k_weight is None):
        return "q and k must both have a weight or neither"
    for w, heads in ((q_weight, q.shape[2]), (k_weight, k.shape[2])):
        if w is not None and (
            w.dtype != q.dtype or not w.is_contiguous() or w.numel() != (dim if per_head else heads * dim)
        ):
            return "weights must be contiguous, of the input dtype, D (per head) or H * D elements"
    if (
        table.dim() != 3
        or table.shape[-1] != dim
        or table.shape[1] != q.shape[1]
        or table.shape[0] not in (1, q.shape[0])
    ):
        return f"table must be [1 or B, T, D], got {tuple(table.shape)}"
    return None


def _sum_config(dim: int, rows: int, vec: int) -> tuple[int, int] | None:
    if vec:  # vectorised reads: 32 vectors of 4 elements, one per lane, whatever the rows
        return (4, 32) if dim == 128 else None
    return aten_reduce_config(dim, rows)


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    table: torch.Tensor,
    eps: float,
    interleaved: bool,
    per_head: bool,
    norm: str,
    rope: str,
    preset: str,
    complex_fma: str | None = None,
    composite_sum: str | None = None,
    tree: str | None = None,
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    output_from: str | None = None,
    tokens_per_program: int | None = None,
    head_loop: str | None = None,
    out_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    out_kind: str = "fp8",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cache``: ``(v, k_cache, v_cache, positions)`` (see :func:`qk_norm_rope_to_cache`): the keys
    and values go into the caches and the second output is ``k_cache``. ``output_from``: see
    :data:`OUTPUT_FROM`; ``tokens_per_program``: see :data:`TOKENS`; ``head_loop``: see
    :data:`HEAD_LOOP`; ``out_scales``: q's and k's scales ([1] fp32 each): the outputs are
    ``out_kind`` values over them (see :func:`qk_norm_rope`)."""
    output_from = output_from or OUTPUT_FROM
    if output_from not in _OUTPUT_FROMS:
        raise ValueError(f"output_from must be one of {_OUTPUT_FROMS}, got {output_from!r}")
    head_loop = head_loop or HEAD_LOOP
    if head_loop not in _HEAD_LOOPS:
        raise ValueError(f"head_loop must be one of {_HEAD_LOOPS}, got {head_loop!r}")
    batch, tokens, hq, dim = q.shape
    hk = k.shape[2]
    if out_scales is not None and cache is not None:
        raise ValueError("quantized outputs do not go into a cache")
    out_kind = check_kind(out_kind)
    out_dtype = q.dtype if out_scales is None else STORAGE[out_kind]
    qo = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    if cache is None:
        ko = torch.empty(k.shape, dtype=out_dtype, device=k.device)
        v, vo, positions = qo, qo, qo  # stand-ins never read (CACHE says so)
        k_strides = (ko.stride(0), ko.stride(1), dim)
        v_strides = (0, 0, 0, 0, 0)
    else:
        v, ko, vo, positions = cache
        k_strides = (ko.stride(0), ko.stride(2), ko.stride(1))
        v_strides = (v.stride(0), v.stride(2), vo.stride(0), vo.stride(2), vo.stride(1))
    if batch * tokens == 0:
        return qo, ko
    exact = preset == "exact"
    # ATen's summation order where the exact composite chain has one we model, Triton's elsewhere
    aten_order = exact and norm == "composite" and per_head
    order = composite_sum or COMPOSITE_SUM
    if order not in _COMPOSITE_SUMS:
        raise ValueError(f"composite sum order must be one of {_COMPOSITE_SUMS}")
    vec = int(order.startswith("vec4"))
    lane_reads = _HALVING[order] == 3 and aten_order and dim == 128
    q_cfg = (aten_order and _sum_config(dim, batch * tokens * hq, vec)) or (0, 32)
    k_cfg = (aten_order and _sum_config(dim, batch * tokens * hk, vec)) or (0, 32)
    heads_chunk = min(triton.next_power_of_2(max(hq, hk)), max(1, 2048 // dim))
    steps = triton.cdiv(max(hq, hk) * dim, 512)
    held = (
        output_from == "held" and exact and norm == "fused" and not per_head and interleaved
        and cache is None and steps <= HELD_STEPS
    )  # fmt: skip
    cplx = _COMPLEX_FMAS.index(complex_fma or COMPLEX_FMA)
    dummy = q
    # (tensor of the weight or a stand-in never read: HAS_W tells the kernel)
    per_program = (tokens_per_program or TOKENS) if held else 1
    quant = quantize_constants(out_kind)
    head_tiles = triton.cdiv(hq, heads_chunk) if head_loop == "static" and hq == hk and not held else 0
    if per_program not in (1, 2, 4):
        raise ValueError(f"tokens_per_program must be 1, 2 or 4, got {per_program}")
    _qk_norm_rope_kernel[(triton.cdiv(batch * tokens, per_program), 2)](
        q, k, qo, ko,
        q_weight if q_weight is not None else dummy,
        k_weight if k_weight is not None else dummy,
        table, v, vo, positions, *(out_scales or (qo, qo)),
        tokens, hq, hk, batch * tokens,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        qo.stride(0), qo.stride(1), *k_strides, *v_strides,
        table.stride(0) if table.shape[0] > 1 else 0, table.stride(1),
        eps,
        mean_factor(batch * tokens * hq, dim) if per_head else 1.0 / (hq * dim),
        mean_factor(batch * tokens * hk, dim) if per_head else 1.0 / (hk * dim),
        D=dim, HC=heads_chunk, HAS_W=q_weight is not None, PER_HEAD=per_head,
        INTERLEAVED=interleaved, EXACT=exact, NORM=NORMS.index(norm), ROPE=ROPES.index(rope),
        Q_STEPS=q_cfg[0], Q_LANES=q_cfg[1], K_STEPS=k_cfg[0], K_LANES=k_cfg[1],
        CPLX=cplx, VEC=vec, HALVING=_HALVING[order],
        TREE=("split", "reduce").index(tree or TREE),
        CACHE=cache is not None, LANE_READS=lane_reads, HELD=held, LN_K=steps if held else 0,
        TOKENS=per_program, HEAD_TILES=head_tiles,
        QUANT=out_scales is not None, QMAX=quant["QMAX"], ROUNDER=quant["ROUNDER"], INT8=quant["INT8"],
        num_warps=4,
        enable_fp_fusion=not exact,
    )  # fmt: skip
    return qo, ko


def qk_norm_rope_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    table: torch.Tensor,
    *,
    eps: float,
    interleaved: bool,
    per_head: bool = True,
    norm: Norm = "composite",
    rope: Rope = "io",
    preset: Preset = "exact",
    **variant: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel itself, on any device Triton runs on (the CPU under ``TRITON_INTERPRET=1``);
    raises ValueError for inputs it does not support."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    reason = _check(q, k, q_weight, k_weight, table, per_head)
    if reason:
        raise ValueError(reason)
    if norm not in NORMS or rope not in ROPES:
        raise ValueError(f"norm must be one of {NORMS} and rope one of {ROPES}")
    if rope == "complex" and not interleaved:
        raise ValueError("the complex rotary chain pairs interleaved elements")
    return _launch(
        q,
        k,
        q_weight,
        k_weight,
        table,
        eps,
        interleaved,
        per_head,
        norm,
        rope,
        check_preset(preset),
        **variant,
    )


@torch.library.custom_op("omnirt::qk_norm_rope", mutates_args=())
def _qk_norm_rope_op(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    table: torch.Tensor,
    eps: float,
    interleaved: bool,
    per_head: bool,
    norm: str,
    rope: str,
    preset: str,
    q_scale: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    kind: str = "fp8",
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch_op(q, k, q_weight, k_weight, table, eps, interleaved, per_head, norm, rope, preset,
                      q_scale, k_scale, kind)  # fmt: skip


def _launch_op(q, k, q_weight, k_weight, table, eps, interleaved, per_head, norm, rope, preset, q_scale=None,
               k_scale=None, kind="fp8"):  # fmt: skip
    """The op's body (what :func:`~.settings.dispatch` runs outside ``torch.compile``)."""
    scales = None if q_scale is None or k_scale is None else (q_scale, k_scale)
    return _launch(q, k, q_weight, k_weight, table, eps, interleaved, per_head, norm, rope, preset,
                   out_scales=scales, out_kind=kind)  # fmt: skip


@_qk_norm_rope_op.register_fake
def _qk_norm_rope_fake(q, k, q_weight, k_weight, table, eps, interleaved, per_head, norm, rope, preset,
                       q_scale=None, k_scale=None, kind="fp8"):  # fmt: skip
    dtypes = (q.dtype, k.dtype) if q_scale is None else (STORAGE[kind], STORAGE[kind])
    return q.new_empty(q.shape, dtype=dtypes[0]), k.new_empty(k.shape, dtype=dtypes[1])


def kernel_applies(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    table: torch.Tensor,
    *,
    per_head: bool = True,
    norm: Norm = "composite",
    rope: Rope = "io",
) -> bool:
    """Whether :func:`qk_norm_rope` would run the kernel for these inputs (device, dtype, layout,
    and the :data:`~.settings.FUSED` setting)."""
    if not settings.kernel_device(q, k, q_weight, k_weight, table):
        return False
    if _check(q, k, q_weight, k_weight, table, per_head) is not None:
        return False
    return settings.wanted((norm, rope, per_head) in BITWISE and q.shape[-1] == BITWISE_DIM)


def fused_qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    table: torch.Tensor,
    *,
    eps: float,
    interleaved: bool,
    per_head: bool = True,
    norm: Norm = "composite",
    rope: Rope = "io",
    preset: Preset = "exact",
    out_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    kind: str = "fp8",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The custom op, for a caller that has checked :func:`kernel_applies` itself."""
    q_scale, k_scale = out_scales if out_scales is not None else (None, None)
    return settings.dispatch(
        torch.ops.omnirt.qk_norm_rope, _launch_op,
        q, k, q_weight, k_weight, table, eps, interleaved, per_head, norm, rope, check_preset(preset),
        q_scale, k_scale, kind,
    )  # fmt: skip


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    table: torch.Tensor,
    *,
    eps: float,
    interleaved: bool,
    per_head: bool = True,
    norm: Norm = "composite",
    rope: Rope = "io",
    preset: Preset = "exact",
    out_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    kind: str = "fp8",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused kernel where it applies (:func:`kernel_applies`), else the eager chain; both
    return contiguous [B, T, H, D] tensors. ``out_scales`` (q's and k's, [1] fp32 each, on the
    device): the outputs as 8-bit values over them (``kind`` ``fp8`` or ``int8``), what an fp8
    attention reads: the kernel's last store quantizes the rounded output
    (``w8a8.quantize_values``); the eager chain is followed by ``w8a8.quantize_scaled`` (the same
    bits)."""
    args = dict(eps=eps, interleaved=interleaved, per_head=per_head, norm=norm, rope=rope)
    if kernel_applies(q, k, q_weight, k_weight, table, per_head=per_head, norm=norm, rope=rope):
        return fused_qk_norm_rope(q, k, q_weight, k_weight, table, preset=preset, out_scales=out_scales,
                                  kind=kind, **args)  # fmt: skip
    qo, ko = qk_norm_rope_reference(q, k, q_weight, k_weight, table, **args)
    if out_scales is None:
        return qo, ko
    checked = check_kind(kind)
    return quantize_scaled(qo, out_scales[0], checked), quantize_scaled(ko, out_scales[1], checked)


# --- a decode step's keys and values straight into a slot cache ---------------------------------


def _check_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
) -> str | None:
    """Why :func:`qk_norm_rope_to_cache` cannot take these (beyond :func:`_check`), or None."""
    batch, tokens, heads, dim = k.shape
    if tokens != 1:
        return f"one token per row, got {tokens}"
    if v.shape != k.shape or v.stride(-1) != 1:
        return f"v must be like k {tuple(k.shape)} with a contiguous last dim, got {tuple(v.shape)}"
    for cache in (k_cache, v_cache):
        if cache.dim() != 4 or cache.shape[0] < batch or cache.shape[1] != heads or cache.shape[3] != dim:
            return f"caches must be [>= {batch}, {heads}, N, {dim}], got {tuple(cache.shape)}"
        if cache.dtype != k.dtype or cache.stride(-1) != 1:
            return f"caches must be {k.dtype} with a contiguous last dim, got {cache.dtype}"
    if v.dtype != k.dtype:
        return f"v must be {k.dtype}, got {v.dtype}"
    if positions.shape != (batch,) or positions.dtype not in (torch.int32, torch.int64):
        return f"positions must be int32 or int64 [{batch}], got {positions.dtype} {tuple(positions.shape)}"
    return None


@torch.library.custom_op("omnirt::qk_norm_rope_to_cache", mutates_args=("k_cache", "v_cache"))
def _qk_norm_rope_to_cache_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    table: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
    interleaved: bool,
    norm: str,
    rope: str,
    preset: str,
) -> torch.Tensor:
    return _to_cache(q, k, v, q_weight, k_weight, table, k_cache, v_cache, positions, eps, interleaved, norm,
                     rope, preset)  # fmt: skip


@_qk_norm_rope_to_cache_op.register_fake
def _qk_norm_rope_to_cache_fake(q, k, v, q_weight, k_weight, table, k_cache, v_cache, positions, eps,
                                interleaved, norm, rope, preset):  # fmt: skip
    return q.new_empty(q.shape)


def _to_cache(q, k, v, q_weight, k_weight, table, k_cache, v_cache, positions, eps, interleaved, norm, rope,
              preset) -> torch.Tensor:  # fmt: skip
    """The custom op's body: :func:`_launch` writing the keys and values into the caches."""
    cache = (v, k_cache, v_cache, positions)
    args = (eps, interleaved, True, norm, rope, preset)
    return _launch(q, k, q_weight, k_weight, table, *args, cache=cache)[0]


def to_cache_applies(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    table: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    *,
    norm: Norm = "composite",
    rope: Rope = "io",
) -> bool:
    """Whether :func:`qk_norm_rope_to_cache` takes these on this device: :func:`kernel_applies`
    (per-head norms), one token per row and caches of the keys' dtype."""
    tensors = (v, k_cache, v_cache, positions)
    return (
        kernel_applies(q, k, q_weight, k_weight, table, norm=norm, rope=rope)
        and settings.kernel_device(q, *tensors)
        and _check_cache(q, k, *tensors) is None
    )


def qk_norm_rope_to_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    table: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    *,
    eps: float,
    interleaved: bool,
    norm: Norm = "composite",
    rope: Rope = "io",
    preset: Preset = "exact",
) -> torch.Tensor:
    """A decode step's queries and keys (``q``, ``k`` [B, 1, H, D]) per-head normalised and rotated
    as :func:`qk_norm_rope` does, in one launch that also stores the keys and the values ``v``
    [B, 1, Hk, D] (as they are) in row ``b``'s entry ``positions[b]`` of ``k_cache`` and ``v_cache``
    [slots, Hk, N, D] (``cache[b, :, positions[b]] = ...``, the same bits as that assignment after
    the unfused call). Returns the queries [B, 1, H, D]. ValueError for inputs it does not take;
    the kernel itself on any device Triton runs on (callers check :func:`to_cache_applies`)."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    reason = _check(q, k, q_weight, k_weight, table, True)
    reason = reason or _check_cache(q, k, v, k_cache, v_cache, positions)
    if reason:
        raise ValueError(reason)
    if norm not in NORMS or rope not in ROPES or (rope == "complex" and not interleaved):
        raise ValueError(f"norm must be one of {NORMS}, rope one of {ROPES} (complex: interleaved)")
    return settings.dispatch(
        torch.ops.omnirt.qk_norm_rope_to_cache, _to_cache,
        q, k, v, q_weight, k_weight, table, k_cache, v_cache, positions, eps, interleaved, norm, rope,
        check_preset(preset),
    )  # fmt: skip
