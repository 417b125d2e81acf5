"""The kernels that write a W8A8 product's input on the GPU (marker ``gpu``; results in
docs/benchmarks.md): ``swiglu`` bitwise diffusers' ``silu(a) * b`` in bf16 (ATen's SiLU looked
up), fp16 and fp32 (libdevice's ``expf``); ``swiglu_quantize`` and ``rms_norm_modulate_quantize``
bitwise ``w8a8.quantize_rows`` of the eager chains' outputs, int8 and fp8, at Z-Image's shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from omnirt.kernels.rms_norm import rms_norm_modulate_quantize, rms_norm_modulate_reference
from omnirt.kernels.swiglu import swiglu, swiglu_quantize
from omnirt.kernels.w8a8 import quantize_rows

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.dtype == torch.float8_e4m3fn:
        got, want = got.view(torch.int8), want.view(torch.int8)
    return torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_swiglu_is_bitwise_the_eager_chain(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    differ, checked = [], 0
    for rows, width in ((4128, 10240), (32, 10240), (7, 300), (1, 5000), (4096, 8960)):
        gate_up = (torch.randn(rows, 2 * width, device="cuda", generator=g) * 4).to(dtype)
        a, b = gate_up[:, :width], gate_up[:, width:]  # the halves of one merged product
        eager = F.silu(a) * b
        got = swiglu(a, b)
        checked += 1
        if not torch.equal(got, eager):
            differ.append(f"{rows}x{width} {dtype}: {int((got != eager).sum())} of {got.numel()} differ")
        for kind in ("int8", "fp8"):
            q = swiglu_quantize(a, b, kind)
            want_values, want_scale = quantize_rows(eager, kind)
            checked += 1
            if not (torch.equal(q.scale, want_scale) and _same(q.values, want_values)):
                differ.append(f"{rows}x{width} {dtype} {kind}: quantized rows differ")
    print(f"\n[gpu] swiglu {dtype}: {checked - len(differ)} of {checked} bitwise")
    assert not differ, "\n".join(differ)


@pytest.mark.parametrize("hold", [False, True], ids=["read-again", "held"])
def test_the_quantizing_norm_is_bitwise_the_eager_chain(hold, monkeypatch):
    from omnirt.kernels import settings

    monkeypatch.setattr(settings, "HOLD_ROWS", hold)  # the row read for each pass, or held
    g = torch.Generator(device="cuda").manual_seed(1)
    differ, checked = [], 0
    # Z-Image's main layers (1024x1024: 4128 rows) and caption refiner (32), a 1536-wide one
    for batch, tokens, width, dtype in (
        (1, 4128, 3840, torch.bfloat16), (1, 32, 3840, torch.bfloat16), (2, 40, 1536, torch.float32),
    ):  # fmt: skip
        x = (torch.randn(batch, tokens, width, device="cuda", generator=g) * 3).to(dtype)
        w = (1 + 0.1 * torch.randn(width, device="cuda", generator=g)).to(dtype)
        scale = (1 + 0.1 * torch.randn(batch, 1, width, device="cuda", generator=g)).to(dtype)
        for mul in (scale, None):
            eager = rms_norm_modulate_reference(x, w, 1e-5, mul).reshape(-1, width)
            for kind in ("int8", "fp8"):
                q = rms_norm_modulate_quantize(x, w, 1e-5, mul, kind)
                want_values, want_scale = quantize_rows(eager, kind)
                checked += 1
                if not (torch.equal(q.scale, want_scale) and _same(q.values, want_values)):
                    bad = int((q.values.view(torch.int8) != want_values.view(torch.int8)).sum())
                    differ.append(f"{batch}x{tokens}x{width} {dtype} {kind} mul={mul is not None}: {bad}")
    print(f"\n[gpu] rms_norm_modulate_quantize (held {hold}): {checked - len(differ)} of {checked} bitwise")
    assert not differ, "\n".join(differ)


def test_compile_traces_through_both_ops():
    g = torch.Generator(device="cuda").manual_seed(5)
    a, b = (torch.randn(300, 2 * 1024, device="cuda", generator=g) * 4).bfloat16().chunk(2, dim=-1)

    def unit(a, b):  # (doubling is exact: any fusion inductor makes keeps the bits)
        rows = swiglu_quantize(a, b, "fp8")
        return swiglu(a, b) * 2, rows.values, rows.scale * 2

    compiled = torch.compile(unit, fullgraph=True, dynamic=False)
    for got, want in zip(compiled(a, b), unit(a, b), strict=True):
        assert _same(got, want)
