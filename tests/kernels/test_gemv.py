"""kernels/gemv.py on the CPU under the interpreter: few-row products (plain and with the gated
unit read in) against ``F.linear`` of the same inputs, K whole or split in parts, odd shapes and
strided rows, the refusals."""

from __future__ import annotations

import pytest
import torch
from omnirt.kernels.gemv import gemv, gemv_reference

from .conftest import interpreted


@interpreted
@pytest.mark.parametrize(
    ("rows", "n", "k", "gated"),
    [(8, 96, 64, False), (3, 40, 48, True), (16, 33, 100, False), (1, 17, 24, True)],
)
def test_products_equal_the_linear_chain(rows, n, k, gated):
    g = torch.Generator().manual_seed(rows + n)
    x = torch.randn(rows, 2 * k if gated else k, generator=g)
    w = torch.randn(n, k, generator=g)
    want = gemv_reference(x, w, gated=gated)
    for split in (1, 2, 3):  # K in parts summed by each block's last program, in part order
        got = gemv(x, w, gated=gated, launch=(16, 16, 4, 1, split))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=5e-5)


@interpreted
def test_strided_rows_and_refusals():
    g = torch.Generator().manual_seed(3)
    base = torch.randn(4, 80, generator=g)
    x = base[:, :48]  # rows of stride 80
    w = torch.randn(20, 48, generator=g)
    torch.testing.assert_close(gemv(x, w, launch=(16, 32, 4, 1)), gemv_reference(x, w), rtol=1e-5, atol=5e-5)
    with pytest.raises(ValueError, match="rows"):
        gemv(torch.randn(17, 48), w)
    with pytest.raises(ValueError, match="columns"):
        gemv(torch.randn(2, 47), w)
    with pytest.raises(ValueError, match="dtype"):
        gemv(x.double(), w.double())
