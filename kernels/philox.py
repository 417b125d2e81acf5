"""Counter-based uniforms in one launch: Philox4x32-10 per (row, draw), as ``stages/sampling.py``
draws them.

``stages.sampling.philox_uniform`` computes Philox4x32-10 with int64 tensor operations that emulate
uint32 arithmetic: ten rounds of a handful of elementwise kernels each, about 90 launches a call.
A graphed decode step draws one to three such calls (the talker's frame step two: its code
predictor's 15 groups at once, and the group-0 code), so at small batch they were a visible part of
the step's kernels. :func:`philox_uniforms` is the same function in one Triton kernel: for row ``i``
and draw ``j``, key ``(seed_i mod 2**32, seed_i >> 32 mod 2**32)``, counter block
``(c mod 2**32, c >> 32 mod 2**32, stream, 0)`` with ``c = counter_i * draws + j`` (int64,
wrapping as torch's product does), and the uniform ``(word0 >> 8) / 2**24``. The same integers, so
the same bits (``tests/kernels/test_philox.py``).
"""

from __future__ import annotations

import torch

from . import settings
from .settings import interpreted, kernel_device

try:  # Triton ships with CUDA builds of torch only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

#: Round multipliers and key increments (Random123's Philox4x32 constants).
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
ROUNDS = 10
UNIFORM_BITS = 24


if triton is not None:

    @triton.jit
    def _philox_uniforms_kernel(
        SEED, COUNTER, OUT, rows, draws, stream, seed_stride, counter_stride,
        M0: tl.constexpr, M1: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr,
        ROUNDS: tl.constexpr, SHIFT: tl.constexpr, SCALE: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = offs < rows * draws
        row = offs // draws
        draw = offs - row * draws
        seed = tl.load(SEED + row.to(tl.int64) * seed_stride, mask=live, other=0)
        base = tl.load(COUNTER + row.to(tl.int64) * counter_stride, mask=live, other=0)
        count = base * draws + draw.to(tl.int64)
        k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
        k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        x0 = (count & 0xFFFFFFFF).to(tl.uint32)
        x1 = ((count >> 32) & 0xFFFFFFFF).to(tl.uint32)
        x2 = (tl.zeros([BLOCK], dtype=tl.int64) + stream).to(tl.uint32)
        x3 = tl.zeros([BLOCK], dtype=tl.uint32)
        m0 = tl.full([BLOCK], M0, tl.uint32)
        m1 = tl.full([BLOCK], M1, tl.uint32)
        w0 = tl.full([BLOCK], W0, tl.uint32)
        w1 = tl.full([BLOCK], W1, tl.uint32)
        for _ in tl.static_range(ROUNDS):
            hi0 = tl.umulhi(m0, x0)
            lo0 = m0 * x0
            hi1 = tl.umulhi(m1, x2)
            lo1 = m1 * x2
            x0, x1, x2, x3 = hi1 ^ x1 ^ k0, lo1, hi0 ^ x3 ^ k1, lo0
            k0 = k0 + w0
            k1 = k1 + w1
        uniform = (x0 >> SHIFT).to(tl.float32) * SCALE
        tl.store(OUT + offs, uniform, mask=live)


def _check(seed: torch.Tensor, counter: torch.Tensor, draws: int, stream: int) -> str | None:
    if seed.dim() != 1 or counter.shape != seed.shape:
        return f"seed and counter must be [B] of one length, got {tuple(seed.shape)}, {tuple(counter.shape)}"
    if seed.dtype != torch.long or counter.dtype != torch.long:
        return f"seed and counter must be int64, got {seed.dtype}, {counter.dtype}"
    if draws < 1:
        return f"draws must be >= 1, got {draws}"
    if not 0 <= stream <= 0xFFFFFFFF:
        return f"stream must be in [0, 2**32), got {stream}"
    return None


def kernel_applies(seed: torch.Tensor, counter: torch.Tensor, draws: int, stream: int) -> bool:
    """Whether the samplers' dispatcher (``stages.sampling.philox_uniforms``) runs the kernel: CUDA
    tensors it takes, with Triton, where :data:`~.settings.FUSED` is not ``off`` (it computes the
    reference's integers: bitwise wherever it runs)."""
    usable = kernel_device(seed, counter) and _check(seed, counter, draws, stream) is None
    return usable and settings.wanted(True)


def philox_uniforms(seed: torch.Tensor, counter: torch.Tensor, draws: int, stream: int) -> torch.Tensor:
    """float32 [B, draws]: draw ``j`` of row ``i`` is Philox4x32-10's word 0 of key ``seed[i]`` and
    counter ``counter[i] * draws + j`` on ``stream``, as a uniform ``k / 2**24`` in [0, 1). The
    kernel itself (CUDA, or the CPU under ``TRITON_INTERPRET=1``); ValueError for inputs it does not
    take."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    reason = _check(seed, counter, draws, stream)
    if reason:
        raise ValueError(reason)
    rows = seed.shape[0]
    out = torch.empty((rows, draws), dtype=torch.float32, device=seed.device)
    if rows:
        block = min(256, triton.next_power_of_2(rows * draws))
        grid = (triton.cdiv(rows * draws, block),)
        _philox_uniforms_kernel[grid](
            seed, counter, out, rows, draws, stream, seed.stride(0), counter.stride(0),
            M0=PHILOX_M0, M1=PHILOX_M1, W0=PHILOX_W0, W1=PHILOX_W1, ROUNDS=ROUNDS,
            SHIFT=32 - UNIFORM_BITS, SCALE=2.0**-UNIFORM_BITS, BLOCK=block,
            num_warps=1 if interpreted() else max(1, min(4, block // 32)),
        )  # fmt: skip
    return out
