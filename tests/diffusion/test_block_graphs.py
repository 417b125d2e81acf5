"""stages/diffusion/block_graphs.py off CUDA: every run is the blocks called eagerly in order, the
range is checked, and a new list of blocks replaces the old one (the graphs themselves, bitwise
the eager blocks on CUDA, are in tests/diffusion/test_split_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from omnirt.stages.diffusion.block_graphs import BlockGraphs


def _scale(block: torch.nn.Module, hidden: torch.Tensor, factor: torch.Tensor, none: None) -> torch.Tensor:
    assert none is None
    return block(hidden) * factor


def test_off_cuda_the_blocks_run_eagerly_in_order():
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
    graphs = BlockGraphs(_scale)
    hidden, factor = torch.randn(2, 4), torch.tensor(0.5)
    want = hidden
    for block in blocks:
        want = block(want) * factor
    with torch.no_grad():
        got = graphs.run(blocks, graphs.run(blocks, hidden, (factor, None), 0, 1), (factor, None), 1, 3)
        assert torch.equal(got, want.detach()) and graphs.last_path == "eager" and graphs.captures == 0
        assert graphs.run(blocks, hidden, (factor, None), 2, 2) is hidden
        with pytest.raises(ValueError, match="out of 0:3"):
            graphs.run(blocks, hidden, (factor, None), 1, 4)
        other = torch.nn.ModuleList(blocks[:2])
        with pytest.raises(ValueError, match="out of 0:2"):  # the new list is the one checked
            graphs.run(other, hidden, (factor, None), 0, 3)
