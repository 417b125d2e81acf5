"""Token choice from logits with the logits processing ``generate`` applies: the repetition
penalty, and a batched sampler (temperature, top-k, top-p per row) that a CUDA graph can hold."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..kernels import draw as draw_kernel
from ..kernels import philox as philox_kernel


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """``transformers``' RepetitionPenaltyLogitsProcessor; ``seen`` is a bool mask shaped like ``logits``."""
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalised, logits)


# --- Batched sampler for CUDA graphs -------------------------------------------------------------
# Everything below runs as a fixed sequence of tensor ops on the logits' device: no host sync, no
# Python branch on tensor values, no torch.Generator, shapes fixed by the batch. Randomness is
# counter-based (Philox4x32-10 keyed by a per-row seed), so a row draws the same token for the same
# (seed, counter) whatever the batch around it. The kept set and the draw are decided on an exact
# integer CDF, so no float summation order (which on CUDA depends on the number of rows) can move
# a row's token.

_MASK32 = 0xFFFFFFFF
# Philox4x32-10's constants, the one-launch kernel's too (``kernels/philox.py``).
_PHILOX_M = (philox_kernel.PHILOX_M0, philox_kernel.PHILOX_M1)  # multipliers of words 0 and 2
_PHILOX_W = (philox_kernel.PHILOX_W0, philox_kernel.PHILOX_W1)  # Weyl key increments of key words 0, 1
_PHILOX_ROUNDS = philox_kernel.ROUNDS
_UNIFORM_BITS = philox_kernel.UNIFORM_BITS  # float32 uniforms k / 2**24 are exact
_CDF_BITS = draw_kernel.CDF_BITS  # the integer CDF's fixed point (kernels/draw.py computes it too)


class SamplerInputError(ValueError):
    """Tensors of the wrong rank, length, dtype or device given to the batched sampler."""


def philox4x32(
    key0: torch.Tensor,
    key1: torch.Tensor,
    c0: torch.Tensor,
    c1: torch.Tensor,
    c2: torch.Tensor,
    c3: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32-10 (Random123), elementwise over int64 tensors of uint32 values (broadcast together).

    Returns the four output words as int64 tensors in ``[0, 2**32)``. uint32 arithmetic is emulated
    in int64: a 32x32-bit product wraps modulo 2**64 (two's complement, as int64 multiplication does
    on CPU and CUDA), so its low word is ``p & 0xFFFFFFFF`` and its high word ``(p >> 32) & 0xFFFFFFFF``
    whatever the sign the wrap left. Words 0 and 2 (and 1 and 3) travel as one stacked pair so one
    round costs a handful of kernels.
    """
    key0, key1, c0, c1, c2, c3 = torch.broadcast_tensors(key0, key1, c0, c1, c2, c3)
    pair_shape = (2,) + (1,) * key0.dim()
    which = torch.arange(2, dtype=torch.int64, device=key0.device).view(pair_shape)
    mult = _PHILOX_M[0] + (_PHILOX_M[1] - _PHILOX_M[0]) * which  # (M0, M1): built on the device
    bump = _PHILOX_W[0] + (_PHILOX_W[1] - _PHILOX_W[0]) * which  # (W0, W1)
    rounds = torch.arange(_PHILOX_ROUNDS, dtype=torch.int64, device=key0.device)
    rounds = rounds.view((-1, 1) + pair_shape[1:])
    keys = (torch.stack((key0, key1)).long() + rounds * bump) & _MASK32  # the key schedule, all rounds
    evens = torch.stack((c0, c2)).long() & _MASK32  # words (0, 2): the multiplied ones
    odds = torch.stack((c1, c3)).long() & _MASK32  # words (1, 3)
    for r in range(_PHILOX_ROUNDS):
        prod = (evens * mult).flip(0)  # (M1 * x2, M0 * x0)
        # x0 = hi(M1 x2) ^ x1 ^ k0, x2 = hi(M0 x0) ^ x3 ^ k1
        evens = ((prod >> 32) & _MASK32) ^ odds ^ keys[r]
        odds = prod & _MASK32  # x1 = lo(M1 x2), x3 = lo(M0 x0)
    return evens[0], odds[0], evens[1], odds[1]


def philox_uniform(seed: torch.Tensor, counter: torch.Tensor, stream: int) -> torch.Tensor:
    """Per-row uniform float32 in [0, 1): Philox4x32-10 keyed by ``seed`` (int64, both 32-bit halves
    as the key) on the counter block (counter low 32, counter high 32, ``stream``, 0).

    The uniform is the top 24 bits of output word 0 over 2**24 (exact in float32). ``seed`` and
    ``counter`` are elementwise (any matching shapes); ``stream`` separates independent draws that
    share a (seed, counter), e.g. several samplers in one step.
    """
    if not 0 <= stream <= _MASK32:
        raise SamplerInputError(f"stream must be in [0, 2**32), got {stream}")
    if seed.shape != counter.shape:
        raise SamplerInputError(
            f"seed {tuple(seed.shape)} and counter {tuple(counter.shape)} differ in shape"
        )
    seed, counter = seed.long(), counter.long()
    word0, *_ = philox4x32(
        seed & _MASK32,
        (seed >> 32) & _MASK32,
        counter & _MASK32,
        (counter >> 32) & _MASK32,
        torch.full_like(counter, stream),
        torch.zeros_like(counter),
    )
    return (word0 >> (32 - _UNIFORM_BITS)).float() * (2.0**-_UNIFORM_BITS)


def philox_uniforms(seed: torch.Tensor, counter: torch.Tensor, draws: int, stream: int) -> torch.Tensor:
    """float32 [B, draws] for rows of ``seed`` and ``counter`` ([B] int64): draw ``j`` of row ``i``
    is :func:`philox_uniform` of ``seed[i]`` on counter ``counter[i] * draws + j`` (for steps that
    draw several times per count, like the code predictor's groups of one frame). On CUDA one
    Triton launch (``kernels/philox.py``: the same integers, so the same bits) where the tensor
    chain takes about 90."""
    if philox_kernel.kernel_applies(seed, counter, draws, stream):
        return philox_kernel.philox_uniforms(seed, counter, draws, stream)
    rows = seed.shape[0]
    count = counter.long()[:, None] * draws + torch.arange(draws, device=counter.device)
    return philox_uniform(seed[:, None].expand(rows, draws), count, stream)


def _check_rows(logits: torch.Tensor, **params: tuple[torch.Tensor, bool]) -> None:
    """Host-side checks of shapes, dtypes and devices (tensor metadata only, no sync)."""
    if logits.dim() != 2:
        raise SamplerInputError(f"logits must be 2-D [batch, vocab], got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise SamplerInputError(f"logits must be floating point, got {logits.dtype}")
    if logits.shape[1] == 0:
        raise SamplerInputError("logits have an empty vocabulary")
    rows = logits.shape[0]
    for name, (tensor, floating) in params.items():
        if tuple(tensor.shape) != (rows,):
            raise SamplerInputError(
                f"{name} must have shape ({rows},) (one value per row of logits), got {tuple(tensor.shape)}"
            )
        if tensor.is_floating_point() != floating or tensor.is_complex() or tensor.dtype == torch.bool:
            kind = "floating point" if floating else "integer"
            raise SamplerInputError(f"{name} must be {kind}, got {tensor.dtype}")
        if tensor.device != logits.device:
            raise SamplerInputError(f"{name} is on {tensor.device}, logits on {logits.device}")


@dataclass(frozen=True)
class DrawParams:
    """What a draw derives from its rows' temperature, top-k and top-p alone (:func:`draw_params`):
    computed once per request (``draws.SlotSampling`` keeps them per slot) rather than in every
    draw, where they were about 15 small kernels of each of the code predictor's 15 draws a frame."""

    sampled: torch.Tensor  # [B] bool: temperature > 0 (else greedy)
    scale: torch.Tensor  # [B, 1] float32: the temperature where sampled, else 1
    top_k: torch.Tensor  # [B] int64 (<= 0: off)
    cut: torch.Tensor  # [B, 1] int64: top-p's cut in the CDF's fixed point (-1: off; see _top_p_cut)


def _top_p_cut(top_p: torch.Tensor) -> torch.Tensor:
    """Top-p's cut per row, [B, 1] int64: the sorted positions whose fixed-point cumulative
    probability is ``<= cut`` are removed.

    ``transformers`` removes a sorted token when its float32 cumulative probability is
    ``<= 1 - top_p``. With ``lim = 1 - top_p`` in float32 (the value ``transformers`` gets from the
    same float32 top_p), a cumulative ``c`` rounds to at most ``lim`` iff ``c`` is below the
    midpoint to the next float32, or equal to it when ``lim`` has an even mantissa (ties to even).
    That midpoint is exact in the fixed point of the CDF; top_p >= 1 removes nothing (-1)."""
    lim = (1.0 - top_p.float()).clamp(0.0, 2.0)
    above = torch.nextafter(lim, torch.full_like(lim, float("inf")))
    midpoint = (lim.double() + above.double()) * 0.5
    cut = (midpoint * 2.0**_CDF_BITS).long() - (lim.view(torch.int32) & 1).long()
    return torch.where(top_p < 1.0, cut, -1).unsqueeze(-1)


def draw_params(temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> DrawParams:
    """:class:`DrawParams` of rows with these ``temperature`` (float), ``top_k`` (integer) and
    ``top_p`` (float) [B] tensors: elementwise, so a row's values do not depend on the others."""
    temperature = temperature.float()
    scale = torch.where(temperature > 0, temperature, 1.0).unsqueeze(-1)  # float32: scores are float32
    return DrawParams(temperature > 0, scale, top_k.long(), _top_p_cut(top_p))


def _scale_by_uniform(span: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``floor(span * m / 2**24)`` for int64 ``0 <= span < 2**62`` and ``0 <= m < 2**24``, exact and
    without overflowing int64 (the product alone would need 86 bits)."""
    low = 2**_UNIFORM_BITS - 1
    return (span >> _UNIFORM_BITS) * m + (((span & low) * m) >> _UNIFORM_BITS)


def _filtered_cdf(
    logits: torch.Tensor, params: DrawParams, softmax: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scores sorted once, ascending: (order [B, V] with token id ``V - 1 - order``, cdf [B, V] int64
    fixed-point cumulative probabilities after top-k, first [B, 1] the first kept sorted position).
    The kept set is the tokens of ``order[:, first:]``: TopKLogitsWarper then TopPLogitsWarper of
    ``transformers`` (where tied scores straddle the top-p cut, the lower token ids are kept).
    ``softmax`` replaces the row-wise ``softmax(-1)`` of the kept scores (tests: CUDA's order on the
    CPU, ``kernels.draw.softmax_reference``)."""
    vocab = logits.shape[1]
    # Sorting the reversed row stably puts tied scores in decreasing token id, so among ties the
    # lower id counts as the better token (as argmax prefers it); ``order`` indexes the reversed row.
    ascending, order = torch.sort(logits.flip(-1) / params.scale, dim=-1, stable=True)
    top_k = params.top_k
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab).unsqueeze(-1)
    kth = ascending.gather(1, vocab - k)  # the k-th best score; ties with it are kept
    cut_k = torch.searchsorted(ascending, kth)  # how many scores are below it
    ascending.masked_fill_(ascending < kth, float("-inf"))
    probs = ascending.softmax(dim=-1) if softmax is None else softmax(ascending)  # a row-wise kernel
    del ascending
    cdf = probs.mul_(2.0**_CDF_BITS).long()  # exact fixed point of the float32 probabilities >= 2**-37
    del probs
    cdf.cumsum_(dim=-1)  # integer sums: the same whatever the scan order
    cut_p = torch.searchsorted(cdf, params.cut, right=True)  # top-p: the positions <= its cut
    first = torch.maximum(cut_k, cut_p).clamp_(max=vocab - 1)  # the best token is always kept
    return order, cdf, first


def draw_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniform: torch.Tensor,
) -> torch.Tensor:
    """:func:`sample_rows` with the uniforms given ([B] float in [0, 1), e.g. a slice of one
    :func:`philox_uniform` call made for several steps at once)."""
    _check_rows(
        logits,
        temperature=(temperature, True),
        top_k=(top_k, False),
        top_p=(top_p, True),
        uniform=(uniform, True),
    )
    return draw_prepared(logits, draw_params(temperature, top_k, top_p), uniform)


def draw_prepared(logits: torch.Tensor, params: DrawParams, uniform: torch.Tensor) -> torch.Tensor:
    """:func:`draw_rows` with its rows' parameters prepared (:func:`draw_params`); the same tokens.
    On CUDA, for vocabularies up to 2048 (the code predictor's), one Triton launch
    (``kernels/draw.py``: the chain's tokens, bit for bit) where the tensor chain takes about 30."""
    if params.sampled.shape != (logits.shape[0],) or uniform.shape != (logits.shape[0],):
        raise SamplerInputError(
            f"draw parameters of {tuple(params.sampled.shape)} rows and uniforms {tuple(uniform.shape)} "
            f"for logits of {logits.shape[0]} rows"
        )
    if draw_kernel.kernel_applies(logits, params.sampled, params.scale, params.top_k, params.cut, uniform):
        return draw_kernel.draw(logits, params.sampled, params.scale, params.top_k, params.cut, uniform)
    return _draw_chain(logits, params, uniform)


def _draw_chain(
    logits: torch.Tensor,
    params: DrawParams,
    uniform: torch.Tensor,
    softmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """:func:`draw_prepared`'s tensor chain, on any device and vocabulary (``softmax``: see
    :func:`_filtered_cdf`)."""
    # bf16/fp16 -> float32 is exact: argmax and the scores in float32 need no float32 copy of logits
    narrow = logits if logits.dtype in (torch.float16, torch.bfloat16, torch.float32) else logits.float()
    greedy = torch.argmax(narrow, dim=-1)
    if logits.shape[0] == 0:
        return greedy
    order, cdf, first = _filtered_cdf(narrow, params, softmax)
    # Inverse CDF over the kept suffix, in integers: target = base + floor(u * span), u = m / 2**24.
    base = torch.where(first > 0, cdf.gather(1, (first - 1).clamp(min=0)), 0)
    span = cdf[:, -1:] - base
    m = (uniform.float() * 2.0**_UNIFORM_BITS).long().clamp(0, 2**_UNIFORM_BITS - 1).unsqueeze(-1)
    target = base + _scale_by_uniform(span, m)  # < base + span: always a kept position
    pick = torch.searchsorted(cdf, target, right=True).clamp_(max=logits.shape[1] - 1)
    sampled = logits.shape[1] - 1 - order.gather(1, pick).squeeze(-1)
    return torch.where(params.sampled, sampled, greedy)


def sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    counter: torch.Tensor,
    stream: int = 0,
) -> torch.Tensor:
    """One token per row of ``logits`` [B, V] -> int64 [B], capturable in a CUDA graph.

    Per-row parameters are [B] tensors on the logits' device: ``temperature`` (float; <= 0 is
    greedy, exactly ``torch.argmax`` of ``logits.float()``), ``top_k`` (integer; <= 0 is off),
    ``top_p`` (float; >= 1 is off), ``seed`` and ``counter`` (int64). Sampled rows scale
    ``logits.float()`` by ``1 / temperature``, keep the same set as ``transformers``'
    TopKLogitsWarper followed by TopPLogitsWarper (one sort serves both; ties at the top-k
    threshold are all kept, the best token always is) and draw from the softmax over that set by
    inverse CDF with ``philox_uniform(seed, counter, stream)``. The same (seed, counter, stream)
    and row draw the same token whatever the batch size or the row's position in it.
    """
    _check_rows(logits, seed=(seed, False), counter=(counter, False))
    uniform = philox_uniforms(seed.long(), counter.long(), 1, stream)[:, 0]
    return draw_rows(logits, temperature, top_k, top_p, uniform)
