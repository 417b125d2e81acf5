"""Attention of a few new queries over a per-slot KV ring: a Triton kernel and its torch reference.

``ring_attention(q, keys, values, bias, scale)`` with ``q`` [rows, heads, tokens, dim],
``keys``/``values`` [rows, kv_heads, ring, dim] (any strides with a contiguous last dim),
``bias`` [rows, heads, tokens, ring] (0 where visible, a large negative number elsewhere)
returns [rows, tokens, heads * dim].

With 2 queries per slot and head, cuBLAS batched matmuls use a tile of 32-64 rows for 2 real
ones and run several times slower than reading the ring once; the Triton kernel gives one
program to each (row, head), streams the ring in blocks with an online softmax, and writes the
output directly in the [rows, tokens, heads * dim] layout the output projection reads. It is
used on CUDA when Triton is importable and ``ENABLED`` is True; the torch path runs everywhere
else and is the reference it is tested against. Two kernels: ``triton-dot`` (tensor-core dots,
IEEE fp32 for fp32 inputs) and ``triton-reduce`` (plain multiply-and-sum); if one fails to
build or launch, the next is used, then torch (``kernel_in_use()`` says which).
"""

from __future__ import annotations

import warnings

import torch

try:  # Triton ships with CUDA builds of torch only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

ENABLED = True
_MAX_TOKENS = 16  # the dot kernel pads queries to 16 rows


def ring_attention_torch(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    rows, heads, tokens, dim = q.shape
    ring = keys.shape[2]
    groups = heads // keys.shape[1]
    if groups > 1:
        keys = keys.repeat_interleave(groups, dim=1)
        values = values.repeat_interleave(groups, dim=1)
    scores = torch.baddbmm(
        bias.reshape(rows * heads, tokens, ring),
        q.reshape(rows * heads, tokens, dim),
        keys.reshape(rows * heads, ring, dim).transpose(1, 2),
        alpha=scale,
    )
    weights = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.bmm(weights, values.reshape(rows * heads, ring, dim))
    return out.view(rows, heads, tokens, dim).transpose(1, 2).reshape(rows, tokens, heads * dim)


if triton is not None:

    @triton.jit
    def _ring_attention_kernel(
        Q, K, V, BIAS, OUT, scale,
        sq_b, sq_h, sq_t,
        sk_b, sk_h, sk_r,
        sv_b, sv_h, sv_r,
        sb_b, sb_h, sb_t,
        so_b, so_h, so_t,
        HEADS, GROUPS, TOKENS, RING,
        BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, DIM: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        row = pid // HEADS
        head = pid % HEADS
        kv_head = head // GROUPS
        t = tl.arange(0, BLOCK_T)
        d = tl.arange(0, DIM)
        t_ok = t < TOKENS
        q = tl.load(
            Q + row * sq_b + head * sq_h + t[:, None] * sq_t + d[None, :], mask=t_ok[:, None], other=0.0
        )
        q = q.to(tl.float32) * scale
        best = tl.full([BLOCK_T], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_T], tl.float32)
        acc = tl.zeros([BLOCK_T, DIM], tl.float32)
        for start in range(0, RING, BLOCK_R):
            r = start + tl.arange(0, BLOCK_R)
            r_ok = r < RING
            k = tl.load(
                K + row * sk_b + kv_head * sk_h + r[:, None] * sk_r + d[None, :],
                mask=r_ok[:, None],
                other=0.0,
            )
            scores = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
            b = tl.load(BIAS + row * sb_b + head * sb_h + t[:, None] * sb_t + r[None, :],
                        mask=t_ok[:, None] & r_ok[None, :], other=0.0)  # fmt: skip
            scores = tl.where(r_ok[None, :], scores + b.to(tl.float32), float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            p = tl.exp(scores - new_best[:, None])
            alpha = tl.exp(best - new_best)
            v = tl.load(
                V + row * sv_b + kv_head * sv_h + r[:, None] * sv_r + d[None, :],
                mask=r_ok[:, None],
                other=0.0,
            )
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
            total = total * alpha + tl.sum(p, axis=1)
            best = new_best
        out = acc / total[:, None]
        tl.store(OUT + row * so_b + head * so_h + t[:, None] * so_t + d[None, :],
                 out.to(OUT.dtype.element_ty), mask=t_ok[:, None])  # fmt: skip

    @triton.jit
    def _ring_attention_dot_kernel(
        Q, K, V, BIAS, OUT, scale,
        sq_b, sq_h, sq_t,
        sk_b, sk_h, sk_r,
        sv_b, sv_h, sv_r,
        sb_b, sb_h, sb_t,
        so_b, so_h, so_t,
        HEADS, GROUPS, TOKENS, RING,
        BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, DIM: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        # Same contract as the reduction kernel; scores and outputs on tensor cores (queries
        # padded to 16 rows), in IEEE fp32 for fp32 inputs.
        pid = tl.program_id(0)
        row = pid // HEADS
        head = pid % HEADS
        kv_head = head // GROUPS
        t = tl.arange(0, BLOCK_T)
        d = tl.arange(0, DIM)
        t_ok = t < TOKENS
        q = tl.load(
            Q + row * sq_b + head * sq_h + t[:, None] * sq_t + d[None, :], mask=t_ok[:, None], other=0.0
        )
        best = tl.full([BLOCK_T], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_T], tl.float32)
        acc = tl.zeros([BLOCK_T, DIM], tl.float32)
        for start in range(0, RING, BLOCK_R):
            r = start + tl.arange(0, BLOCK_R)
            r_ok = r < RING
            k = tl.load(
                K + row * sk_b + kv_head * sk_h + r[:, None] * sk_r + d[None, :],
                mask=r_ok[:, None],
                other=0.0,
            )
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            b = tl.load(BIAS + row * sb_b + head * sb_h + t[:, None] * sb_t + r[None, :],
                        mask=t_ok[:, None] & r_ok[None, :], other=0.0)  # fmt: skip
            scores = tl.where(r_ok[None, :], scores * scale + b.to(tl.float32), float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            p = tl.exp(scores - new_best[:, None])
            alpha = tl.exp(best - new_best)
            v = tl.load(
                V + row * sv_b + kv_head * sv_h + r[:, None] * sv_r + d[None, :],
                mask=r_ok[:, None],
                other=0.0,
            )
            if IEEE:
                update = tl.dot(p, v, input_precision="ieee")
            else:
                update = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + update
            total = total * alpha + tl.sum(p, axis=1)
            best = new_best
        out = acc / total[:, None]
        tl.store(OUT + row * so_b + head * so_h + t[:, None] * so_t + d[None, :],
                 out.to(OUT.dtype.element_ty), mask=t_ok[:, None])  # fmt: skip


def _triton_ok(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor) -> bool:
    dim = q.shape[-1]
    return (
        ENABLED
        and triton is not None
        and q.is_cuda
        and q.shape[2] <= _MAX_TOKENS
        and dim >= 16
        and dim & (dim - 1) == 0
        and all(t.stride(-1) == 1 for t in (q, keys, values, bias))
    )


_KERNELS = ("triton-dot", "triton-reduce")
_active = 0  # index into _KERNELS; moves on when a kernel fails to build or launch


def kernel_in_use() -> str:
    """Which implementation CUDA calls get now: ``triton-dot``, ``triton-reduce`` or ``torch``."""
    if not ENABLED or triton is None or _active >= len(_KERNELS):
        return "torch"
    return _KERNELS[_active]


def ring_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    global _active
    while _triton_ok(q, keys, values, bias) and _active < len(_KERNELS):
        try:
            return _ring_attention_triton(q, keys, values, bias, scale, _KERNELS[_active])
        except Exception as error:  # a Triton/driver mismatch must not take the server down
            warnings.warn(
                f"{_KERNELS[_active]} ring attention failed ({error!r}); trying the next", stacklevel=2
            )
            _active += 1
    return ring_attention_torch(q, keys, values, bias, scale)


def _ring_attention_triton(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float, kernel: str
) -> torch.Tensor:
    rows, heads, tokens, dim = q.shape
    ring = keys.shape[2]
    out = torch.empty(rows, tokens, heads * dim, dtype=q.dtype, device=q.device)
    args = (
        q, keys, values, bias, out, scale,
        q.stride(0), q.stride(1), q.stride(2),
        keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        bias.stride(0), bias.stride(1), bias.stride(2),
        out.stride(0), dim, out.stride(1),
        heads, heads // keys.shape[1], tokens, ring,
    )  # fmt: skip
    if kernel == "triton-dot":
        _ring_attention_dot_kernel[(rows * heads,)](
            *args, BLOCK_T=16, BLOCK_R=64, DIM=dim, IEEE=q.dtype == torch.float32, num_warps=4
        )
    else:
        _ring_attention_kernel[(rows * heads,)](
            *args, BLOCK_T=max(2, triton.next_power_of_2(tokens)), BLOCK_R=64, DIM=dim, num_warps=4
        )
    return out
