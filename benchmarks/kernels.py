"""Fused DiT kernels (``kernels/qk_norm_rope.py``, ``kernels/adaln.py``) against eager and
``torch.compile`` of the same chains, at real DiT shapes, on a CUDA GPU.

Three tables (markdown), each measured in this run:

1. **numerics**: elements of the fused ``exact`` and ``fast`` outputs that differ from eager's
   (bf16), per chain and shape; with ``--variants`` every FMA variant of the ``exact`` kernels
   (how nvcc contracted ATen's code, which decides the last bits), so the constants in the kernel
   modules can be read off it.
2. **speed**: time per call of eager, ``torch.compile`` and the fused kernel (median of
   ``triton.testing.do_bench``), the fused kernel's speed-up over compiled, and its bytes moved
   (inputs read once, outputs written once) per second as a share of the HBM bandwidth a plain
   device copy reaches in the same run: a 2 GiB copy (the peak) and a copy of the kernel's own
   bytes, timed as the kernel is (what a transfer of that size can reach).
3. **DiT step** (``--dit-step``): one transformer forward of Z-Image (1024x1024) and Wan (1.3B,
   480p, 81 frames) built from the published configs with random bf16 weights, with the fused
   paths installed and without.

4. **Modulated RMSNorm** (``--rms``, ``--rms-warps``, ``--rms-held``): ``kernels/rms_norm.py``'s
   ``rms_norm_modulate`` at Z-Image's shapes, as table 2 (``--rms-warps``: at each warp count);
   each exact norm (the quantizing one too, and ``w8a8``'s per-token quantization of the gated
   unit's output) with its rows read again for each pass and held in registers
   (``settings.HOLD_ROWS``), and ``rms_norm_modulate_pair`` against its two kernels
   (``--rms-held``: these alone).
5. **The speech models' norms** (``--speech-rms``): ``add_rms_norm`` (the residual add and the
   RMSNorm after it) at the Qwen3-Omni thinker's and talker's widths and decode batch rows, the
   exact kernel at each warp count against the count it runs at (``rms_norm.warps_for``), and
   eager.
6. **The MoE grouping** (``--moe-group``): ``kernels/moe_route.py``'s one-launch grouping of a
   MoE layer's (token, expert) pairs at decode and prompt sizes, with the warps it launches at
   (``launch_config``: at most 8 keys a thread, for its compile time) against 8 warps (its former
   launch at 2,048 pairs and more) and against transformers' chain (``torch.sort``, ``bincount``,
   ``cumsum``, the inverse's scatter), each from a CUDA graph.

    python benchmarks/kernels.py [--variants] [--dit-step] [--quick] [--rms] [--rms-warps] [--rms-held]
        [--speech-rms] [--moe-group] [--skip-numerics] [--skip-speed]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch._dynamo

ROOT = Path(__file__).resolve().parents[1]

#: (name, batch, tokens, q heads, k heads, head dim, per head, norm, rope, layout interleaved)
QK_SHAPES = [
    ("Z-Image 1024x1024 (4096 + 32 caption)", 1, 4128, 30, 30, 128, True, "composite", "complex", True),
    ("Z-Image 1024x1024, CFG batch 2", 2, 4128, 30, 30, 128, True, "composite", "complex", True),
    ("Wan 1.3B 480p 81 frames", 1, 32760, 12, 12, 128, False, "fused", "float32", True),
    ("Wan 1.3B 720p 81 frames", 1, 75600, 12, 12, 128, False, "fused", "float32", True),
    ("Wan 14B 480p 81 frames", 1, 32760, 40, 40, 128, False, "fused", "float32", True),
    ("Wan 14B 720p 81 frames", 1, 75600, 40, 40, 128, False, "fused", "float32", True),
    ("Wan 14B 720p, CFG batch 2, packed QKV", 2, 75600, 40, 40, 128, False, "fused", "float32", True),
    ("Qwen3-Omni thinker prefill 2048", 1, 2048, 32, 4, 128, True, "composite", "io", False),
    ("Qwen3-Omni thinker decode, 64 rows", 64, 1, 32, 4, 128, True, "composite", "io", False),
]
#: (name, batch, tokens, channels, modulation)
ADALN_SHAPES = [
    ("4096 x 3072, per-sample", 1, 4096, 3072, "sample"),
    ("Wan 1.3B 480p (32760 x 1536)", 1, 32760, 1536, "sample"),
    ("Wan 1.3B 720p (75600 x 1536)", 1, 75600, 1536, "sample"),
    ("Wan 14B 480p (32760 x 5120)", 1, 32760, 5120, "sample"),
    ("Wan 14B 720p (75600 x 5120)", 1, 75600, 5120, "sample"),
    ("Wan 14B 720p, CFG batch 2", 2, 75600, 5120, "sample"),
    ("Wan 2.2 TI2V per-token (4096 x 3072)", 1, 4096, 3072, "token"),
]


def qk_inputs(batch, tokens, hq, hk, dim, per_head, rope, packed, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = torch.bfloat16
    width = (hq + 2 * hk) * dim
    if packed:
        from omnirt.kernels.qk_norm_rope import split_packed_qkv

        qkv = torch.randn(batch, tokens, width, device="cuda", dtype=dt, generator=g)
        q, k, _ = split_packed_qkv(qkv, hq, hk, dim)
    else:
        q = torch.randn(batch, tokens, hq * dim, device="cuda", dtype=dt, generator=g).unflatten(
            -1, (hq, dim)
        )
        k = torch.randn(batch, tokens, hk * dim, device="cuda", dtype=dt, generator=g).unflatten(
            -1, (hk, dim)
        )
    n_w_q = dim if per_head else hq * dim
    n_w_k = dim if per_head else hk * dim
    qw = (1 + 0.1 * torch.randn(n_w_q, device="cuda", generator=g)).to(dt)
    kw = (1 + 0.1 * torch.randn(n_w_k, device="cuda", generator=g)).to(dt)
    pos = torch.arange(tokens, device="cuda", dtype=torch.float64)[:, None]
    freqs = 1.0 / (10000 ** (torch.arange(0, dim, 2, device="cuda", dtype=torch.float64) / dim))
    angles = pos * freqs[None, :]
    table = torch.cat([angles.cos(), angles.sin()], dim=-1).float()[None]
    if rope == "io":
        table = table.to(dt).expand(batch, tokens, dim)
    return q, k, qw, kw, table


def adaln_inputs(batch, tokens, channels, modulation, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(batch, tokens, channels, device="cuda", dtype=torch.bfloat16, generator=g)
    if modulation == "token":
        table = torch.randn(batch, tokens, 6, channels, device="cuda", generator=g)
        shift, scale = table[:, :, 0], table[:, :, 1]
    else:
        table = torch.randn(batch, 6, channels, device="cuda", generator=g)
        shift, scale = table[:, 0:1], table[:, 1:2]  # views at a 6 C stride, as Wan's chunk
    return x, scale, shift


def bench(fn: Callable[[], object]) -> float:
    """Milliseconds per call, replayed from a CUDA graph (device time, without Python's launch
    overhead: what a graphed or large-batch caller sees)."""
    import triton.testing

    fn()  # compile and autotune outside the capture
    torch.cuda.synchronize()
    return float(triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median"))


def bench_eager(fn: Callable[[], object]) -> float:
    """Milliseconds per call, launched from Python (for a chain that syncs with the host, as
    ``torch.bincount`` does, and so cannot be captured in a CUDA graph)."""
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, rep=30, return_mode="median"))


def copy_bandwidth() -> float:
    """Bytes per second of a 2 GiB device-to-device copy (read + write)."""
    import triton.testing

    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = float(triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=100, return_mode="median"))
    return 2 * src.numel() * 2 / (ms / 1e3)


def mismatches(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int]:
    return int((a.view(torch.int16) != b.view(torch.int16)).sum()), a.numel()


def numerics(variants: bool, quick: bool) -> list[str]:
    from omnirt.kernels.adaln import adaln_modulate_reference, adaln_modulate_triton
    from omnirt.kernels.qk_norm_rope import _COMPOSITE_SUMS, qk_norm_rope_reference, qk_norm_rope_triton

    rows = ["| chain and shape | preset / variant | q differ | k differ |", "|---|---|---|---|"]
    shapes = QK_SHAPES[:1] + QK_SHAPES[2:3] + QK_SHAPES[7:] if quick else QK_SHAPES
    for name, b, t, hq, hk, d, per_head, norm, rope, inter in shapes:
        packed = "packed" in name
        q, k, qw, kw, table = qk_inputs(b, t, hq, hk, d, per_head, rope, packed)
        kw_args = dict(eps=1e-6, interleaved=inter, per_head=per_head, norm=norm, rope=rope)
        ref = qk_norm_rope_reference(q, k, qw, kw, table, **kw_args)
        runs = [("fast", {}), ("exact", {})]
        if variants and norm == "composite":
            runs += [("exact", {"composite_sum": a}) for a in _COMPOSITE_SUMS]
            runs += [("exact", {"head_loop": "static"})]
        if variants and norm == "fused":
            runs += [("exact", {"tree": "reduce"}), ("exact", {"output_from": "reload"})]
            runs += [("exact", {"tokens_per_program": n}) for n in (2, 4)]
        for preset, extra in runs:
            try:
                out = qk_norm_rope_triton(q, k, qw, kw, table, preset=preset, **kw_args, **extra)
            except Exception as e:  # a variant that does not build: reported, the rest go on
                rows.append(f"| qk {name} | {preset} {extra} | failed: {' '.join(str(e).split())[-400:]} | |")
                continue
            (mq, nq), (mk, nk) = mismatches(out[0], ref[0]), mismatches(out[1], ref[1])
            label = preset + (f" {extra}" if extra else "")
            rows.append(f"| qk {name} ({norm}, {rope}) | {label} | {mq} / {nq} | {mk} / {nk} |")
        del q, k, ref, out
    for name, b, t, c, mod in ADALN_SHAPES[:3] if quick else ADALN_SHAPES:
        x, scale, shift = adaln_inputs(b, t, c, mod)
        ref = adaln_modulate_reference(x, scale, shift, eps=1e-6)
        runs = [("fast", {}), ("exact", {})]
        if variants:
            runs += [
                ("exact", {"tree": t, "load": ld}) for t in ("split", "reduce") for ld in ("items", "tile")
            ]
            runs += [("exact", {"combine": "known", "load": ld}) for ld in ("items", "tile")]
            runs += [("exact", {"output_from": "reload"})]
            runs += [("exact", {"rows": n}) for n in (2, 4)]
        for preset, extra in runs:
            label = preset + (f" {extra}" if extra else "")
            try:
                out = adaln_modulate_triton(x, scale, shift, eps=1e-6, preset=preset, **extra)
            except Exception as e:  # a variant that does not build: reported, the rest go on
                rows.append(f"| adaln {name} | {label} | failed: {' '.join(str(e).split())[-400:]} | |")
                continue
            m, n = mismatches(out, ref)
            rows.append(f"| adaln {name} | {label} | {m} / {n} | |")
    return rows


def _qk_row(name, b, t, hq, hk, d, per_head, norm, rope, inter, bw, compiled) -> str:
    from omnirt.kernels.qk_norm_rope import qk_norm_rope_reference, qk_norm_rope_triton

    q, k, qw, kw, table = qk_inputs(b, t, hq, hk, d, per_head, rope, "packed" in name)
    args = dict(eps=1e-6, interleaved=inter, per_head=per_head, norm=norm, rope=rope)
    eager = bench(lambda: qk_norm_rope_reference(q, k, qw, kw, table, **args))
    comp = bench(lambda: compiled(q, k, qw, kw, table, **args))
    exact = bench(lambda: qk_norm_rope_triton(q, k, qw, kw, table, preset="exact", **args))
    fast = bench(lambda: qk_norm_rope_triton(q, k, qw, kw, table, preset="fast", **args))
    moved = 2 * (q.numel() + k.numel()) * 2 + table[0].numel() * table.element_size()
    return _speed_row(f"qk-norm+rope {name}", eager, comp, exact, fast, moved, bw)


def _adaln_row(name, b, t, c, mod, bw, compiled) -> str:
    from omnirt.kernels.adaln import adaln_modulate_reference, adaln_modulate_triton

    x, scale, shift = adaln_inputs(b, t, c, mod)
    eager = bench(lambda: adaln_modulate_reference(x, scale, shift, eps=1e-6))
    comp = bench(lambda: compiled(x, scale, shift, eps=1e-6))
    exact = bench(lambda: adaln_modulate_triton(x, scale, shift, eps=1e-6, preset="exact"))
    fast = bench(lambda: adaln_modulate_triton(x, scale, shift, eps=1e-6, preset="fast"))
    moved = 2 * x.numel() * 2 + (2 * x.numel() * 4 if mod == "token" else 0)
    return _speed_row(f"adaln {name}", eager, comp, exact, fast, moved, bw)


SPEED_HEADER = (
    "| kernel and shape | eager ms | compiled ms | fused exact ms | fused fast ms | exact vs compiled "
    "| fast vs compiled | exact GB/s (share of copy) | exact share of a same-size copy |",
    "|---|---|---|---|---|---|---|---|---|",
)


def same_size_copy(moved: int) -> float:
    """Bytes per second of a device copy that moves ``moved`` bytes (half read, half written),
    timed as the kernels are (``bench``: a CUDA graph): what the memory gives a transfer of that
    size, launch and tail included, where the 2 GiB copy gives its peak."""
    src = torch.empty(max(1, moved // 4), dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * src.numel() * 2 / (ms / 1e3)


def _speed_row(name, eager, comp, exact, fast, moved, bw) -> str:
    rate = moved / (exact / 1e3)
    return (
        f"| {name} | {eager:.3f} | {comp:.3f} | {exact:.3f} | {fast:.3f} | {comp / exact:.2f}x "
        f"| {comp / fast:.2f}x | {rate / 1e9:.0f} ({rate / bw:.0%}) | {rate / same_size_copy(moved):.0%} |"
    )


def speed(quick: bool) -> Iterator[str]:
    """The main table's lines, each as it is measured (a run cut short keeps the rows before)."""
    from omnirt.kernels.adaln import adaln_modulate_reference
    from omnirt.kernels.qk_norm_rope import qk_norm_rope_reference

    bw = copy_bandwidth()
    yield f"Device copy bandwidth (read + write, 2 GiB): {bw / 1e12:.2f} TB/s"
    yield ""
    yield from SPEED_HEADER
    compiled_qk = torch.compile(qk_norm_rope_reference, dynamic=False)
    compiled_ln = torch.compile(adaln_modulate_reference, dynamic=False)
    for shape in QK_SHAPES[:3] + QK_SHAPES[5:7] if quick else QK_SHAPES:
        yield _qk_row(*shape, bw, compiled_qk)
        torch.cuda.empty_cache()
    for shape in ADALN_SHAPES[:2] + ADALN_SHAPES[4:5] if quick else ADALN_SHAPES:
        yield _adaln_row(*shape, bw, compiled_ln)
        torch.cuda.empty_cache()


#: Z-Image 1024x1024's modulated RMSNorms: (name, batch, tokens, width, residual)
RMS_SHAPES = [
    ("Z-Image norm * scale (4128 x 3840)", 1, 4128, 3840, False),
    ("Z-Image x + gate * norm (4128 x 3840)", 1, 4128, 3840, True),
    ("Z-Image x + gate * norm, CFG batch 2", 2, 4128, 3840, True),
]


def _rms_inputs(g: torch.Generator, b: int, t: int, c: int, residual: bool) -> tuple:
    x = torch.randn(b, t, c, device="cuda", generator=g).bfloat16()
    w = torch.randn(c, device="cuda", generator=g).bfloat16()
    mul = torch.randn(b, 1, c, device="cuda", generator=g).bfloat16()
    res = torch.randn(b, t, c, device="cuda", generator=g).bfloat16() if residual else None
    return x, w, 1e-5, mul, res


def rms_speed(sweep: bool) -> list[str]:
    """``rms_norm_modulate`` (``kernels/rms_norm.py``) against diffusers' eager chain and its
    compile; with ``sweep``, the exact kernel at each number of warps."""
    from omnirt.kernels import rms_norm
    from omnirt.kernels.rms_norm import rms_norm_modulate_reference, rms_norm_modulate_triton

    bw = copy_bandwidth()
    compiled = torch.compile(rms_norm_modulate_reference, dynamic=False)
    rows = list(SPEED_HEADER)
    sweeps = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, b, t, c, residual in RMS_SHAPES:
        args = _rms_inputs(g, b, t, c, residual)
        eager = bench(functools.partial(rms_norm_modulate_reference, *args))
        comp = bench(functools.partial(compiled, *args))
        exact = bench(functools.partial(rms_norm_modulate_triton, *args))
        fast = bench(functools.partial(rms_norm_modulate_triton, *args, preset="fast"))
        moved = args[0].numel() * 2 * (3 if residual else 2)
        rows.append(_speed_row(f"rms-norm-modulate {name}", eager, comp, exact, fast, moved, bw))
        if sweep:
            for warps in (1, 2, 4, 8):
                rms_norm.WARPS = warps
                try:
                    ms = bench(functools.partial(rms_norm_modulate_triton, *args))
                finally:
                    rms_norm.WARPS = None
                sweeps.append(f"| {name} | exact, {warps} warps | {ms:.3f} |")
    if sweeps:
        rows += ["", "| shape | kernel | ms |", "|---|---|---|", *sweeps]
    return rows


def held_speed() -> Iterator[str]:
    """Each exact norm (and the quantizing one, as the W8A8 products' input; and the per-token
    quantization of the gated unit's output) with its row read again for each pass and held in
    registers (``settings.HOLD_ROWS``); then the paired norms (:func:`_pair_rows`). Each line as it
    is measured."""
    from omnirt.kernels import settings, w8a8
    from omnirt.kernels.rms_norm import rms_norm_modulate_quantize_triton, rms_norm_modulate_triton

    yield "| shape | row read again ms | row held ms | held speed-up | held GB/s (of a same-size copy) |"
    yield "|---|---|---|---|---|"
    g = torch.Generator(device="cuda").manual_seed(0)
    gated = torch.randn(4128, 10240, device="cuda", generator=g).bfloat16()  # w2's input
    forms = [(f"Z-Image gated output (4128 x 10240) quantized {kind}",
              functools.partial(w8a8.quantize_rows_triton, gated, kind), gated.numel() * 3 + 4128 * 4)
             for kind in w8a8.KINDS]  # fmt: skip
    for name, b, t, c, residual in RMS_SHAPES:
        args = _rms_inputs(g, b, t, c, residual)
        x, w, _, mul, _ = args
        moved = x.numel() * 2 * (3 if residual else 2)
        forms.append((name, functools.partial(rms_norm_modulate_triton, *args), moved))
        if not residual:  # the norm in front of a W8A8 product: its rows written quantized
            for kind in w8a8.KINDS:
                call = functools.partial(rms_norm_modulate_quantize_triton, x, w, 1e-5, mul, kind)
                forms.append((f"{name}, written {kind}", call, x.numel() * 3 + x.numel() // c * 4))
    for label, call, nbytes in forms:
        times = []
        for hold in (False, True):
            settings.HOLD_ROWS = hold
            try:
                times.append(bench(call))
            finally:
                settings.HOLD_ROWS = False
        rate = nbytes / (times[1] / 1e3)
        yield (f"| {label} | {times[0]:.4f} | {times[1]:.4f} | {times[0] / times[1]:.2f}x "
               f"| {rate / 1e9:.0f} ({rate / same_size_copy(nbytes):.0%}) |")  # fmt: skip
    yield ""
    yield from _pair_rows(g)


def _pair_rows(g: torch.Generator) -> Iterator[str]:
    """Z-Image's update after its attention (``x + gate * norm(out)``) and the feed-forward's norm
    of the new stream (``scale * norm2``; quantized for fp8 products), as two kernels and as
    ``rms_norm_modulate_pair``, with the rows read again and held (``settings.HOLD_ROWS``)."""
    from omnirt.kernels import settings
    from omnirt.kernels.rms_norm import (
        rms_norm_modulate_pair_triton,
        rms_norm_modulate_quantize_triton,
        rms_norm_modulate_triton,
    )

    t, c = 4128, 3840
    out, x = (torch.randn(1, t, c, device="cuda", generator=g).bfloat16() for _ in range(2))
    w, w2 = (torch.randn(c, device="cuda", generator=g).bfloat16() for _ in range(2))
    gate, scale = (torch.randn(1, 1, c, device="cuda", generator=g).bfloat16() for _ in range(2))
    yield "| 4128 x 3840, update then norm | rows | two kernels ms | one kernel ms | speed-up | same bits |"
    yield "|---|---|---|---|---|---|"
    for kind in (None, "fp8"):

        def two(kind=kind):
            stream = rms_norm_modulate_triton(out, w, 1e-6, gate, x)
            if kind is None:
                return stream, rms_norm_modulate_triton(stream, w2, 1e-6, scale)
            return stream, *rms_norm_modulate_quantize_triton(stream, w2, 1e-6, scale, kind)

        def one(kind=kind):
            stream, normed, row_scale = rms_norm_modulate_pair_triton(
                out, w, 1e-6, gate, x, w2, 1e-6, scale, kind
            )
            return (stream, normed) if kind is None else (stream, normed, row_scale)

        for hold in (False, True):
            settings.HOLD_ROWS = hold
            try:
                apart, paired = bench(two), bench(one)
                same = all(torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
                           for a, b in zip(two(), one(), strict=True))  # fmt: skip
            finally:
                settings.HOLD_ROWS = False
            form = "bf16" if kind is None else f"{kind}-quantized"
            yield (f"| {form} | {'held' if hold else 'read again'} | {apart:.4f} | {paired:.4f} "
                   f"| {apart / paired:.2f}x | {same} |")  # fmt: skip


#: The speech decoders' residual adds and norms: (name, width); rows are the decode batch.
SPEECH_RMS = [("thinker 2048", 2048), ("talker and code predictor 1024", 1024)]
SPEECH_ROWS = (1, 8, 32, 128)


def speech_rms_speed() -> list[str]:
    """``add_rms_norm`` at the speech models' shapes: eager, the exact kernel summing through shared
    memory (``rms_norm.ROWS_TREE`` off) at 1, 2, 4, 8 warps (the count ``warps_for`` picks marked),
    and with the rows tree (one warp; the same sums), its row read again for each pass and held in
    registers (``settings.HOLD_ROWS``), each from a CUDA graph (``bench``)."""
    from omnirt.kernels import rms_norm, settings
    from omnirt.kernels.rms_norm import add_rms_norm_reference, add_rms_norm_triton

    rows = [
        "| shape | eager ms | exact, shared-memory tree, ms at 1 / 2 / 4 / 8 warps | warps it ran at | "
        "exact, rows tree (1 warp) ms | rows tree, row held, ms | same bits |",
        "|---|---|---|---|---|---|---|",
    ]
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, width in SPEECH_RMS:
        for count in SPEECH_ROWS:
            x = torch.randn(count, width, device="cuda", generator=g).bfloat16()
            delta = torch.randn(count, width, device="cuda", generator=g).bfloat16()
            w = torch.randn(width, device="cuda", generator=g).bfloat16()
            eager = bench(functools.partial(add_rms_norm_reference, x, delta, w, 1e-6))
            call = functools.partial(add_rms_norm_triton, x, delta, w, 1e-6)
            times = []
            rms_norm.ROWS_TREE = False
            try:
                old = call()
                for warps in (1, 2, 4, 8):
                    rms_norm.WARPS = warps
                    times.append(bench(call))
            finally:
                rms_norm.WARPS = None
                rms_norm.ROWS_TREE = True
            tree = bench(call)
            outputs = [call()]
            settings.HOLD_ROWS = True
            try:
                held = bench(call)
                outputs.append(call())
            finally:
                settings.HOLD_ROWS = False
            same = all(torch.equal(a, b) for out in outputs for a, b in zip(old, out, strict=True))
            config = rms_norm.aten_mean_config(width, count) or rms_norm._fast_config(width)
            picked = rms_norm.warps_for(config[1] * config[2])
            cells = " / ".join(f"{t:.4f}" for t in times)
            cells += f" | {picked} | {tree:.4f} | {held:.4f} | {same}"
            rows.append(f"| {name} x {count} rows | {eager:.4f} | {cells} |")
    return rows


#: (what, pairs): Qwen3-Omni's thinker (128 experts, 8 a token) at decode rows and prompt pieces.
MOE_GROUP_PAIRS = (("decode, 8 rows", 64), ("decode, 128 rows", 1024), ("prompt piece, 512 tokens", 4096),
                   ("two prompt pieces", 8192))  # fmt: skip


def moe_group_speed() -> list[str]:
    """``group_by_expert`` as launched and at 8 warps, from CUDA graphs, and transformers' chain
    (launched from Python: its ``bincount`` syncs with the host, so no graph holds it)."""
    from omnirt.kernels import moe_route

    experts = 128
    rows = [
        "| pairs | torch chain ms (eager) | kernel ms, as launched (warps) | kernel ms, 8 warps "
        "| same grouping |",
        "|---|---|---|---|---|",
    ]
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, pairs in MOE_GROUP_PAIRS:
        ids = torch.randint(0, experts, (pairs,), device="cuda", generator=g)
        chain = bench_eager(functools.partial(moe_route.group_by_expert_reference, ids, experts))
        call = functools.partial(moe_route.group_by_expert_triton, ids, experts)
        launched = bench(call)
        warps = moe_route.launch_config(pairs, experts)[1]["num_warps"]
        first = call()
        moe_route.WARPS = 8
        try:
            eight = bench(call)
            same = all(torch.equal(a, b) for a, b in zip(first, call(), strict=True))
        finally:
            moe_route.WARPS = None
        rows.append(f"| {pairs} ({name}) | {chain:.4f} | {launched:.4f} ({warps}) | {eight:.4f} | {same} |")
    return rows


def variant_speed() -> list[str]:
    """Time per call of each way the exact kernels walk ATen's order (same bits)."""
    from omnirt.kernels.adaln import adaln_modulate_triton
    from omnirt.kernels.qk_norm_rope import qk_norm_rope_triton

    rows = ["| exact kernel variant | ms |", "|---|---|"]
    # composite ones: the sum orders; fused ones (Wan): where the output reads the token
    shapes = (QK_SHAPES[0], QK_SHAPES[7], QK_SHAPES[2], QK_SHAPES[3], QK_SHAPES[5])
    for name, b, t, hq, hk, d, per_head, norm, rope, inter in shapes:
        q, k, qw, kw, table = qk_inputs(b, t, hq, hk, d, per_head, rope, False)
        args = dict(eps=1e-6, interleaved=inter, per_head=per_head, norm=norm, rope=rope)
        if norm == "composite":
            for order in ("vec4_halving", "vec4_warp", "vec4_lanes"):
                call = functools.partial(
                    qk_norm_rope_triton, q, k, qw, kw, table, composite_sum=order, **args
                )
                rows.append(f"| qk {name} composite_sum={order} | {bench(call):.3f} |")
            call = functools.partial(qk_norm_rope_triton, q, k, qw, kw, table, head_loop="static", **args)
            rows.append(f"| qk {name} head_loop=static | {bench(call):.3f} |")
            continue
        # (tree=split against reduce: the same speed, 2026-12-04)
        for source, count in (("reload", 1), ("held", 1), ("held", 2), ("held", 4)):
            call = functools.partial(
                qk_norm_rope_triton, q, k, qw, kw, table, output_from=source, tokens_per_program=count, **args
            )
            rows.append(f"| qk {name} output_from={source} tokens_per_program={count} | {bench(call):.3f} |")
    for name, b, t, c, mod in (ADALN_SHAPES[0], ADALN_SHAPES[1], ADALN_SHAPES[2], ADALN_SHAPES[4]):
        x, scale, shift = adaln_inputs(b, t, c, mod)
        # (combine=divide against known and load=items against tile: 2026-12-05, docs/benchmarks.md)
        for source, count in (("reload", 1), ("held", 1), ("held", 2), ("held", 4)):
            call = functools.partial(
                adaln_modulate_triton, x, scale, shift, eps=1e-6, output_from=source, rows=count
            )
            rows.append(f"| adaln {name} output_from={source} rows={count} | {bench(call):.3f} |")
    for name, b, t, c, mod in (ADALN_SHAPES[1], ADALN_SHAPES[3], ADALN_SHAPES[4], ADALN_SHAPES[-1]):
        x, scale, shift = adaln_inputs(b, t, c, mod)
        for warps in (2, 4, 8, 16):
            fast = functools.partial(
                adaln_modulate_triton, x, scale, shift, eps=1e-6, preset="fast", warps=warps
            )
            rows.append(f"| adaln {name} fast, {warps} warps | {bench(fast):.3f} |")
    return rows


def dit_step() -> list[str]:
    models = ROOT / "benchmarks/models"
    z_cfg = json.loads((models / "z-image-turbo/z-image-turbo.components.json").read_text())["transformer"]
    w_cfg = json.loads((models / "wan2.1-t2v/wan2.1-t2v.components.json").read_text())["transformer_1.3b"]
    rows = [
        "| DiT step (random bf16 weights) | eager ms | fused ms | speed-up | output bitwise equal |",
        "|---|---|---|---|---|",
        _zimage_step(z_cfg),
    ]
    torch.cuda.empty_cache()
    rows.append(_wan_step(w_cfg))
    return rows


def _zimage_step(cfg: dict) -> str:
    from diffusers import ZImageTransformer2DModel

    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.device("cuda"):
        torch.manual_seed(0)
        model = ZImageTransformer2DModel.from_config({k: v for k, v in cfg.items() if not k.startswith("_")})
        model = model.to(torch.bfloat16).eval()
    latents = [torch.randn(16, 1, 128, 128, device="cuda", dtype=torch.bfloat16, generator=g)]
    caption = [torch.randn(32, cfg["cap_feat_dim"], device="cuda", dtype=torch.bfloat16, generator=g)]
    t = torch.tensor([0.5], device="cuda", dtype=torch.bfloat16)
    name = "Z-Image 6.15B, 1024x1024"
    return _step_row(name, model, lambda: model(latents, t, caption, return_dict=False)[0][0])


def _wan_step(cfg: dict) -> str:
    from diffusers import WanTransformer3DModel
    from omnirt.stages.diffusion.wan_loader import _cast_keeping_fp32

    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.device("cuda"):
        torch.manual_seed(0)
        model = WanTransformer3DModel.from_config({k: v for k, v in cfg.items() if not k.startswith("_")})
        _cast_keeping_fp32(model, torch.bfloat16)
        model = model.eval()
    video = torch.randn(1, 16, 21, 60, 104, device="cuda", dtype=torch.bfloat16, generator=g)
    text = torch.randn(1, 512, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    step = torch.tensor([500.0], device="cuda")
    name = "Wan 1.3B, 480p 81 frames"
    return _step_row(name, model, lambda: model(video, step, text, return_dict=False)[0])


def _step_row(name, model, call) -> str:
    from omnirt.stages.diffusion.fused import install, uninstall

    with torch.no_grad():
        uninstall(model)
        ref = call()
        eager = bench(call)
        sites = install(model)
        out = call()
        fused = bench(call)
        uninstall(model)
    same = bool(torch.equal(ref, out))
    return f"| {name} ({sites} fused sites) | {eager:.1f} | {fused:.1f} | {eager / fused:.2f}x | {same} |"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--variants", action="store_true", help="numerics of every FMA variant of the exact kernels"
    )
    p.add_argument("--dit-step", action="store_true", help="also one Z-Image and one Wan transformer step")
    p.add_argument("--quick", action="store_true", help="fewer shapes")
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--skip-numerics", action="store_true", help="no numerics table (the speed table sooner)")
    p.add_argument("--variant-speed", action="store_true", help="time each variant of the exact kernels")
    p.add_argument("--rms", action="store_true", help="the modulated RMSNorm at Z-Image's shapes")
    p.add_argument("--rms-warps", action="store_true", help="and the exact kernel at 1, 2, 4, 8 warps")
    p.add_argument("--rms-held", action="store_true", help="norms with rows held (HOLD_ROWS); paired norms")
    p.add_argument("--speech-rms", action="store_true", help="add_rms_norm at the speech models' shapes")
    p.add_argument("--moe-group", action="store_true", help="the MoE grouping kernel, 8 warps, torch's chain")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from omnirt.kernels import settings

    settings.set_fused("on")
    torch._dynamo.config.recompile_limit = 64  # one compile per shape, never a fall-back to eager
    print(f"# Fused DiT kernels on {torch.cuda.get_device_name()} (torch {torch.__version__})\n")
    if args.rms or args.rms_warps:
        print("## Modulated RMSNorm\n")
        print("\n".join(rms_speed(args.rms_warps)), flush=True)
    if args.rms or args.rms_held:
        print("\n## Rows held in registers; the paired norms\n", flush=True)
        for line in held_speed():
            print(line, flush=True)
    if args.speech_rms:
        print("## The speech models' residual add and RMSNorm\n")
        print("\n".join(speech_rms_speed()), flush=True)
    if args.moe_group:
        print("## The MoE layers' grouping by expert\n")
        print("\n".join(moe_group_speed()), flush=True)
    if not args.skip_numerics:
        print("\n## Numerics (elements differing from eager, bf16)\n")
        print("\n".join(numerics(args.variants, args.quick)), flush=True)
    if args.variant_speed:
        print("\n## Exact kernel variants\n")
        print("\n".join(variant_speed()), flush=True)
    if not args.skip_speed:
        print("\n## Speed\n")
        for line in speed(args.quick):
            print(line, flush=True)
    if args.dit_step:
        print("\n## One transformer step\n")
        print("\n".join(dit_step()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
