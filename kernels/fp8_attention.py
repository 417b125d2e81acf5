"""FP8 attention for the W8A8 DiTs: queries, keys and values quantized to e4m3 with one scale per
tensor, then cuDNN's fused FP8 flash attention (Hopper and later), the output in the model's dtype.

Why: with W8A8 fp8 weights, a Z-Image step's products take 37 ms of its 67 and bf16 attention 17
(H200, ``docs/benchmarks.md``); Wan at 480p is attention-bound. Issue 15's 1.6x over bf16 needs
the attention's two products on the FP8 tensor cores too.

What cuDNN computes (``sdpa_fp8``, forward): ``S = (Q8 K8^T) * descale_q * descale_k * attn_scale``
in fp32; the online softmax's probabilities ``P`` (in [0, 1] against the running row maximum)
scaled by ``scale_s`` = 448 and rounded to e4m3; ``P8 V8`` accumulated in fp32, times
``descale_s * descale_v``, over the fp32 row sums; written in bf16 or fp16 (``scale_o`` 1), or,
where a cuDNN version declines that, in e4m3 at V's scale (``scale_o`` its reciprocal: an output
row is an average of V's rows, so it stays within V's peak) and widened after; or, for a caller
that takes it so (``quantized_out``: the fp8 W8A8 ``to_out`` after it), in e4m3 at V's scale,
handed on as it is (no quantization pass before that product).
:func:`fp8_attention_reference` models that in fp32 (the same roundings of Q, K, V and P, with
the final row maximum in place of the running one), for the tests.

Scales. :func:`quantize_tensor` maps a tensor's largest magnitude to 448, as
:func:`~omnirt.kernels.w8a8.quantize_rows` does for a row (one row of everything: the same
bits); on CUDA two Triton kernels (the peak by atomic maximum, then the values), no host sync, so
CUDA graphs capture it. Queries and keys that a QK norm made may come in e4m3 already, over the
fixed scales of :func:`normed_scale` (``qk_norm_rope.qk_norm_rope(..., out_scales=)`` writes them so, in
the DiT processors of ``stages/diffusion/fused.py``): values alone are read for a peak then.
Key padding (Z-Image's batched captions) is a prefix mask: ``key_lengths`` [B] int32, each row's
first keys live.

:func:`fp8_attention` runs where :func:`applies` says (CUDA, compute capability 9.0 or later,
``cudnn`` importable, bf16 or fp16 of head dim a multiple of 16 up to 256); a graph cuDNN
declines at build is remembered and :func:`applies` then says no for its shapes, so the caller's
bf16 attention runs. The cuDNN graphs are built once per shape and kept (:data:`MAX_PLANS`).
``kernels.settings.FP8_ATTENTION`` (``omnirt serve --fp8-attention``) says whether the fp8 W8A8
models use it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from . import cudnn_graphs
from .w8a8 import STORAGE, QuantizedRows, quantize_constants, quantize_rows

try:  # Triton ships with CUDA builds of torch only
    import triton
    import triton.language as tl

    from .w8a8 import quantize_values
except ImportError:  # pragma: no cover - depends on the install
    triton = None

log = logging.getLogger(__name__)

#: e4m3's largest value: where the probabilities' 1 goes (``scale_s``).
P_SCALE = 448.0
#: Built cuDNN graphs kept (least recently used dropped past it).
MAX_PLANS = 32
#: Above 0: at a shape's first call outside CUDA-graph capture, cuDNN's first this many plans are
#: built and timed on the call's tensors and the fastest runs from then on; 0: cuDNN's first plan
#: (its heuristics' choice). ``benchmarks/attention_plans.py`` times every plan at the DiTs' shapes.
AUTOTUNE_PLANS = 0
#: Head dims cuDNN's fp8 attention takes on Hopper: multiples of 16 up to this.
MAX_HEAD_DIM = 256

_CUDNN_DTYPES = {torch.bfloat16: "BFLOAT16", torch.float16: "HALF"}

# uids of the graph's tensors (above those the front end gives its virtual tensors)
_Q, _K, _V, _O, _Q_DESCALE, _K_DESCALE, _V_DESCALE, _S_DESCALE, _S_SCALE, _O_SCALE = range(100, 110)
_O_AMAX, _SEQ_Q, _SEQ_KV = 110, 111, 112


# --- per-tensor quantization --------------------------------------------------------------------


def quantize_tensor_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` as e4m3 values (its shape, contiguous) and one fp32 scale [1]: ``x ~ values * scale``,
    the largest magnitude mapped to 448 (:func:`~omnirt.kernels.w8a8.quantize_rows` of ``x`` as
    one row)."""
    values, scale = quantize_rows(x.reshape(1, -1), "fp8")
    return values.view(x.shape), scale.view(1)


if triton is not None:

    @triton.jit
    def _peak_kernel(X, PEAK, rows, cols, stride_x, BR: tl.constexpr, BC: tl.constexpr):
        r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)[:, None]
        c = tl.program_id(1) * BC + tl.arange(0, BC)[None, :]
        v = tl.load(X + r * stride_x + c, mask=(r < rows) & (c < cols), other=0.0).to(tl.float32)
        tl.atomic_max(PEAK, tl.max(tl.max(tl.abs(v), axis=1), axis=0))

    @triton.jit
    def _quantize_tensor_kernel(X, Q, PEAK, SCALE, rows, cols, stride_x, INV_QMAX, QMAX: tl.constexpr,
                                MIN_PEAK: tl.constexpr, ROUNDER: tl.constexpr, INT8: tl.constexpr,
                                BR: tl.constexpr, BC: tl.constexpr):  # fmt: skip
        r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)[:, None]
        c = tl.program_id(1) * BC + tl.arange(0, BC)[None, :]
        scale = tl.maximum(tl.load(PEAK), MIN_PEAK) * INV_QMAX
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            tl.store(SCALE, scale)
        live = (r < rows) & (c < cols)
        v = tl.load(X + r * stride_x + c, mask=live, other=0.0).to(tl.float32)
        tl.store(Q + r * cols + c, quantize_values(v, scale, QMAX, ROUNDER, INT8), mask=live)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., H, D] as a [tokens, H * D] view with unit column stride (a copy if it has none)."""
    flat = x.flatten(-2) if x.dim() >= 2 else x.reshape(1, -1)
    try:
        rows = flat.view(-1, flat.shape[-1])
    except RuntimeError:
        rows = flat.reshape(-1, flat.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def quantize_tensor_triton(
    x: torch.Tensor, kind: str = "fp8", peak: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_tensor_reference` in two Triton kernels (the same bits); ``x`` [..., H, D]
    with rows of unit column stride (views of a packed QKV are read in place). ``kind`` ``int8``
    (values -127..127, the same kernels) is there for the interpreter's tests: it has no fp8.
    ``peak`` (fp32 [1]): ``x``'s largest magnitude, already known (the merged QKV product's
    epilogue found V's: ``w8a8_linear(..., peak=)``), so the values kernel alone runs."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    rows = _rows(x)
    count, cols = rows.shape
    values = torch.empty(x.shape, dtype=STORAGE[kind], device=x.device)
    scale = torch.empty(1, dtype=torch.float32, device=x.device)
    known = peak is not None
    peak = peak if peak is not None else torch.zeros(1, dtype=torch.float32, device=x.device)
    if count and cols:
        br, bc = 8, min(triton.next_power_of_2(cols), 1024)
        grid = (triton.cdiv(count, br), triton.cdiv(cols, bc))
        if not known:
            _peak_kernel[grid](rows, peak, count, cols, rows.stride(0), BR=br, BC=bc, num_warps=4)
        _quantize_tensor_kernel[grid](
            rows, values, peak, scale, count, cols, rows.stride(0), **quantize_constants(kind),  # type: ignore[arg-type]
            BR=br, BC=bc, num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
    else:
        constants = quantize_constants(kind)  # type: ignore[arg-type]
        scale.fill_(constants["MIN_PEAK"] * constants["INV_QMAX"])
    return values, scale


def quantize_tensor(x: torch.Tensor, peak: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` as e4m3 values and one fp32 scale [1]: the Triton kernels on CUDA (``peak``: ``x``'s
    largest magnitude where it is known, :func:`quantize_tensor_triton`), else the eager chain
    (the same bits)."""
    if triton is not None and x.is_cuda:
        return quantize_tensor_triton(x, peak=peak)
    return quantize_tensor_reference(x)


#: How far above its bound a normed, rotated element may come out of its roundings (each a half
#: unit in bf16's last place, 2^-9, a few of them in turn): the bound's margin.
_BOUND_MARGIN = 1.0 + 2.0**-5


def normed_scale(
    weight: torch.Tensor | None, elements: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """A fixed e4m3 scale [1] for queries or keys RMS-normalised over ``elements`` values (a head,
    or all heads) with ``weight``, then rotated: no element exceeds ``sqrt(elements) * max|weight|``
    (a normalised vector's squares sum to ``elements``; weighting and rotating pairs keep each
    pair's length within it), so that bound, with a margin, goes to 448. No read of the tensor
    for its peak; the cost is range, not precision: e4m3 keeps its 3 mantissa bits for every
    element above 2^-6 of the scale's unit (at a head of 128: elements above about 1/2500 of
    ``max|weight|``), and an element typical of a unit-RMS row lands near 448 / sqrt(elements)."""
    peak = 1.0 if weight is None else weight.detach().abs().amax().float()
    bound = peak * (math.sqrt(elements) * _BOUND_MARGIN / 448.0)
    if weight is None:
        return torch.full((1,), bound, dtype=torch.float32, device=device)
    return bound.reshape(1)


# --- the reference ------------------------------------------------------------------------------


def _key_mask(key_lengths: torch.Tensor | None, batch: int, keys: int, device: torch.device):
    if key_lengths is None:
        return None
    live = torch.arange(keys, device=device)[None, :] < key_lengths.to(device).view(batch, 1)
    return live[:, None, None, :]  # [B, 1, 1, S_kv]


def fp8_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_lengths: torch.Tensor | None = None,
    scale: float | None = None, fp8_out: bool = False, *, q_scale: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None, quantized_out: bool = False, v_peak: torch.Tensor | None = None,
) -> torch.Tensor | QuantizedRows:  # fmt: skip
    """What :func:`fp8_attention` computes, in fp32 on any device, with its arguments (``v_peak``
    taken and not needed: V's scale comes from V, which is what a given peak is): ``q`` [B,
    S_q, H, D], ``k`` and ``v`` [B, S_kv, H_kv, D] quantized per tensor (``q`` and ``k`` may come
    in e4m3 with their scales), attention with e4m3 probabilities, returned [B, S_q, H, D] in
    ``v``'s dtype (``fp8_out``: through e4m3 at V's scale first, as a plan whose output cuDNN
    writes in e4m3), or with ``quantized_out`` as :func:`fp8_attention` hands it on."""
    batch, _, heads, dim = q.shape
    kv_heads = k.shape[2]
    attn_scale = 1.0 / math.sqrt(dim) if scale is None else scale
    (q8, qs), (k8, ks) = (
        (t, s) if t.dtype == torch.float8_e4m3fn else quantize_tensor_reference(t)
        for t, s in ((q, q_scale), (k, k_scale))
    )  # fmt: skip
    v8, vs = quantize_tensor_reference(v)
    qf = (q8.float() * qs).transpose(1, 2)  # [B, H, S, D]
    kf = (k8.float() * ks).transpose(1, 2)
    vf = (v8.float() * vs).transpose(1, 2)
    if kv_heads != heads:
        kf = kf.repeat_interleave(heads // kv_heads, dim=1)
        vf = vf.repeat_interleave(heads // kv_heads, dim=1)
    s = (qf @ kf.transpose(-1, -2)) * attn_scale
    mask = _key_mask(key_lengths, batch, k.shape[1], q.device)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.exp(s - s.amax(dim=-1, keepdim=True))
    total = p.sum(dim=-1, keepdim=True)
    p8 = (p * P_SCALE).to(torch.float8_e4m3fn).float() / P_SCALE
    out = ((p8 @ vf) / total).transpose(1, 2)
    if not (fp8_out or quantized_out):
        return out.to(v.dtype)
    out8 = (out / vs).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).contiguous()
    return _as_rows(out8, vs, v.dtype) if quantized_out else (out8.float() * vs).to(v.dtype)


def _as_rows(out8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> QuantizedRows:
    """An e4m3 attention output [B, S, H, D] (contiguous) at one ``scale`` [1] as the rows a W8A8
    product takes: [B * S, H * D] values, each row's scale that one."""
    batch, queries, heads, dim = out8.shape
    rows, width = batch * queries, heads * dim
    return QuantizedRows(out8.view(rows, width), scale.expand(rows, 1).contiguous(), "fp8",
                         (batch, queries, width), dtype)  # fmt: skip


# --- cuDNN --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Shape:
    batch: int
    heads: int
    kv_heads: int
    queries: int
    keys: int
    dim: int
    dtype: torch.dtype
    masked: bool
    device: int
    scale: float
    quantized_out: bool = False  # the caller takes the output in e4m3 (a plan writing e4m3 only)


@dataclass
class _Plan:
    graph: Any
    workspace: torch.Tensor
    handle: Any
    constants: dict[int, torch.Tensor]  # the probabilities' scales, the output's, the query lengths
    fp8_out: bool  # the output in e4m3 (scaled by V's scale), widened after
    index: int | None = None  # the plan timed fastest (AUTOTUNE_PLANS), else cuDNN's first
    tuned: bool = False  # the plans were timed (or AUTOTUNE_PLANS was 0 at the first call)

    def execute(self, pack: dict[int, torch.Tensor]) -> None:
        if self.index is None:
            self.graph.execute(pack, self.workspace, handle=self.handle)
        else:
            self.graph.execute_plan_at_index(pack, self.workspace, self.index, handle=self.handle)


_plans: cudnn_graphs.PlanCache[_Plan] = cudnn_graphs.PlanCache(MAX_PLANS, "fp8 attention")


def _bhsd_strides(tokens: int, heads: int, dim: int) -> tuple[int, int, int, int]:
    """Strides of dims (B, H, S, D) for a contiguous [B, S, H, D] tensor."""
    return (tokens * heads * dim, dim, heads * dim, 1)


def build_graph(cudnn: Any, shape: _Shape, handle: Any = None, fp8_out: bool = False) -> Any:
    """The cuDNN graph of one fp8 attention shape, before validation (which needs libcudnn): Q, K, V
    e4m3 in [B, S, H, D] memory, the output in ``shape.dtype``, per-tensor descales, and where
    ``masked`` the keys past each row's length masked (``seq_len_q`` all queries); ``handle``: the
    cuDNN handle of the device it will run on; ``fp8_out``: the output in e4m3 instead (for cuDNN
    versions without a wider output)."""
    dt = cudnn.data_type
    fp8 = dt.FP8_E4M3
    out_type = fp8 if fp8_out else getattr(dt, _CUDNN_DTYPES[shape.dtype])
    context = {"handle": handle} if handle is not None else {}
    graph = cudnn.pygraph(
        io_data_type=fp8, intermediate_data_type=dt.FLOAT, compute_data_type=dt.FLOAT, **context
    )
    b, h, hk, sq, skv, d = shape.batch, shape.heads, shape.kv_heads, shape.queries, shape.keys, shape.dim

    def scalar(uid: int) -> Any:
        return graph.tensor(uid=uid, dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=dt.FLOAT)

    q = graph.tensor(uid=_Q, dim=(b, h, sq, d), stride=_bhsd_strides(sq, h, d), data_type=fp8)
    k = graph.tensor(uid=_K, dim=(b, hk, skv, d), stride=_bhsd_strides(skv, hk, d), data_type=fp8)
    v = graph.tensor(uid=_V, dim=(b, hk, skv, d), stride=_bhsd_strides(skv, hk, d), data_type=fp8)
    extra: dict[str, Any] = {}
    if shape.masked:  # each row's lengths [B, 1, 1, 1]
        lengths = {name: graph.tensor(uid=uid, dim=(b, 1, 1, 1), stride=(1, 1, 1, 1), data_type=dt.INT32)
                   for name, uid in (("seq_len_q", _SEQ_Q), ("seq_len_kv", _SEQ_KV))}  # fmt: skip
        extra = {"use_padding_mask": True, **lengths}
    o, _stats, _amax_s, amax_o = graph.sdpa_fp8(
        q=q, k=k, v=v, descale_q=scalar(_Q_DESCALE), descale_k=scalar(_K_DESCALE),
        descale_v=scalar(_V_DESCALE), descale_s=scalar(_S_DESCALE), scale_s=scalar(_S_SCALE),
        scale_o=scalar(_O_SCALE), generate_stats=False, attn_scale=shape.scale, use_causal_mask=False,
        **extra,
    )  # fmt: skip
    o.set_uid(_O).set_output(True).set_dim((b, h, sq, d)).set_stride(_bhsd_strides(sq, h, d))
    o.set_data_type(out_type)
    amax_o.set_uid(_O_AMAX).set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1))
    amax_o.set_data_type(dt.FLOAT)
    return graph


def _build(cudnn: Any, shape: _Shape) -> _Plan:
    """The plan of ``shape``: the output in the model's dtype, else in e4m3 (in e4m3 only for a
    caller that takes it so); raises where cuDNN declines both."""
    errors = []
    for fp8_out in (True,) if shape.quantized_out else (False, True):
        try:
            handle = cudnn_graphs.handle(cudnn, shape.device)
            graph = build_graph(cudnn, shape, handle, fp8_out)
            cudnn_graphs.build_plans(cudnn, graph)
            break
        except Exception as error:  # cuDNN declines it (or this backend has no fp8 attention)
            errors.append(f"{'e4m3' if fp8_out else 'wide'} output: {error}")
    else:
        raise RuntimeError("; ".join(errors))
    if fp8_out and not shape.quantized_out:
        log.info("cuDNN fp8 attention for %s writes e4m3 (%s)", shape, errors[0])
    device = torch.device("cuda", shape.device)
    workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device=device)
    fixed = ((_S_SCALE, P_SCALE), (_S_DESCALE, 1.0 / P_SCALE)) + (() if fp8_out else ((_O_SCALE, 1.0),))
    constants = {uid: torch.full((1,), value, dtype=torch.float32, device=device) for uid, value in fixed}
    if shape.masked:  # every query row live
        rows = (shape.batch, 1, 1, 1)
        constants[_SEQ_Q] = torch.full(rows, shape.queries, dtype=torch.int32, device=device)
    return _Plan(graph, workspace, handle, constants, fp8_out)


def _plan(cudnn: Any, shape: _Shape) -> _Plan | None:
    return _plans.get(shape, lambda: _build(cudnn, shape))


def _tune(cudnn: Any, plan: _Plan, pack: dict[int, torch.Tensor], device: torch.device) -> None:
    """Builds cuDNN's first :data:`AUTOTUNE_PLANS` plans of ``plan``'s graph and keeps the fastest on
    ``pack``'s tensors (cuDNN's first stays where none of the others runs)."""
    plan.tuned = True
    if AUTOTUNE_PLANS <= 0:
        return
    try:
        cudnn_graphs.build_first_plans(plan.graph, AUTOTUNE_PLANS)
        index, workspace, ms = cudnn_graphs.fastest_plan(
            cudnn, plan.graph, pack, plan.handle, device, AUTOTUNE_PLANS
        )
    except Exception as error:  # keep cuDNN's first plan
        log.info("fp8 attention plans not timed (%s): cuDNN's first runs", error)
        return
    plan.index, plan.workspace = index, workspace
    log.info("fp8 attention: plan %d of cuDNN's first %d is the fastest (%.3f ms)", index, AUTOTUNE_PLANS, ms)


def _shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_lengths: torch.Tensor | None,
           scale: float | None, quantized_out: bool = False) -> _Shape:  # fmt: skip
    batch, queries, heads, dim = q.shape
    return _Shape(
        batch, heads, k.shape[2], queries, k.shape[1], dim, v.dtype, key_lengths is not None,
        q.device.index or 0, 1.0 / math.sqrt(dim) if scale is None else float(scale), quantized_out,
    )  # fmt: skip


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the tensors are a call cuDNN's fp8 attention can take (before asking it): ``v`` bf16
    or fp16, ``q`` and ``k`` of its dtype or already e4m3."""
    if triton is None or not (q.is_cuda and k.is_cuda and v.is_cuda) or v.dtype not in _CUDNN_DTYPES:
        return False
    if any(t.dtype not in (v.dtype, torch.float8_e4m3fn) for t in (q, k)):
        return False
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        return False
    batch, _, heads, dim = q.shape
    if k.shape[0] != batch or k.shape[3] != dim or heads % k.shape[2] or dim % 16 or dim > MAX_HEAD_DIM:
        return False
    return torch.cuda.get_device_capability(q.device)[0] >= 9 and cudnn_graphs.frontend() is not None


def applies(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_lengths: torch.Tensor | None = None,
    scale: float | None = None, quantized_out: bool = False,
) -> bool:  # fmt: skip
    """Whether :func:`fp8_attention` runs this call: :func:`supported`, and cuDNN builds its graph
    (built here the first time a shape comes)."""
    if not supported(q, k, v):
        return False
    return _plan(cudnn_graphs.frontend(), _shape(q, k, v, key_lengths, scale, quantized_out)) is not None


def _e4m3(x: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dtype != torch.float8_e4m3fn:
        return quantize_tensor(x)
    if scale is None:
        raise ValueError("e4m3 queries or keys come with their scale")
    return x, scale


def fp8_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_lengths: torch.Tensor | None = None,
    scale: float | None = None, *, q_scale: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
    quantized_out: bool = False, v_peak: torch.Tensor | None = None,
) -> torch.Tensor | QuantizedRows:  # fmt: skip
    """Attention of ``q`` [B, S_q, H, D] over ``k``, ``v`` [B, S_kv, H_kv, D] (bf16 or fp16; ``v``
    may be a view of a packed QKV) with all three in e4m3 and e4m3 probabilities; ``key_lengths``
    [B]: each row's live keys (a prefix). ``q`` and ``k`` may come quantized already (e4m3, with
    ``q_scale`` and ``k_scale``, [1] fp32: ``qk_norm_rope(..., out_scales=)`` writes them so).
    Returns [B, S_q, H, D] in ``v``'s dtype; or with ``quantized_out``, as cuDNN wrote it in e4m3 at
    V's scale: :class:`~omnirt.kernels.w8a8.QuantizedRows` of the [B, S_q, H * D] output (each
    token's scale that one), which an fp8 W8A8 product takes as its input without a quantization
    pass. ``v_peak`` (fp32 [1]): ``v``'s largest magnitude where the caller has it (the merged QKV
    product's epilogue), so V's quantization is one pass. Only where :func:`applies`; raises
    otherwise."""
    cudnn = cudnn_graphs.frontend()
    plan = _plan(cudnn, _shape(q, k, v, key_lengths, scale, quantized_out)) if supported(q, k, v) else None
    if plan is None:
        raise RuntimeError("fp8 attention does not apply to these tensors (see fp8_attention.applies)")
    (q8, qs), (k8, ks), (v8, vs) = _e4m3(q, q_scale), _e4m3(k, k_scale), quantize_tensor(v, v_peak)
    out = torch.empty(q.shape, dtype=torch.float8_e4m3fn if plan.fp8_out else v.dtype, device=q.device)
    pack = {
        _Q: q8, _K: k8, _V: v8, _O: out, _Q_DESCALE: qs, _K_DESCALE: ks, _V_DESCALE: vs,
        _O_AMAX: torch.empty(1, dtype=torch.float32, device=q.device), **plan.constants,
    }  # fmt: skip
    if plan.fp8_out:  # each output row is an average of V's rows: at most V's peak, 448 in V's units
        pack[_O_SCALE] = vs.reciprocal()
    if key_lengths is not None:
        pack[_SEQ_KV] = key_lengths.to(device=q.device, dtype=torch.int32).view(-1, 1, 1, 1)
    if not plan.tuned and not torch.cuda.is_current_stream_capturing():
        _tune(cudnn, plan, pack, q.device)
    cudnn.set_stream(plan.handle, torch.cuda.current_stream(q.device).cuda_stream)
    plan.execute(pack)
    if quantized_out:
        return _as_rows(out, vs, v.dtype)
    return (out.float() * vs).to(v.dtype) if plan.fp8_out else out
