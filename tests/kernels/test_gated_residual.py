"""kernels/gated_residual.py on the CPU: the kernel under Triton's interpreter (fp32) bitwise the
eager chain (diffusers' Wan block: ``(x.float() + y * gate).type_as(x)``) with a per-sample and a
per-token gate, the refusals, and the dispatcher (the eager chain off CUDA)."""

from __future__ import annotations

import pytest
import torch
from omnirt.kernels.gated_residual import gated_residual, gated_residual_reference, gated_residual_triton

from .conftest import interpreted


def _inputs(b: int, s: int, c: int, per_token: bool, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(b, s, c, generator=g) * 3, torch.randn(b, s, c, generator=g)
    table = torch.randn(b, s if per_token else 1, 6, c, generator=g)
    return x, y, table.chunk(6, dim=2)[2].squeeze(2)  # a strided gate, as diffusers' chunk makes it


def test_the_reference_is_the_wan_blocks_chain():
    x, y, gate = _inputs(2, 5, 16, per_token=False)
    xb, yb = x.bfloat16(), y.bfloat16()
    assert torch.equal(gated_residual_reference(xb, yb, gate), (xb.float() + yb * gate).type_as(xb))
    assert torch.equal(gated_residual_reference(xb, yb, gate), (xb.float() + yb.float() * gate).type_as(xb))


@interpreted
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("shape", [(2, 7, 300), (1, 3, 5120), (3, 4, 40)], ids=str)
def test_kernel_is_the_eager_chain(shape, per_token):
    x, y, gate = _inputs(*shape, per_token=per_token)
    got = gated_residual_triton(x, y, gate)
    assert torch.equal(got, gated_residual_reference(x, y, gate))  # fp32: IEEE products and sums
    assert got.shape == x.shape and got.dtype == x.dtype and got.is_contiguous()
    if shape[0] == 1:  # rows of a stride wider than the row (a slice of a wider product)
        y_wide = torch.randn(1, shape[1], shape[2] + 8)[:, :, : shape[2]]
        assert y_wide.stride(1) == shape[2] + 8
        assert torch.equal(gated_residual_triton(x, y_wide, gate), gated_residual_reference(x, y_wide, gate))


@interpreted
def test_refusals():
    x, y, gate = _inputs(2, 3, 64, per_token=False)
    bad = [
        (x, y[:, :2], gate, "one \\[B, S, C\\] shape"),
        (x[0], y[0], gate, "one \\[B, S, C\\] shape"),
        (x, y, gate[:1], "the gate must be"),
        (x, y, gate.double(), "float32"),
        (x.int(), y.int(), gate, "dtypes"),
        (x.transpose(1, 2).contiguous().transpose(1, 2), y, gate, "contiguous last dim"),
        (x, y, torch.randn(2, 64, 3).transpose(1, 2), "contiguous last dim"),
        (torch.randn(2, 6, 64)[:, :3], y, gate, "rows of one stride"),
    ]
    for a, b, g, words in bad:
        with pytest.raises(ValueError, match=words):
            gated_residual_triton(a, b, g)


def test_the_dispatcher_runs_the_eager_chain_off_cuda():
    x, y, gate = _inputs(2, 6, 96, per_token=True)
    xb, yb = x.bfloat16(), y.bfloat16()
    assert torch.equal(gated_residual(xb, yb, gate), (xb.float() + yb * gate).type_as(xb))


@interpreted
def test_custom_op_schema_fake_and_kernel():
    """``omnirt::gated_residual`` (what ``torch.compile`` traces): its schema and fake agree with the
    kernel, which it runs."""
    x, y, gate = _inputs(2, 3, 64, per_token=False)
    torch.library.opcheck(
        torch.ops.omnirt.gated_residual.default, (x, y, gate), test_utils=("test_schema", "test_faketensor")
    )
    assert torch.equal(torch.ops.omnirt.gated_residual(x, y, gate), gated_residual_reference(x, y, gate))
