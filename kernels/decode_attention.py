"""One query token per row against a per-slot KV cache: split-window (flash-decoding) attention
for a streaming transformer's decode step, a Triton kernel and its torch reference.

``decode_attention(q, keys, values, lengths, attend, scale, k_scale, v_scale)``:

- ``q`` [B, H, D]: row ``b`` is slot ``b`` (rows ``0..B-1`` of the cache);
- ``keys``/``values`` [slots, Hkv, N, D] (``slots >= B``, ``N >= attend``, ``H`` a multiple of
  ``Hkv``; any strides with a contiguous last dim), in the query's dtype or fp8 e4m3
  (``torch.float8_e4m3fn``) with ``k_scale``/``v_scale`` [slots, Hkv, N] fp32: one scale per
  stored vector, ``key = keys[..., :] * k_scale[...]`` (a stored vector is quantized once, when
  it is written, so a streaming cache never re-quantizes; :func:`quantize_kv`);
- ``lengths`` [>= B] integer device tensor: row ``b`` attends to entries ``0..n-1`` of its slot
  with ``n = min(lengths[b], attend)`` (a ring whose valid entries are a prefix: RoPE is applied
  before the write, so the order of entries does not matter); ``n = 0`` gives zeros;
- ``attend``: a static bound (a length bucket): no host sync, no shape that depends on the
  lengths, so the call is CUDA-graph capturable;

returns [B, H * D] in the query's dtype (the layout the output projection reads).

**The kernel** (flash-decoding). One step has one query per (row, head), so a program per (row,
head) leaves most of the GPU idle at a few rows: the window is cut into ``splits`` chunks (more
when there are few rows, :func:`plan`), a program per (row, kv head, chunk) streams its chunk in
blocks of ``BLOCK_N`` entries with an online softmax (all query heads of its kv head at once, as
a ``[16, D]`` tile on tensor cores) and writes a partial (max, sum, accumulator); a second kernel
combines a row's partials (where one chunk covers the window, as in a short cache, the first
kernel writes the output itself: the same bits, one launch). A program reads only the valid
entries of its row (its loop stops at ``n``), so a tick reads each slot's KV once, as much as
it holds. fp8 entries are widened to the query's dtype in registers (exact); the key scale
multiplies the scores, the value scale the probabilities, so no tile is rescaled. Scores and the
accumulator are fp32; the probabilities go to the value dot in the query's dtype (as flash
attention does): close to the reference, not bitwise (``tests/gpu`` states the tolerances).

**The reference** (:func:`decode_attention_reference`) dequantizes, masks columns ``>= n`` with
a large negative bias and runs ``ring_attention_torch`` (matmul, fp32 softmax, matmul) over the
``attend`` columns: the eager chain that transformers' eager attention computes, used off CUDA
and when a caller asks for it. :func:`decode_attention` dispatches (kernel where
:func:`kernel_applies`, through the custom op ``omnirt::decode_attention``, which CUDA graphs
capture), :func:`decode_attention_triton` runs the kernel directly (CPU tensors under
``TRITON_INTERPRET=1`` in the tests).
"""

from __future__ import annotations

import functools

import torch

from .ring_attention import ring_attention_torch
from .settings import dispatch, kernel_device
from .w8a8 import quantize_rows, quantize_rows_triton

try:  # Triton ships with CUDA builds of torch only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

#: The fp8 format of a quantized cache.
FP8 = torch.float8_e4m3fn
#: Cache entries per block of the kernel's loop, and the launch's warps and pipeline stages
#: (``benchmarks/duplex_capacity.py --attention-probe`` times the alternatives).
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 3
#: The same for an fp8 cache (with scales): twice the entries per block, 13% faster at 32-192
#: slots of 3000 entries on the H200 (docs/benchmarks.md, "Native duplex capacity").
FP8_LAUNCH = (128, 4, 3)
#: Programs (row x kv head x chunk) :func:`plan` aims at per streaming multiprocessor.
PROGRAMS_PER_SM = 4
_MASKED = -1e9  # finite: a row with nothing visible gives no NaN in the reference


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Vectors ``x`` [..., D] as fp8 e4m3 [..., D] and one fp32 scale per vector [...]:
    symmetric, the vector's largest magnitude mapped to 448 (``kernels/w8a8.py``'s rows; its
    one-pass kernel on CUDA, the same bits)."""
    rows = x.reshape(-1, x.shape[-1])
    if kernel_device(rows) and rows.stride(-1) == 1:
        q, scale = quantize_rows_triton(rows, "fp8")
    else:
        q, scale = quantize_rows(rows, "fp8")
    return q.view(x.shape), scale.view(x.shape[:-1])


def _visible_n(lengths: torch.Tensor, batch: int, attend: int) -> torch.Tensor:
    return lengths[:batch].clamp(max=attend)


def decode_attention_reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    lengths: torch.Tensor,
    attend: int,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The eager chain (module doc): [B, H * D] in ``q``'s dtype."""
    batch, heads, dim = q.shape
    k = keys[:batch, :, :attend]
    v = values[:batch, :, :attend]
    if k_scale is not None:
        k = (k.float() * k_scale[:batch, :, :attend, None]).to(q.dtype)
        v = (v.float() * v_scale[:batch, :, :attend, None]).to(q.dtype)
    n = _visible_n(lengths, batch, attend)
    columns = torch.arange(attend, device=q.device)
    visible = columns.view(1, attend) < n.view(batch, 1)
    bias = torch.where(visible, 0.0, _MASKED).to(q.dtype).view(batch, 1, 1, attend).expand(-1, heads, -1, -1)
    out = ring_attention_torch(q.view(batch, heads, 1, dim), k, v, bias, scale).view(batch, heads * dim)
    return out * (n > 0).to(out.dtype).view(batch, 1)


def _check(q, keys, values, lengths, attend, k_scale, v_scale) -> str | None:
    """Why these inputs are not a decode attention call the kernel (or the reference) takes."""
    if q.dim() != 3 or keys.dim() != 4 or values.shape != keys.shape:
        return "q must be [B, H, D], keys and values [slots, Hkv, N, D] of one shape"
    batch, heads, dim = q.shape
    slots, kv_heads, columns, kdim = keys.shape
    if kdim != dim or heads % kv_heads or slots < batch or columns < attend or attend < 1:
        return (
            f"shapes do not fit: q {tuple(q.shape)}, keys {tuple(keys.shape)}, attend {attend} "
            "(need the same D, H a multiple of Hkv, slots >= B, 1 <= attend <= N)"
        )
    if lengths.dim() != 1 or lengths.shape[0] < batch or lengths.is_floating_point():
        return "lengths must be a 1-D integer tensor with a length per row"
    if (k_scale is None) != (v_scale is None):
        return "give both scales or neither"
    if k_scale is not None:
        if k_scale.shape != keys.shape[:3] or v_scale.shape != keys.shape[:3]:
            return f"scales must be [slots, Hkv, N] = {tuple(keys.shape[:3])}"
        if k_scale.dtype != torch.float32 or v_scale.dtype != torch.float32:
            return "scales must be fp32"
    elif keys.dtype != q.dtype or values.dtype != q.dtype:
        return f"an unscaled cache must be in the query's dtype ({q.dtype}), got {keys.dtype}"
    return None


def _kernel_reason(q, keys, values, k_scale, v_scale) -> str | None:
    dim = q.shape[-1]
    if dim < 16 or dim > 256 or dim & (dim - 1):
        return f"head dim {dim} is not a power of two in 16..256"
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"unsupported query dtype {q.dtype}"
    if keys.dtype not in (q.dtype, FP8) or values.dtype != keys.dtype:
        return f"unsupported cache dtype {keys.dtype}"
    if any(t.stride(-1) != 1 for t in (q, keys, values)):
        return "the last dims must be contiguous"
    if k_scale is not None and (k_scale.stride(-1) != 1 or v_scale.stride(-1) != 1):
        return "the scales' last dims must be contiguous"
    if q.shape[1] // keys.shape[1] > 64:
        return "more than 64 query heads per kv head"
    return None


def kernel_applies(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    lengths: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> bool:
    """Whether :func:`decode_attention` runs the kernel for these inputs (Triton, one CUDA device,
    supported dtypes and layout)."""
    if not kernel_device(q, keys, values, lengths, k_scale, v_scale):
        return False
    return _kernel_reason(q, keys, values, k_scale, v_scale) is None


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a few chunks, so the tests exercise the combine


def plan(
    batch: int, kv_heads: int, attend: int, multiprocessors: int, block_n: int = BLOCK_N
) -> tuple[int, int]:
    """``(splits, chunk)``: the window cut into ``splits`` chunks of ``chunk`` entries (a multiple
    of ``block_n``), enough chunks that ``batch * kv_heads * splits`` programs fill the GPU. It
    depends only on static sizes, so a graph and an eager call at one bucket split alike."""
    blocks = -(-attend // block_n)
    wanted = -(-PROGRAMS_PER_SM * multiprocessors // (batch * kv_heads))
    splits = max(1, min(blocks, wanted))
    chunk = -(-blocks // splits) * block_n
    return -(-attend // chunk), chunk


if triton is not None:

    @triton.jit
    def _partial_kernel(
        Q, K, V, KS, VS, LENS, PO, PM, PL, OUT, scale,
        sq_b, sq_h, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sks_b, sks_h, svs_b, svs_h, so_b,
        KV_HEADS, GROUPS, ATTEND, CHUNK, SPLITS,
        BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, DIM: tl.constexpr, SCALED: tl.constexpr,
        IEEE: tl.constexpr, DIRECT: tl.constexpr,
    ):  # fmt: skip
        # One program per (row, kv head, chunk): the chunk's valid entries, all query heads of
        # the kv head as one [BLOCK_G, DIM] tile; a partial softmax state per query head.
        # ``DIRECT`` (one chunk): the output itself, as the combine would write it from one
        # partial (its weight exp(0) is exactly 1), without the second launch.
        pid = tl.program_id(0)
        split = tl.program_id(1)
        row = (pid // KV_HEADS).to(tl.int64)
        kv_head = pid % KV_HEADS
        n = tl.minimum(tl.load(LENS + row).to(tl.int32), ATTEND)
        lo = split * CHUNK
        hi = tl.minimum(lo + CHUNK, n)
        g = tl.arange(0, BLOCK_G)
        g_ok = g < GROUPS
        head = kv_head * GROUPS + g
        d = tl.arange(0, DIM)
        q = tl.load(Q + row * sq_b + head[:, None] * sq_h + d[None, :], mask=g_ok[:, None], other=0.0)
        k_base = K + row * sk_b + kv_head * sk_h
        v_base = V + row * sv_b + kv_head * sv_h
        best = tl.full([BLOCK_G], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, DIM], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            r = start + tl.arange(0, BLOCK_N)
            ok = r < hi
            at = r.to(tl.int64)[:, None]
            k = tl.load(k_base + at * sk_n + d[None, :], mask=ok[:, None], other=0.0).to(q.dtype)
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            if SCALED:
                ks = tl.load(KS + row * sks_b + kv_head * sks_h + r, mask=ok, other=0.0)
                scores = scores * ks[None, :]
            scores = tl.where(ok[None, :], scores * scale, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            p = tl.exp(scores - new_best[:, None])
            alpha = tl.exp(best - new_best)
            total = total * alpha + tl.sum(p, axis=1)
            v = tl.load(v_base + at * sv_n + d[None, :], mask=ok[:, None], other=0.0).to(q.dtype)
            if SCALED:
                vs = tl.load(VS + row * svs_b + kv_head * svs_h + r, mask=ok, other=0.0)
                p = p * vs[None, :]
            if IEEE:
                update = tl.dot(p, v, input_precision="ieee")
            else:
                update = tl.dot(p.to(q.dtype), v)
            acc = acc * alpha[:, None] + update
            best = new_best
        if DIRECT:
            out = tl.where(total[:, None] > 0, acc / tl.where(total > 0, total, 1.0)[:, None], 0.0)
            at = row * so_b + head[:, None] * DIM + d[None, :]
            tl.store(OUT + at, out.to(OUT.dtype.element_ty), mask=g_ok[:, None])
        else:
            at = (row * KV_HEADS * GROUPS + head) * SPLITS + split
            tl.store(PO + at[:, None] * DIM + d[None, :], acc, mask=g_ok[:, None])
            tl.store(PM + at, best, mask=g_ok)
            tl.store(PL + at, total, mask=g_ok)

    @triton.jit
    def _combine_kernel(PO, PM, PL, OUT, SPLITS, so_b, HEADS, BLOCK_S: tl.constexpr, DIM: tl.constexpr):
        # One program per (row, head): its chunks' partial states merged, the output written.
        pid = tl.program_id(0)
        row = (pid // HEADS).to(tl.int64)
        head = pid % HEADS
        s = tl.arange(0, BLOCK_S)
        s_ok = s < SPLITS
        d = tl.arange(0, DIM)
        base = pid.to(tl.int64) * SPLITS
        best = tl.load(PM + base + s, mask=s_ok, other=float("-inf"))
        total = tl.load(PL + base + s, mask=s_ok, other=0.0)
        top = tl.max(best, axis=0)
        top = tl.where(top == float("-inf"), 0.0, top)  # a row with nothing visible
        weight = tl.exp(best - top)
        total = tl.sum(total * weight, axis=0)
        acc = tl.load(PO + (base + s)[:, None] * DIM + d[None, :], mask=s_ok[:, None], other=0.0)
        out = tl.sum(acc * weight[:, None], axis=0)
        out = tl.where(total > 0, out / tl.where(total > 0, total, 1.0), 0.0)
        tl.store(OUT + row * so_b + head * DIM + d, out.to(OUT.dtype.element_ty))


def _launch(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    lengths: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    attend: int,
    scale: float,
    launch: tuple[int, int, int] | None = None,
    combine: bool = False,
) -> torch.Tensor:
    """``combine``: the combine kernel even for one chunk (the tests compare the two ways)."""
    batch, heads, dim = q.shape
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    scaled = k_scale is not None
    block_n, warps, stages = launch or (FP8_LAUNCH if scaled else (BLOCK_N, NUM_WARPS, NUM_STAGES))
    out = torch.empty((batch, heads * dim), dtype=q.dtype, device=q.device)
    splits, chunk = plan(batch, kv_heads, attend, _multiprocessors(q.device), block_n)
    direct = splits == 1 and not combine
    parts = 0 if direct else splits  # one chunk: no partials (the partial kernel writes ``out``)
    partial = torch.empty((batch, heads, parts, dim), dtype=torch.float32, device=q.device)
    best = torch.empty((batch, heads, parts), dtype=torch.float32, device=q.device)
    total = torch.empty_like(best)
    ks = k_scale if scaled else best  # a stand-in never read (SCALED says so)
    vs = v_scale if scaled else best
    if keys.dtype == FP8 and q.device.type == "cpu":  # the interpreter reads fp8 as its bytes
        keys, values = keys.float(), values.float()
    _partial_kernel[(batch * kv_heads, splits)](
        q, keys, values, ks, vs, lengths, partial, best, total, out, scale,
        q.stride(0), q.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        ks.stride(0) if scaled else 0, ks.stride(1) if scaled else 0,
        vs.stride(0) if scaled else 0, vs.stride(1) if scaled else 0, out.stride(0),
        kv_heads, groups, attend, chunk, splits,
        BLOCK_G=max(16, triton.next_power_of_2(groups)), BLOCK_N=block_n, DIM=dim, SCALED=scaled,
        IEEE=q.dtype == torch.float32, DIRECT=direct, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if direct:
        return out
    _combine_kernel[(batch * heads,)](
        partial, best, total, out, splits, out.stride(0), heads,
        BLOCK_S=max(2, triton.next_power_of_2(splits)), DIM=dim, num_warps=4,
    )  # fmt: skip
    return out


def decode_attention_triton(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    lengths: torch.Tensor,
    attend: int,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    launch: tuple[int, int, int] | None = None,
    combine: bool = False,
) -> torch.Tensor:
    """The kernel itself, on any device Triton runs on (the CPU under ``TRITON_INTERPRET=1``);
    ValueError for inputs it does not take. ``launch``: ``(block_n, num_warps, num_stages)``
    instead of the module's (:data:`BLOCK_N`, ...), for probes; ``combine``: the second launch
    even where one chunk covers the window."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    reason = _check(q, keys, values, lengths, attend, k_scale, v_scale) or _kernel_reason(
        q, keys, values, k_scale, v_scale
    )
    if reason:
        raise ValueError(reason)
    if launch is not None and (launch[0] < 16 or launch[0] & (launch[0] - 1)):
        raise ValueError(f"block_n must be a power of two >= 16, got {launch[0]}")
    return _launch(q, keys, values, lengths, k_scale, v_scale, attend, scale, launch, combine)


@torch.library.custom_op("omnirt::decode_attention", mutates_args=())
def _decode_attention_op(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    lengths: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    attend: int,
    scale: float,
) -> torch.Tensor:
    return _launch(q, keys, values, lengths, k_scale, v_scale, attend, scale)


@_decode_attention_op.register_fake
def _decode_attention_fake(q, keys, values, lengths, k_scale, v_scale, attend, scale):
    return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    lengths: torch.Tensor,
    attend: int,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    use_kernel: bool = True,
) -> torch.Tensor:
    """The kernel where it applies and ``use_kernel`` (:func:`kernel_applies`), else the
    reference; [B, H * D] either way. ValueError for inputs neither takes."""
    reason = _check(q, keys, values, lengths, attend, k_scale, v_scale)
    if reason:
        raise ValueError(reason)
    if use_kernel and kernel_applies(q, keys, values, lengths, k_scale, v_scale):
        op = torch.ops.omnirt.decode_attention
        return dispatch(op, _launch, q, keys, values, lengths, k_scale, v_scale, attend, scale)
    return decode_attention_reference(q, keys, values, lengths, attend, scale, k_scale, v_scale)
