"""kernels/rms_norm.py on the GPU (marker ``gpu``; results in docs/benchmarks.md): the ``exact``
kernel against transformers' eager chain, bitwise, at every width the speech models use and at row
counts that give ATen's mean each of its launches; when a case differs, the summation orders that
would have matched eager's mean are named (so one run tells which order ATen took)."""

from __future__ import annotations

import pytest
import torch
from omnirt.kernels import settings
from omnirt.kernels.reduce_order import aten_mean_config
from omnirt.kernels.rms_norm import (
    add_rms_norm,
    add_rms_norm_reference,
    add_rms_norm_triton,
    kernel_applies,
    rms_norm_modulate,
    rms_norm_modulate_reference,
    rms_norm_modulate_triton,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

WIDTHS = (32, 64, 128, 1024, 2048, 4096)


@pytest.fixture(params=[False, True], ids=["read-again", "held"])
def hold(request, monkeypatch):
    """``settings.HOLD_ROWS`` off and on: each pass reading the row again, or the row held in
    registers after its first read (the same bits either way)."""
    monkeypatch.setattr(settings, "HOLD_ROWS", request.param)
    return request.param

ROWS = (1, 2, 3, 4, 5, 8, 15, 16, 17, 32, 64, 100, 128, 256, 512)


def _tree(t: torch.Tensor, halving: bool) -> torch.Tensor:
    while t.shape[-1] > 1:
        n = t.shape[-1] // 2
        t = t[..., :n] + t[..., n:] if halving else t[..., 0::2] + t[..., 1::2]
    return t[..., 0]


def _orders_matching(squares: torch.Tensor, mean: torch.Tensor) -> list[str]:
    """Which orders (vector, lanes, tree) give eager's ``mean`` of ``squares`` [R, W] bit for bit."""
    rows, width = squares.shape
    found = []
    for vec in (1, 4):
        lanes = 1
        while lanes <= 512 and lanes * vec <= width:
            steps = width // (lanes * vec)
            if steps * lanes * vec != width:
                lanes *= 2
                continue
            if vec == 1:  # lane l reads elements l, l + lanes, ...
                parts = squares.view(rows, steps, lanes, 1)
            else:
                parts = squares.view(rows, steps, lanes, 4)
            acc = parts[:, 0]
            for s in range(1, steps):
                acc = acc + parts[:, s]
            t = acc[..., 0] if vec == 1 else ((acc[..., 0] + acc[..., 1]) + acc[..., 2]) + acc[..., 3]
            for halving in (True, False):
                if torch.equal(_tree(t, halving) * (1.0 / width), mean):
                    found.append(f"vec{vec}x{lanes}{'h' if halving else 'p'}")
            lanes *= 2
    return found


def test_exact_is_bitwise_the_eager_chain(hold):
    g = torch.Generator(device="cuda").manual_seed(0)
    differ, checked = [], 0
    for width in WIDTHS:
        for rows in ROWS:
            if aten_mean_config(width, rows) is None:
                continue
            for dtype in (torch.bfloat16, torch.float32):
                x = (torch.randn(rows, width, device="cuda", generator=g) * 3).to(dtype)
                d = torch.randn(rows, width, device="cuda", generator=g).to(dtype)
                w = (1 + 0.1 * torch.randn(width, device="cuda", generator=g)).to(dtype)
                for delta in (d, None):
                    sums = torch.empty(rows, device="cuda")
                    got = add_rms_norm_triton(x, delta, w, 1e-6, sumsq=sums)
                    want = add_rms_norm_reference(x, delta, w, 1e-6)
                    checked += 1
                    if not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
                        squares = want[0].float().pow(2)
                        mean = squares.mean(-1)
                        rows_off = int((sums * (1.0 / width) != mean).sum())
                        differ.append(
                            f"{width}x{rows} {dtype} delta={delta is not None}: model "
                            f"{aten_mean_config(width, rows)}, means off in {rows_off} rows; eager's "
                            f"mean matches {_orders_matching(squares, mean)}"
                        )
    print(f"\n[gpu] add_rms_norm exact (held {hold}): {checked - len(differ)} of {checked} cases bitwise")
    assert not differ, "\n".join(differ)


def test_moshis_chain_is_bitwise_the_eager_chain(hold):
    """``chain="moshi"`` (the duplex LM's ``MoshiRMSNorm``: the weight product in fp32, one
    rounding) at the Moshi temporal (4096) and depth (1024) widths, with and without the add."""
    g = torch.Generator(device="cuda").manual_seed(1)
    differ, checked = [], 0
    for width in (1024, 4096):
        for rows in (1, 2, 3, 8, 16, 32, 128):
            x = (torch.randn(rows, width, device="cuda", generator=g) * 3).bfloat16()
            d = torch.randn(rows, width, device="cuda", generator=g).bfloat16()
            w = (1 + 0.1 * torch.randn(width, device="cuda", generator=g)).bfloat16()
            for delta in (d, None):
                got = add_rms_norm_triton(x, delta, w, 1e-8, chain="moshi")
                want = add_rms_norm_reference(x, delta, w, 1e-8, chain="moshi")
                checked += 1
                if not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
                    off = int((got[1] != want[1]).sum())
                    differ.append(f"{width}x{rows} delta={delta is not None}: {off} elements differ")
    bitwise = checked - len(differ)
    print(f"\n[gpu] add_rms_norm moshi chain (held {hold}): {bitwise} of {checked} cases bitwise")
    assert not differ, "\n".join(differ)


def test_the_dispatcher_takes_the_kernel_on_cuda():
    before = settings.FUSED
    try:
        settings.set_fused("auto")
        x = torch.randn(3, 1, 2048, device="cuda", dtype=torch.bfloat16)
        w = torch.ones(2048, device="cuda", dtype=torch.bfloat16)
        assert kernel_applies(x, x, w)
        got, want = add_rms_norm(x, x, w, 1e-6), add_rms_norm_reference(x, x, w, 1e-6)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        settings.set_fused("off")
        assert not kernel_applies(x, x, w)
    finally:
        settings.set_fused(before)


# (batch, tokens, width): Z-Image 1024x1024 (4096 image + 32 caption tokens; its refiners: 4096 and
# 32), CFG batch 2, few rows; Wan 1.3B's and a power-of-two width
DIT_SHAPES = [
    (1, 4128, 3840), (2, 4128, 3840), (1, 4096, 3840), (1, 32, 3840), (2, 17, 3840), (1, 16, 3840),
    (1, 3600, 1536), (2, 100, 512),
]


def test_modulated_exact_is_bitwise_diffusers_block_chain(hold):
    g = torch.Generator(device="cuda").manual_seed(0)
    differ, checked, skipped = [], 0, []
    for batch, tokens, width in DIT_SHAPES:
        rows = batch * tokens
        if aten_mean_config(width, rows) is None:
            skipped.append((batch, tokens, width))
            continue
        for dtype in (torch.bfloat16, torch.float32):
            x = (torch.randn(batch, tokens, width, device="cuda", generator=g) * 3).to(dtype)
            w = (1 + 0.1 * torch.randn(width, device="cuda", generator=g)).to(dtype)
            scale = (1 + 0.1 * torch.randn(batch, 1, width, device="cuda", generator=g)).to(dtype)
            gate = torch.tanh(torch.randn(batch, 1, width, device="cuda", generator=g)).to(dtype)
            res = torch.randn(batch, tokens, width, device="cuda", generator=g).to(dtype)
            for mul, residual in ((scale, None), (gate, res), (None, res), (None, None), (scale[:1], None)):
                got = rms_norm_modulate_triton(x, w, 1e-5, mul, residual)
                want = rms_norm_modulate_reference(x, w, 1e-5, mul, residual)
                checked += 1
                if not torch.equal(got, want):
                    differ.append(
                        f"{batch}x{tokens}x{width} {dtype} mul={None if mul is None else tuple(mul.shape)} "
                        f"residual={residual is not None}: {int((got != want).sum())} of {got.numel()} differ"
                    )
    bitwise = checked - len(differ)
    print(f"\n[gpu] rms_norm_modulate exact (held {hold}): {bitwise} of {checked} bitwise; eager: {skipped}")
    assert not differ, "\n".join(differ)
    x = torch.randn(1, 4128, 3840, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(3840, device="cuda", dtype=torch.bfloat16)
    gate = torch.rand(1, 1, 3840, device="cuda", dtype=torch.bfloat16)
    want = rms_norm_modulate_reference(x, w, 1e-5, gate, x)
    assert torch.equal(rms_norm_modulate(x, w, 1e-5, gate, x), want)  # the dispatcher, auto


def test_the_pair_is_bitwise_the_two_eager_chains(hold):
    """``rms_norm_modulate_pair``: Z-Image's update after its attention and the feed-forward's norm
    of the new stream (bf16, or quantized per token as the W8A8 products read it) in one launch,
    bitwise diffusers' two chains (and ``w8a8.quantize_rows`` of the second)."""
    from omnirt.kernels.rms_norm import rms_norm_modulate_pair, rms_norm_modulate_pair_reference
    from omnirt.kernels.w8a8 import quantize_rows

    g = torch.Generator(device="cuda").manual_seed(3)
    differ, checked = [], 0
    for batch, tokens, width in ((1, 4128, 3840), (2, 4128, 3840), (1, 32, 3840), (2, 100, 512)):
        shape = (batch, tokens, width)
        out, x = ((torch.randn(*shape, device="cuda", generator=g) * 3).bfloat16() for _ in range(2))
        w, w2 = ((1 + 0.1 * torch.randn(width, device="cuda", generator=g)).bfloat16() for _ in range(2))
        gate = torch.tanh(torch.randn(batch, 1, width, device="cuda", generator=g)).bfloat16()
        scale = (1 + 0.1 * torch.randn(batch, 1, width, device="cuda", generator=g)).bfloat16()
        want_stream, want = rms_norm_modulate_pair_reference(out, w, 1e-5, gate, x, w2, 1e-6, scale)
        for kind in (None, "int8", "fp8"):
            stream, got = rms_norm_modulate_pair(out, w, 1e-5, gate, x, w2, 1e-6, scale, kind)
            checked += 1
            if kind is None:
                same = torch.equal(got, want)
            else:
                values, row_scale = quantize_rows(want.reshape(-1, width), kind)
                same = torch.equal(got.scale, row_scale) and torch.equal(
                    got.values.view(torch.int8), values.view(torch.int8)
                )
            if not (same and torch.equal(stream, want_stream)):
                differ.append(f"{batch}x{tokens}x{width} {kind}: stream {torch.equal(stream, want_stream)}")
    print(f"\n[gpu] rms_norm_modulate_pair (held {hold}): {checked - len(differ)} of {checked} bitwise")
    assert not differ, "\n".join(differ)
