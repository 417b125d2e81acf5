"""Convolutions with their bias and residual adds in cuDNN's epilogue, for the Wan VAE decoder's
``fast`` level (``stages/diffusion/wan_vae_fast.py``, ``FUSED_EPILOGUE``).

Why: ATen runs a convolution's bias as a pass of its own after cuDNN's kernel, and a residual
block's ``x + shortcut`` is another; the ``exact`` level does both in one Triton pass
(``conv_input.add_bias_residual_``), about 7% of its decode on the H200 (``docs/benchmarks.md``).
A cuDNN frontend graph of the convolution followed by the bias and the adds runs them in the
convolution kernel's epilogue, on the fp32 accumulator, so that pass goes. Measured on an H100
(2026-12-06): the ``fast`` decode 1.3-2.0% faster with it (480p and 720p, 81 frames, bf16), its
PSNR against diffusers 46.1 dB against 55.2 (every convolution's roundings change, not only the
96-channel ones'), so it is off by default.

Numerics: the product is accumulated in fp32 as cuDNN's plain convolution does; the bias and then
each addend are added to it in fp32, and the sum is rounded once to the frames' dtype, where the
``exact`` chain rounds the product, then the sum with the bias, then that with the residual. So it
is not bitwise (a ``fast``-level change, and a more precise one); :func:`conv_epilogue_reference`
models it in fp32 for the tests.

:func:`conv_epilogue` (or :func:`try_conv_epilogue`, None where it does not apply) runs where
:func:`applies` says: CUDA, ``cudnn`` (the ``cudnn`` extra) importable, bf16 or fp16 frames, weight
and addends, channels-last 2D or 3D convolutions of stride 1 and no dilation. cuDNN's fused
epilogues decline addends of other layouts (an upsampler's frames-first output, say), so those are
not offered; a graph that cuDNN declines otherwise is remembered, and :func:`applies` then says no
for its shapes: the caller runs its plain convolution. Graphs are built once per shape and kept
(:data:`MAX_PLANS`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from . import cudnn_graphs

#: Built cuDNN graphs kept (least recently used dropped past it).
MAX_PLANS = 64
#: How many of cuDNN's plans for a new shape are timed on its first call's tensors, the fastest
#: kept (0: cuDNN's first, untimed; so also while a CUDA graph is being captured). cuDNN's first
#: plan is not its fastest at every decoder shape (``benchmarks/quant_vae.py --conv-cudnn`` times
#: the first six).
AUTOTUNE_PLANS = 6

_CUDNN_DTYPES = {torch.bfloat16: "BFLOAT16", torch.float16: "HALF"}
# uids of the graph's tensors (above those the front end gives its virtual tensors)
_X, _W, _B, _Y = 100, 101, 102, 103
_ADDEND = 110  # the addends: 110, 111, ...


def _check(x: torch.Tensor, weight: torch.Tensor, padding: tuple[int, ...]) -> None:
    spatial = x.dim() - 2
    if x.dim() not in (4, 5) or weight.dim() != x.dim():
        raise ValueError(f"a 2D or 3D convolution: frames {tuple(x.shape)}, weight {tuple(weight.shape)}")
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"a weight of {weight.shape[1]} input channels for frames of {x.shape[1]}")
    if len(padding) != spatial:
        raise ValueError(f"padding {padding} for a {spatial}D convolution")


def _out_dims(x: tuple[int, ...], weight: tuple[int, ...], padding: tuple[int, ...]) -> tuple[int, ...]:
    spatial = zip(x[2:], padding, weight[2:], strict=True)
    return (x[0], weight[0], *(n + 2 * p - k + 1 for n, p, k in spatial))


def out_shape(x: torch.Tensor, weight: torch.Tensor, padding: tuple[int, ...]) -> tuple[int, ...]:
    """The output's shape of a convolution of stride 1 over ``x`` padded by ``padding``."""
    return _out_dims(tuple(x.shape), tuple(weight.shape), tuple(padding))


def conv_epilogue_reference(
    x: torch.Tensor, weight: torch.Tensor, padding: tuple[int, ...], *, bias: torch.Tensor | None = None,
    addends: tuple[torch.Tensor, ...] = (),
) -> torch.Tensor:  # fmt: skip
    """What :func:`conv_epilogue` computes, in fp32: the convolution, plus ``bias`` [C'], plus each
    addend (the output's shape), rounded once to ``x``'s dtype."""
    _check(x, weight, padding)
    conv = F.conv3d if x.dim() == 5 else F.conv2d
    y = conv(x.float(), weight.float(), None if bias is None else bias.float(), padding=padding)
    for addend in addends:
        y = y + addend.float()
    return y.to(x.dtype)


# --- cuDNN --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Shape:
    x: tuple[int, ...]
    x_strides: tuple[int, ...]
    weight: tuple[int, ...]
    weight_strides: tuple[int, ...]
    padding: tuple[int, ...]
    bias: bool
    addend_strides: tuple[tuple[int, ...], ...]
    out_strides: tuple[int, ...]
    dtype: torch.dtype
    device: int
    aten_bits: bool = False  # only plans that give ATen's bits, and only where faster than ATen


@dataclass
class _Plan:
    graph: Any
    workspace: torch.Tensor
    handle: Any
    index: int | None = None  # the plan chosen by timing, or None: cuDNN's first

    def execute(self, pack: dict[int, torch.Tensor]) -> None:
        if self.index is None:
            self.graph.execute(pack, self.workspace, handle=self.handle)
        else:
            self.graph.execute_plan_at_index(pack, self.workspace, self.index, handle=self.handle)


_plans: cudnn_graphs.PlanCache[_Plan] = cudnn_graphs.PlanCache(MAX_PLANS, "a convolution graph")


def build_graph(cudnn: Any, shape: _Shape, handle: Any = None) -> Any:
    """The cuDNN graph of one shape, before validation (which needs libcudnn): the convolution
    (fp32 accumulation), the bias as a [1, C', 1, ...] tensor, each addend, the output in the
    frames' dtype and strides."""
    dt = cudnn.data_type
    io = getattr(dt, _CUDNN_DTYPES[shape.dtype])
    context = {"handle": handle} if handle is not None else {}
    graph = cudnn.pygraph(
        io_data_type=io, intermediate_data_type=dt.FLOAT, compute_data_type=dt.FLOAT, **context
    )
    spatial = len(shape.padding)
    x = graph.tensor(uid=_X, dim=list(shape.x), stride=list(shape.x_strides), data_type=io)
    w = graph.tensor(uid=_W, dim=list(shape.weight), stride=list(shape.weight_strides), data_type=io)
    ones = [1] * spatial
    y = graph.conv_fprop(image=x, weight=w, padding=list(shape.padding), stride=ones, dilation=ones)
    out = list(_out_dims(shape.x, shape.weight, shape.padding))
    if shape.bias:
        c = shape.weight[0]
        b = graph.tensor(uid=_B, dim=[1, c, *ones], stride=[c, 1, *ones], data_type=io)
        y = graph.bias(input=y, bias=b)
    for i, strides in enumerate(shape.addend_strides):
        r = graph.tensor(uid=_ADDEND + i, dim=out, stride=list(strides), data_type=io)
        y = graph.add(a=y, b=r)
    y.set_uid(_Y).set_output(True).set_data_type(io).set_dim(out).set_stride(list(shape.out_strides))
    return graph


def _build(cudnn: Any, shape: _Shape, pack: Callable[[], dict[int, torch.Tensor]]) -> _Plan:
    """The graph of ``shape`` built to plans; with :data:`AUTOTUNE_PLANS` (and no CUDA graph being
    captured), the fastest of the first ones on ``pack()``'s tensors, else cuDNN's first. A shape
    of ``aten_bits``: only plans whose output equals ATen's convolution bitwise on those tensors,
    and the fastest of them only if it beats ATen's time (else this raises: the shape is declined)."""
    handle = cudnn_graphs.handle(cudnn, shape.device)
    graph = build_graph(cudnn, shape, handle)
    device = torch.device("cuda", shape.device)
    if AUTOTUNE_PLANS > 0 and not torch.cuda.is_current_stream_capturing():
        cudnn_graphs.build_plans(cudnn, graph, first=AUTOTUNE_PLANS)
        tensors = pack()
        accept = aten = None
        if shape.aten_bits:
            x, weight, out = tensors[_X], tensors[_W], tensors[_Y]
            conv = F.conv3d if x.dim() == 5 else F.conv2d
            run_aten = lambda: conv(x, weight, padding=shape.padding)  # noqa: E731
            want = run_aten()
            aten = cudnn_graphs.time_ms(run_aten, 3)
            accept = lambda: torch.equal(out, want)  # noqa: E731
        index, workspace, ms = cudnn_graphs.fastest_plan(
            cudnn, graph, tensors, handle, device, AUTOTUNE_PLANS, accept=accept
        )
        if aten is not None and ms >= aten:
            raise RuntimeError(f"ATen's convolution is as fast ({aten:.3f} ms against {ms:.3f})")
        return _Plan(graph, workspace, handle, index)
    if shape.aten_bits:
        raise RuntimeError("ATen's bits are checked on timed plans only (AUTOTUNE_PLANS > 0)")
    cudnn_graphs.build_plans(cudnn, graph)
    workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device=device)
    return _Plan(graph, workspace, handle)


def _pack(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, addends: tuple[torch.Tensor, ...],
    out: torch.Tensor,
) -> dict[int, torch.Tensor]:  # fmt: skip
    pack: dict[int, torch.Tensor] = {_X: x, _W: weight, _Y: out}
    if bias is not None:
        pack[_B] = bias.to(x.dtype).contiguous()
    for i, addend in enumerate(addends):
        pack[_ADDEND + i] = addend
    return pack


def _empty_out(x: torch.Tensor, weight: torch.Tensor, padding: tuple[int, ...]) -> torch.Tensor:
    shape = out_shape(x, weight, padding)
    return torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=_format(x))


def _format(x: torch.Tensor) -> torch.memory_format:
    return torch.channels_last_3d if x.dim() == 5 else torch.channels_last


def _channels_last_strides(dims: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a dense channels-last tensor of ``dims`` [N, C, *spatial]: channels
    innermost, then the spatial dims from the last, then the batch."""
    strides = [0] * len(dims)
    step = strides[1] = 1
    step *= dims[1]
    for d in range(len(dims) - 1, 1, -1):
        strides[d] = step
        step *= dims[d]
    strides[0] = step
    return tuple(strides)


def _shape(
    x: torch.Tensor, weight: torch.Tensor, padding: tuple[int, ...], bias: torch.Tensor | None,
    addends: tuple[torch.Tensor, ...], aten_bits: bool = False,
) -> _Shape:  # fmt: skip
    return _Shape(
        tuple(x.shape), tuple(x.stride()), tuple(weight.shape), tuple(weight.stride()), tuple(padding),
        bias is not None, tuple(tuple(a.stride()) for a in addends),
        _channels_last_strides(out_shape(x, weight, padding)), x.dtype,
        x.device.index if x.device.index is not None else torch.cuda.current_device(), aten_bits,
    )  # fmt: skip


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the frames and weight are of a kind the graphs take (before asking cuDNN)."""
    fmt = _format(x) if x.dim() in (4, 5) else None
    return (
        fmt is not None
        and x.is_cuda
        and x.dtype in _CUDNN_DTYPES
        and weight.dtype == x.dtype
        and weight.dim() == x.dim()
        and x.is_contiguous(memory_format=fmt)
        and weight.is_contiguous(memory_format=fmt)
        and torch.cuda.get_device_capability(x.device) >= (8, 0)
        and cudnn_graphs.frontend() is not None
    )


def _addends_fit(
    x: torch.Tensor, weight: torch.Tensor, padding: tuple[int, ...], addends: tuple[torch.Tensor, ...]
) -> bool:
    """Addends of the output's shape, dtype and (dense) channels-last layout: cuDNN's fused
    epilogues decline other strides (``NOT_SUPPORTED_LAYOUT``: not ``NSpatialC`` fully packed;
    measured on the H100, e.g. an upsampler's frames-first view)."""
    shape = out_shape(x, weight, padding)
    fmt = _format(x)
    fit = (a.shape == shape and a.dtype == x.dtype and a.is_contiguous(memory_format=fmt) for a in addends)
    return all(fit)


def _find_plan(
    x: torch.Tensor, weight: torch.Tensor, padding: tuple[int, ...], bias: torch.Tensor | None,
    addends: tuple[torch.Tensor, ...],
) -> _Plan | None:  # fmt: skip
    """The plan for these tensors (built if new), or None where the graphs do not take them or
    cuDNN declined their shape."""
    _check(x, weight, padding)
    if not (supported(x, weight) and _addends_fit(x, weight, padding, addends)):
        return None
    cudnn, shape = cudnn_graphs.frontend(), _shape(x, weight, padding, bias, addends)
    scratch = lambda: _pack(x, weight, bias, addends, _empty_out(x, weight, padding))  # noqa: E731
    return _plans.get(shape, lambda: _build(cudnn, shape, scratch))


def applies(
    x: torch.Tensor, weight: torch.Tensor, padding: tuple[int, ...], *, bias: torch.Tensor | None = None,
    addends: tuple[torch.Tensor, ...] = (),
) -> bool:  # fmt: skip
    """Whether :func:`conv_epilogue` runs these tensors (building their graph if it is new)."""
    return _find_plan(x, weight, padding, bias, addends) is not None


def try_conv_epilogue(
    x: torch.Tensor, weight: torch.Tensor, padding: tuple[int, ...], *, bias: torch.Tensor | None = None,
    addends: tuple[torch.Tensor, ...] = (),
) -> torch.Tensor | None:  # fmt: skip
    """:func:`conv_epilogue`'s result, or None where it does not apply (the caller then runs its
    plain convolution): one check, one plan lookup."""
    plan = _find_plan(x, weight, padding, bias, addends)
    return None if plan is None else _run(plan, x, weight, padding, bias, addends)


def conv_graph(x: torch.Tensor, weight: torch.Tensor, padding: tuple[int, ...]) -> torch.Tensor | None:
    """ATen's convolution of ``x`` by ``weight`` (no bias; channels-last, as
    :func:`conv_epilogue` takes them) as a cuDNN graph, bitwise: where, on a shape's first call, one
    of cuDNN's first :data:`AUTOTUNE_PLANS` plans gives ATen's bits on its tensors and runs faster
    than ATen's convolution, that plan (the fastest such); None elsewhere, and for a new shape
    while a CUDA graph is being captured (the caller runs ATen's convolution)."""
    _check(x, weight, padding)
    if AUTOTUNE_PLANS <= 0 or not supported(x, weight):
        return None
    shape = _shape(x, weight, padding, None, (), aten_bits=True)
    if torch.cuda.is_current_stream_capturing():
        try:
            plan = _plans[shape]
        except KeyError:  # not timed yet: not now
            return None
    else:
        cudnn = cudnn_graphs.frontend()
        scratch = lambda: _pack(x, weight, None, (), _empty_out(x, weight, padding))  # noqa: E731
        plan = _plans.get(shape, lambda: _build(cudnn, shape, scratch))
    return None if plan is None else _run(plan, x, weight, padding, None, ())


def _run(
    plan: _Plan, x: torch.Tensor, weight: torch.Tensor, padding: tuple[int, ...], bias: torch.Tensor | None,
    addends: tuple[torch.Tensor, ...],
) -> torch.Tensor:  # fmt: skip
    """``plan`` on these tensors, on the current stream, into a new channels-last output."""
    out = _empty_out(x, weight, padding)
    cudnn_graphs.frontend().set_stream(plan.handle, torch.cuda.current_stream(x.device).cuda_stream)
    plan.execute(_pack(x, weight, bias, addends, out))
    return out


def conv_epilogue(
    x: torch.Tensor, weight: torch.Tensor, padding: tuple[int, ...], *, bias: torch.Tensor | None = None,
    addends: tuple[torch.Tensor, ...] = (),
) -> torch.Tensor:  # fmt: skip
    """The convolution of channels-last ``x`` [N, C, (T,) H, W] by ``weight`` [C', C, (kt,) kh, kw]
    (channels-last too), stride 1, ``padding`` zeros each side per spatial dim, plus ``bias`` [C']
    and each of ``addends`` (the output's shape, channels-last) in the convolution's epilogue, rounded
    once; the output channels-last. Only where :func:`applies`; raises otherwise."""
    out = try_conv_epilogue(x, weight, padding, bias=bias, addends=addends)
    if out is None:
        raise RuntimeError("the fused convolution does not apply to these tensors (see cudnn_conv.applies)")
    return out
