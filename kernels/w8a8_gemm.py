"""The W8A8 product as one Triton GEMM: 8-bit activations [M, K] (one fp32 scale a row) times 8-bit
weights [N, K] (one fp32 scale an output channel), the scales and the bias applied in the
epilogue, the output written once in the activations' dtype.

Why: ``kernels/w8a8.py``'s int8 path is ``torch._int_mm`` (an int32 [M, N] written to memory) and
then an epilogue kernel that reads it back, which at a Z-Image step's shapes moves about 40 GB
a step; here the int32 accumulators never leave the registers. For fp8 it is an alternative to
``torch._scaled_mm``'s row-wise kernel, to be chosen where it measures faster
(``benchmarks/w8a8_gemm.py``; ``kernels/w8a8.py``'s ``GEMM`` selects it, ``library`` by default).

Numerics. int8: the products and sums are exact in int32 whatever the order, and the epilogue is
:func:`~omnirt.kernels.w8a8.int8_epilogue_triton`'s (``acc * x_scale``, then ``* weight_scale``,
then ``+ bias``, in fp32, no fused multiply-adds, one rounding), so the output is bitwise equal to
the two-kernel path. fp8: the tensor cores' sums in fp32 in their own order, then the same
epilogue: equal to ``torch._scaled_mm`` up to fp32 rounding of the sums.

Two forms: a program a tile, reading the operands by pointers (software-pipelined over
``stages``), or (``Config.tma``) a persistent kernel, one program a multiprocessor walking the
tiles, reading them by tensor descriptors (Hopper's TMA; zeros past the edges). Tiles:
:data:`CONFIGS` names the candidates; :func:`config_for` picks the one :data:`TUNED` holds for a
shape (from the probe's measurements; none yet), else :data:`DEFAULT` (the persistent TMA form).
No autotuning at call time: a first call under CUDA-graph capture must not time anything.

``gated``: a merged gate and up weight (rows ``[gate | up]``, Z-Image's ``w13``) whose product's
gated unit ``silu(gate) * up`` is the epilogue: each tile reads ``bn`` rows of each half against one
tile of activations and writes ``bn`` columns of the gated output, the bits of the product followed
by ``kernels/swiglu.py``'s gated kernel (``kernels/silu.py``'s ``gated_values``), with the [M, N]
product never in memory.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .w8a8 import Kind

from .settings import interpreted
from .silu import silu_table

try:  # Triton ships with CUDA builds of torch only
    import triton
    import triton.language as tl

    from .silu import gated_values
except ImportError:  # pragma: no cover - depends on the install
    triton = None


@dataclass(frozen=True)
class Config:
    """A launch's tiling: ``bm`` x ``bn`` output tiles, ``bk`` deep steps, tiles grouped ``group_m``
    rows of tiles at a time (for L2 reuse), with ``warps`` and ``stages`` of software pipelining."""

    bm: int
    bn: int
    bk: int
    group_m: int = 8
    warps: int = 8
    stages: int = 3
    #: The operands read by tensor-memory-accelerator descriptors (Hopper's TMA) in a persistent
    #: kernel, one program a multiprocessor walking the tiles; else by pointers, a program a tile.
    tma: bool = False
    #: TMA form: the tile loop flattened with the K loop (``tl.range(flatten=True)``), so that the
    #: software pipeline runs on into the next tile's first loads during this tile's epilogue.
    flatten: bool = False
    #: TMA form: the output tile written through a descriptor (a TMA store), not by pointers.
    store_tma: bool = False

    def __post_init__(self) -> None:
        if self.bk % 32 or self.bm % 16 or self.bn % 16:  # Hopper's 8-bit products take K in 32s
            raise ValueError(f"tiles want bk a multiple of 32 and bm, bn of 16, not {self.name()}")

    def name(self) -> str:
        form = "".join(f" {name}" for name, on in (("tma", self.tma), ("flat", self.flatten),
                                                   ("tstore", self.store_tma)) if on)  # fmt: skip
        return f"{self.bm}x{self.bn}x{self.bk} w{self.warps} s{self.stages} g{self.group_m}{form}"


CONFIGS: tuple[Config, ...] = (
    Config(128, 256, 128, warps=8, stages=3),
    Config(128, 256, 64, warps=8, stages=4),
    Config(256, 128, 128, warps=8, stages=3),
    Config(128, 128, 128, warps=8, stages=4),
    Config(128, 128, 128, warps=4, stages=4),
    Config(64, 256, 128, warps=4, stages=4),
    Config(128, 64, 128, warps=4, stages=4),
    Config(64, 128, 128, warps=4, stages=4),
    Config(128, 256, 128, warps=8, stages=3, tma=True),
    Config(128, 256, 64, warps=8, stages=4, tma=True),
    Config(128, 128, 128, warps=8, stages=4, tma=True),
    Config(128, 128, 128, warps=4, stages=4, tma=True),
    Config(128, 256, 128, warps=8, stages=3, tma=True, flatten=True),
    Config(128, 256, 128, warps=8, stages=3, tma=True, store_tma=True),
    Config(128, 256, 128, warps=8, stages=3, tma=True, flatten=True, store_tma=True),
)
#: The fastest tiles at nearly every product shape of Z-Image and Wan on an H100, both kinds
#: (``benchmarks/w8a8_gemm.py``, docs/benchmarks.md); by pointers where TMA is not there.
DEFAULT = CONFIGS[8]
SMALL_M = Config(64, 128, 128, warps=4, stages=4)
#: Measured best tiles by (kind, N, K), for M in the thousands (a DiT step's tokens).
TUNED: dict[tuple[str, int, int], Config] = {}


def config_for(kind: Kind, m: int, n: int, k: int, gated: bool = False) -> Config:
    """The tiles for an ``m`` x ``n`` x ``k`` product: the tuned ones for large ``m``, smaller
    tiles for few rows (a batch of timesteps, a short caption). ``gated`` (``n`` the weight's rows,
    gate and up): the same tiles' worth of weight rows, half of them each half's."""
    cfg = SMALL_M if m <= 64 else TUNED.get((kind, n, k), DEFAULT)
    return dataclasses.replace(cfg, bn=cfg.bn // 2) if gated else cfg


if triton is not None:

    @triton.jit
    def _tile(tile, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
        """The (row, column) of output tile ``tile``, ``GROUP_M`` rows of tiles at a time."""
        tiles_m = tl.cdiv(M, BM)
        in_group = GROUP_M * tl.cdiv(N, BN)
        first_m = (tile // in_group) * GROUP_M
        group_rows = min(tiles_m - first_m, GROUP_M)
        return first_m + (tile % in_group) % group_rows, (tile % in_group) // group_rows

    @triton.jit
    def _scaled(acc, rows, cols, XS, WS, BIAS, M, N, HAS_BIAS: tl.constexpr):
        """``acc * x_scale``, then ``* weight_scale``, then ``+ bias``, in fp32."""
        out = acc.to(tl.float32) * tl.load(XS + rows, mask=rows < M, other=0.0)[:, None]
        out = out * tl.load(WS + cols, mask=cols < N, other=0.0)[None, :]
        if HAS_BIAS:
            out = out + tl.load(BIAS + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        return out

    @triton.jit
    def _epilogue(acc, acc_up, rows, cols, XS, WS, BIAS, SILU, M, N, dtype: tl.constexpr,
                  HAS_BIAS: tl.constexpr, GATED: tl.constexpr, TABLE: tl.constexpr,
                  LIBDEVICE: tl.constexpr):  # fmt: skip
        """The tile scaled (:func:`_scaled`) in ``dtype``; ``GATED``: ``acc`` the gate half's columns
        ``cols`` and ``acc_up`` the up half's (``cols + N``), each scaled and rounded to ``dtype`` as
        the product alone would store it, and ``silu(gate) * up`` of them."""
        if GATED:
            gate = _scaled(acc, rows, cols, XS, WS, BIAS, M, N, HAS_BIAS).to(dtype)
            up = _scaled(acc_up, rows, cols + N, XS, WS, BIAS, M, 2 * N, HAS_BIAS).to(dtype).to(tl.float32)
            live = (rows[:, None] < M) & (cols[None, :] < N)
            out = gated_values(gate, up, SILU, live, TABLE, LIBDEVICE)
        else:
            out = _scaled(acc, rows, cols, XS, WS, BIAS, M, N, HAS_BIAS)
        return out.to(dtype)

    @triton.jit
    def _raise_peak(PEAK, out, rows, cols, M, N, PEAK_FROM):
        """``PEAK`` (fp32 [1]) raised to the largest magnitude of the tile's stored values in columns
        ``PEAK_FROM`` on (V's part of a merged QKV product, for its per-tensor scale)."""
        live = (rows[:, None] < M) & (cols[None, :] >= PEAK_FROM) & (cols[None, :] < N)
        tile = tl.where(live, tl.abs(out.to(tl.float32)), 0.0)
        tl.atomic_max(PEAK, tl.max(tl.max(tile, axis=1), axis=0))

    @triton.jit
    def _store(C, out, rows, cols, M, N, stride_cm):
        live = (rows[:, None] < M) & (cols[None, :] < N)
        tl.store(C + rows[:, None] * stride_cm + cols[None, :], out, mask=live)

    @triton.jit
    def _w8a8_gemm_kernel(A, B, XS, WS, BIAS, SILU, C, PEAK, M, N, K, stride_am, stride_bn, stride_cm,
                          PEAK_FROM, HAS_BIAS: tl.constexpr, INT8: tl.constexpr, GATED: tl.constexpr,
                          HAS_PEAK: tl.constexpr,
                          TABLE: tl.constexpr, LIBDEVICE: tl.constexpr, BM: tl.constexpr,
                          BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):  # fmt: skip
        pid_m, pid_n = _tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
        rows = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
        cols = pid_n.to(tl.int64) * BN + tl.arange(0, BN)
        ks = tl.arange(0, BK)
        # rows and columns past the edge read row 0 / column 0 again (their results are not stored)
        a_ptrs = A + tl.where(rows < M, rows, 0)[:, None] * stride_am + ks[None, :]
        b_ptrs = B + tl.where(cols < N, cols, 0)[:, None] * stride_bn + ks[None, :]
        up_ptrs = b_ptrs + N * stride_bn  # GATED: the up half's rows of the weight
        acc = tl.zeros((BM, BN), dtype=tl.int32 if INT8 else tl.float32)
        acc_up = tl.zeros((BM, BN), dtype=tl.int32 if INT8 else tl.float32)
        for k in range(0, tl.cdiv(K, BK)):
            left = K - k * BK
            a = tl.load(a_ptrs, mask=ks[None, :] < left, other=0.0)
            b = tl.load(b_ptrs, mask=ks[None, :] < left, other=0.0)
            acc = tl.dot(a, b.T, acc, out_dtype=tl.int32 if INT8 else tl.float32)
            if GATED:
                b_up = tl.load(up_ptrs, mask=ks[None, :] < left, other=0.0)
                acc_up = tl.dot(a, b_up.T, acc_up, out_dtype=tl.int32 if INT8 else tl.float32)
                up_ptrs += BK
            a_ptrs += BK
            b_ptrs += BK
        out = _epilogue(acc, acc_up, rows, cols, XS, WS, BIAS, SILU, M, N, C.dtype.element_ty, HAS_BIAS,
                        GATED, TABLE, LIBDEVICE)  # fmt: skip
        if HAS_PEAK:
            if pid_n * BN + BN > PEAK_FROM:  # (only tiles that reach those columns)
                _raise_peak(PEAK, out, rows, cols, M, N, PEAK_FROM)
        _store(C, out, rows, cols, M, N, stride_cm)

    @triton.jit
    def _w8a8_gemm_tma_kernel(a_desc, b_desc, c_desc, XS, WS, BIAS, SILU, C, PEAK, M, N, K, stride_cm,
                              PROGRAMS, PEAK_FROM, HAS_BIAS: tl.constexpr, INT8: tl.constexpr,
                              GATED: tl.constexpr, HAS_PEAK: tl.constexpr,
                              TABLE: tl.constexpr, LIBDEVICE: tl.constexpr, FLATTEN: tl.constexpr,
                              STORE_TMA: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                              GROUP_M: tl.constexpr):  # fmt: skip
        tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
        for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=FLATTEN):
            pid_m, pid_n = _tile(tile, M, N, BM, BN, GROUP_M)
            acc = tl.zeros((BM, BN), dtype=tl.int32 if INT8 else tl.float32)
            acc_up = tl.zeros((BM, BN), dtype=tl.int32 if INT8 else tl.float32)
            for k in range(0, tl.cdiv(K, BK)):  # the descriptors read zeros past the edges
                a = a_desc.load([pid_m * BM, k * BK])
                b = b_desc.load([pid_n * BN, k * BK])
                acc = tl.dot(a, b.T, acc, out_dtype=tl.int32 if INT8 else tl.float32)
                if GATED:  # the up half's rows (past the gate half's edge: the up half's first rows,
                    # whose results are not stored)
                    b_up = b_desc.load([N + pid_n * BN, k * BK])
                    acc_up = tl.dot(a, b_up.T, acc_up, out_dtype=tl.int32 if INT8 else tl.float32)
            rows = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
            cols = pid_n.to(tl.int64) * BN + tl.arange(0, BN)
            out = _epilogue(acc, acc_up, rows, cols, XS, WS, BIAS, SILU, M, N, C.dtype.element_ty, HAS_BIAS,
                            GATED, TABLE, LIBDEVICE)  # fmt: skip
            if HAS_PEAK:
                if pid_n * BN + BN > PEAK_FROM:  # (only tiles that reach those columns)
                    _raise_peak(PEAK, out, rows, cols, M, N, PEAK_FROM)
            if STORE_TMA:  # the descriptor writes nothing past the edges
                c_desc.store([pid_m * BM, pid_n * BN], out)
            else:
                _store(C, out, rows, cols, M, N, stride_cm)


def applies(
    xq: torch.Tensor, x_scale: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor
) -> bool:
    """Whether :func:`w8a8_gemm` takes these operands: Triton, one device, [M, K] and [N, K] of
    one 8-bit dtype with unit column strides, K a multiple of 16 (the tensor cores' step), and one
    dense fp32 scale a row and an output channel."""
    if triton is None or xq.dim() != 2 or qweight.dim() != 2 or xq.dtype != qweight.dtype:
        return False
    (m, k), n = xq.shape, qweight.shape[0]
    return (
        xq.dtype in (torch.int8, torch.float8_e4m3fn) and len({xq.device, qweight.device}) == 1
        and qweight.shape[1] == k and k % 16 == 0 and xq.stride(1) == 1 and qweight.stride(1) == 1
        and _dense_scale(x_scale, m) and _dense_scale(weight_scale, n)
    )  # fmt: skip


def _dense_scale(scale: torch.Tensor, count: int) -> bool:
    return scale.numel() == count and scale.dtype == torch.float32 and (count < 2 or scale.stride(0) == 1)


def _tma_fits(t: torch.Tensor) -> bool:
    """Whether a descriptor can read or write ``t`` [rows, cols]: its base and row stride 16-byte aligned."""
    return t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


@functools.cache
def tma_capable(device: torch.device) -> bool:
    """Whether ``device`` reads by tensor descriptors: Hopper (sm_90) on; the interpreter too."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (9, 0)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs walk the tiles
    return torch.cuda.get_device_properties(device).multi_processor_count


def w8a8_gemm(
    xq: torch.Tensor, x_scale: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor,
    bias: torch.Tensor | None, dtype: torch.dtype, config: Config | None = None, gated: bool = False,
    peak: torch.Tensor | None = None, peak_from: int = 0,
) -> torch.Tensor:  # fmt: skip
    """``(xq @ qweight.T) * x_scale * weight_scale.T + bias`` as ``dtype`` [M, N], in one kernel:
    ``xq`` [M, K] and ``qweight`` [N, K] both int8 or both e4m3, ``x_scale`` [M, 1] and
    ``weight_scale`` [N, 1] fp32. int8 is bitwise ``torch._int_mm`` followed by
    :func:`~omnirt.kernels.w8a8.int8_epilogue_triton`.

    ``gated``: ``qweight`` a merged gate and up layer (rows ``[gate | up]``, N even); returns the
    gated unit ``silu(gate) * up`` [M, N / 2] of the product, computed in the epilogue from the
    product's values rounded to ``dtype`` (:func:`~omnirt.kernels.silu.gated_values`): the bits of
    this product followed by :func:`~omnirt.kernels.swiglu.swiglu` of its halves, without the
    [M, N] product in memory. A ``config``'s ``bn`` is then each half's columns a tile.

    ``peak`` (fp32 [1] on the operands' device): raised, by atomic maximum in the epilogue, to the
    largest magnitude of the output's columns ``peak_from`` on as stored (V's part of a merged QKV
    product: its per-tensor scale without a pass of its own over V)."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    if not applies(xq, x_scale, qweight, weight_scale):
        raise ValueError(
            "w8a8_gemm wants [M, K] and [N, K] operands of one 8-bit dtype with unit column strides, K a"
            f" multiple of 16 and one dense fp32 scale a row and an output channel, not {tuple(xq.shape)}"
            f" {xq.dtype}, {tuple(qweight.shape)} {qweight.dtype}, scales {tuple(x_scale.shape)}"
            f" {x_scale.dtype} and {tuple(weight_scale.shape)} {weight_scale.dtype}"
        )
    if gated and qweight.shape[0] % 2:
        raise ValueError(f"a gated product wants gate and up rows, an even count, not {qweight.shape[0]}")
    if peak is not None and (peak.shape != (1,) or peak.dtype != torch.float32 or peak.device != xq.device):
        raise ValueError(f"peak must be fp32 [1] on {xq.device}, not {peak.dtype} {tuple(peak.shape)}")
    m, k = xq.shape
    n = qweight.shape[0] // 2 if gated else qweight.shape[0]  # the output's columns
    kind: Kind = "int8" if xq.dtype == torch.int8 else "fp8"
    out = torch.empty(m, n, dtype=dtype, device=xq.device)
    if m == 0 or n == 0:
        return out
    cfg = config or config_for(kind, m, qweight.shape[0], k, gated)
    tiles = triton.cdiv(m, cfg.bm) * triton.cdiv(n, cfg.bn)
    table = gated and dtype == torch.bfloat16
    common = dict(
        HAS_BIAS=bias is not None, INT8=kind == "int8", GATED=gated, HAS_PEAK=peak is not None, TABLE=table,
        LIBDEVICE=not interpreted(),
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m, num_warps=cfg.warps, num_stages=cfg.stages,
        enable_fp_fusion=False,
    )  # fmt: skip
    bias_arg = bias if bias is not None else weight_scale
    silu = silu_table(xq.device) if table else weight_scale  # a stand-in never read without TABLE
    peak_arg = peak if peak is not None else weight_scale  # (likewise without HAS_PEAK)
    if cfg.tma and _tma_fits(xq) and _tma_fits(qweight) and tma_capable(xq.device):  # else by pointers
        from triton.tools.tensor_descriptor import TensorDescriptor

        programs = min(tiles, _multiprocessors(xq.device))
        a_desc = TensorDescriptor.from_tensor(xq, [cfg.bm, cfg.bk])
        b_desc = TensorDescriptor.from_tensor(qweight, [cfg.bn, cfg.bk])
        store_tma = cfg.store_tma and _tma_fits(out)
        c_desc = TensorDescriptor.from_tensor(out, [cfg.bm, cfg.bn]) if store_tma else None
        _w8a8_gemm_tma_kernel[(programs,)](
            a_desc, b_desc, c_desc, x_scale, weight_scale, bias_arg, silu, out, peak_arg, m, n, k,
            out.stride(0), programs, peak_from, FLATTEN=cfg.flatten, STORE_TMA=store_tma, **common,
        )  # fmt: skip
    else:
        _w8a8_gemm_kernel[(tiles,)](
            xq, qweight, x_scale, weight_scale, bias_arg, silu, out, peak_arg, m, n, k, xq.stride(0),
            qweight.stride(0), out.stride(0), peak_from, **common,
        )  # fmt: skip
    return out
