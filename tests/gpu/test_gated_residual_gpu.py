"""kernels/gated_residual.py on CUDA (marker ``gpu``): the gated residual add bitwise the eager
chain of diffusers' Wan block at Wan 1.3B's and 14B's widths (480p tokens), bf16, fp16 and fp32,
with a per-sample and a per-token gate; the dispatcher takes the kernel."""

from __future__ import annotations

import pytest
import torch
from omnirt.kernels import gated_residual as module
from omnirt.kernels.gated_residual import gated_residual, gated_residual_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 32760, 1536), (1, 32760, 5120), (2, 1000, 1536)], ids=str)
def test_the_kernel_is_the_eager_chain(shape, dtype, monkeypatch):
    g = torch.Generator(device="cuda").manual_seed(0)
    b, s, c = shape
    x = (torch.randn(shape, device="cuda", generator=g) * 4).to(dtype)
    y = torch.randn(shape, device="cuda", generator=g).to(dtype)
    launched = []
    real = module._launch
    monkeypatch.setattr(module, "_launch", lambda *a: launched.append(1) or real(*a))
    for tokens in (1, s) if s <= 1000 else (1,):
        table = torch.randn(b, tokens, 6, c, device="cuda", generator=g)
        gate = table.chunk(6, dim=2)[2].squeeze(2)  # strided, as diffusers' chunk makes it
        got = gated_residual(x, y, gate)
        want = (x.float() + y * gate).type_as(x)
        assert torch.equal(got, want), (shape, dtype, tokens, int((got != want).sum()))
        assert torch.equal(got, gated_residual_reference(x, y, gate))
    assert launched


def test_compile_traces_through_the_op():
    g = torch.Generator(device="cuda").manual_seed(3)
    x = (torch.randn(2, 300, 1536, device="cuda", generator=g) * 4).bfloat16()
    y = torch.randn(2, 300, 1536, device="cuda", generator=g).bfloat16()
    gate = torch.randn(2, 1, 1536, device="cuda", generator=g)

    def block(x, y, gate):  # (doubling is exact: any fusion inductor makes keeps the bits)
        return gated_residual(x, y, gate) * 2

    compiled = torch.compile(block, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x, y, gate), block(x, y, gate))
