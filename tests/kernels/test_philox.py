"""kernels/philox.py on the CPU: the one-launch uniforms under Triton's interpreter bitwise the
tensor chain of ``stages.sampling.philox_uniform`` (negative seeds, counters whose product with the
draw count wraps, strided rows, every stream width), the refusals, and the samplers' dispatcher."""

from __future__ import annotations

import pytest
import torch
from omnirt.kernels import philox as kernel
from omnirt.kernels import settings
from omnirt.stages.sampling import philox_uniform, philox_uniforms

from .conftest import interpreted


def _rows(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=g, dtype=torch.long)
    counters = torch.randint(0, 2**40, (rows,), generator=g, dtype=torch.long)
    counters[0] = 2**62 + 5  # times the draws, past 2**63: wraps as torch's int64 product does
    return seeds, counters


def _chain(seeds: torch.Tensor, counters: torch.Tensor, draws: int, stream: int) -> torch.Tensor:
    rows = seeds.shape[0]
    count = counters[:, None] * draws + torch.arange(draws)
    return philox_uniform(seeds[:, None].expand(rows, draws), count, stream)


@interpreted
@pytest.mark.parametrize(
    ("rows", "draws", "stream"),
    [(1, 1, 0), (8, 15, 2), (5, 1, 1), (33, 7, 4), (3, 3, 2**32 - 1), (300, 2, 9)],
)
def test_kernel_is_the_tensor_chain(rows, draws, stream):
    seeds, counters = _rows(rows, seed=rows)
    got = kernel.philox_uniforms(seeds, counters, draws, stream)
    want = _chain(seeds, counters, draws, stream)
    assert got.dtype == torch.float32 and got.shape == (rows, draws)
    assert torch.equal(got, want)
    assert 0 <= float(got.min()) and float(got.max()) < 1


@interpreted
def test_strided_rows():
    seeds, counters = _rows(12, seed=3)
    got = kernel.philox_uniforms(seeds[::3], counters[1::3], 4, 2)
    assert torch.equal(got, _chain(seeds[::3], counters[1::3], 4, 2))


@interpreted
def test_no_rows():
    empty = torch.zeros(0, dtype=torch.long)
    assert kernel.philox_uniforms(empty, empty, 3, 0).shape == (0, 3)


@pytest.mark.parametrize(
    ("seeds", "counters", "draws", "stream", "message"),
    [
        (torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 1, dtype=torch.long), 1, 0, "must be \\[B\\]"),
        (torch.zeros(2, dtype=torch.long), torch.zeros(3, dtype=torch.long), 1, 0, "one length"),
        (torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), 1, 0, "int64"),
        (torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long), 0, 0, "draws"),
        (torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long), 1, 2**32, "stream"),
    ],
)
def test_refuses_what_it_does_not_take(seeds, counters, draws, stream, message):
    with pytest.raises(ValueError, match=message):
        kernel.philox_uniforms(seeds, counters, draws, stream)


def test_the_dispatcher_runs_the_chain_off_cuda_and_when_off():
    seeds, counters = _rows(6, seed=7)
    assert not kernel.kernel_applies(seeds, counters, 5, 2)  # CPU tensors: never from a dispatcher
    assert torch.equal(philox_uniforms(seeds, counters, 5, 2), _chain(seeds, counters, 5, 2))
    before = settings.FUSED
    settings.set_fused("off")
    try:
        assert not kernel.kernel_applies(seeds, counters, 5, 2)
    finally:
        settings.set_fused(before)
