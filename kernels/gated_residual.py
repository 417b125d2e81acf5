"""A DiT block's gated residual add in one launch: ``(x.float() + y.float() * gate).type_as(x)``.

Wan's transformer block (diffusers' ``WanTransformerBlock``) ends its self-attention and its
feed-forward this way, the gate a per-sample ``[B, 1, C]`` (or per-token ``[B, S, C]``) fp32
vector. Eagerly that is four passes over the tokens (``x.float()``, the product, the sum, the cast
back), three of them at fp32 width: at Wan 1.3B 480p (32,760 x 1536) about 1.7 GB of traffic a
site, against 0.3 GB for :func:`gated_residual`'s one pass (reads ``x`` and ``y``, writes the
sum).

**Bits.** The product and the sum are fp32 operations, each rounded as ATen rounds it (no fused
multiply-add: the kernel is compiled without contraction), and the sum is rounded to ``x``'s dtype
once, as ``type_as`` rounds it: bitwise the eager chain on CUDA, in every dtype (the GPU tests
check it), and on the CPU under ``TRITON_INTERPRET=1`` (fp32).

:func:`gated_residual` dispatches: the kernel for CUDA tensors with Triton where
:data:`~.settings.FUSED` is not ``off`` and the inputs are rows of a contiguous last dim, else the
eager chain.
"""

from __future__ import annotations

import torch

from . import settings

try:  # Triton ships with CUDA builds of torch only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def gated_residual_reference(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The eager chain (diffusers' ``WanTransformerBlock``: ``hidden_states.float() + out * gate``,
    then ``type_as``)."""
    return (x.float() + y.float() * gate).type_as(x)


if triton is not None:

    @triton.jit
    def _gated_residual_kernel(
        X, Y, G, OUT, cols, seq, sx, sy, sgb, sgs, so, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """Row ``r`` (sample ``r // seq``, token ``r % seq``): ``x + y * g`` in fp32, rounded to
        ``OUT``'s dtype; ``BLOCK`` columns a program."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = offs < cols
        g_row = G + (row // seq) * sgb + (row % seq) * sgs
        x = tl.load(X + row * sx + offs, mask=live, other=0.0).to(tl.float32)
        y = tl.load(Y + row * sy + offs, mask=live, other=0.0).to(tl.float32)
        g = tl.load(g_row + offs, mask=live, other=0.0)
        tl.store(OUT + row * so + offs, (x + y * g).to(OUT.dtype.element_ty), mask=live)


def _check(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> str | None:
    """Why the kernel cannot take the inputs, or None."""
    if x.dim() != 3 or y.shape != x.shape:
        return f"x and y must be one [B, S, C] shape: {list(x.shape)}, {list(y.shape)}"
    b, s, c = x.shape
    if gate.dim() != 3 or gate.shape[0] != b or gate.shape[1] not in (1, s) or gate.shape[2] != c:
        return f"the gate must be [B, 1, C] or [B, S, C] for {list(x.shape)}: {list(gate.shape)}"
    if gate.dtype != torch.float32:
        return f"the gate must be float32, not {gate.dtype}"
    floats = (torch.float32, torch.float16, torch.bfloat16)
    if x.dtype not in floats or y.dtype not in (x.dtype, torch.float32):
        return f"unsupported dtypes {x.dtype}, {y.dtype}"
    if x.stride(-1) != 1 or y.stride(-1) != 1 or gate.stride(-1) != 1:
        return "x, y and the gate must have a contiguous last dim"
    try:  # rows of a uniform stride: a view of [rows, C]
        x.view(-1, c), y.view(-1, c)
    except RuntimeError:
        return "x and y must be rows of one stride (a view of [rows, C])"
    return None


def _launch(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    b, s, c = x.shape
    x2, y2 = x.view(-1, c), y.view(-1, c)
    out = torch.empty(b, s, c, dtype=x.dtype, device=x.device)
    if out.numel():
        block = min(triton.next_power_of_2(c), 2048)
        _gated_residual_kernel[(b * s, triton.cdiv(c, block))](
            x2, y2, gate, out, c, s, x2.stride(0), y2.stride(0), gate.stride(0),
            gate.stride(1) if gate.shape[1] > 1 else 0, c, BLOCK=block,
            num_warps=max(1, min(8, block // 256)), enable_fp_fusion=False,
        )  # fmt: skip
    return out


def gated_residual_triton(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The kernel itself (any device Triton runs on); ValueError for inputs it does not take."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    reason = _check(x, y, gate)
    if reason:
        raise ValueError(reason)
    return _launch(x, y, gate)


@torch.library.custom_op("omnirt::gated_residual", mutates_args=())
def _gated_residual_op(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return _launch(x, y, gate)


@_gated_residual_op.register_fake
def _gated_residual_fake(x, y, gate):
    return x.new_empty(x.shape)


def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``(x.float() + y.float() * gate).type_as(x)``: the kernel where it applies (through the custom
    op ``omnirt::gated_residual`` while ``torch.compile`` traces), else the eager chain; the same
    bits."""
    if settings.kernel_device(x, y, gate) and _check(x, y, gate) is None and settings.wanted(True):
        return settings.dispatch(torch.ops.omnirt.gated_residual, _launch, x, y, gate)
    return gated_residual_reference(x, y, gate)
