"""``stages/diffusion/block_graphs.py`` off CUDA: the eager path is the denoisers' block loop, and
the replay path's bookkeeping (static buffers per shape, one graph per block chaining through the
hidden buffer, interleaved requests, a swapped module, the least recently used shape dropped, a
block whose capture fails left eager) with a stand-in for the CUDA graph that runs the captured
call when replayed. The real graphs: ``test_block_graphs_gpu.py``."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from omnirt.stages.diffusion import block_graphs, zimage
from omnirt.stages.diffusion.block_graphs import BlockGraphs, shape_key
from omnirt.stages.diffusion.denoiser import Shape
from omnirt.stages.diffusion.zimage_loader import load_zimage

from .test_wan import gens


class Block(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        torch.nn.init.normal_(self.lin.weight, generator=torch.Generator().manual_seed(seed))

    def forward(self, hidden: torch.Tensor, scale: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        out = hidden + torch.tanh(self.lin(hidden)) * scale[:, None, :]
        return out if mask is None else out * mask[..., None]


def call(block: torch.nn.Module, inputs: Mapping[str, torch.Tensor | None]) -> torch.Tensor:
    hidden, scale = inputs["hidden"], inputs["scale"]
    assert hidden is not None and scale is not None
    return block(hidden, scale, inputs["mask"])


class StandInGraph:
    """Replays what was captured: the block's call on the buffers, written over the hidden one."""

    def __init__(self, graphs: BlockGraphs, block: torch.nn.Module, buffers: dict) -> None:
        self.call, self.block, self.buffers = graphs.call, block, buffers

    def replay(self) -> None:
        self.buffers["hidden"].copy_(self.call(self.block, self.buffers))


class StandIn(BlockGraphs):
    """The replay path on the CPU: :meth:`_capture` gives a :class:`StandInGraph` (or fails for
    the blocks in ``refuse``)."""

    def __init__(self, refuse: frozenset[int] = frozenset(), block_call=call, **kw) -> None:
        super().__init__(block_call, enabled=True, **kw)
        self.refuse = refuse
        self.captured: list[int] = []

    def applies(self, inputs) -> bool:
        return self.enabled

    def _capture(self, shape, index, block):
        if index in self.refuse:
            shape.failed.add(index)
            return None
        self.captured.append(index)
        graph = StandInGraph(self, block, shape.buffers)
        shape.graphs[index] = (block, graph)
        self.captures += 1
        return graph  # type: ignore[return-value]


def _inputs(rows: int, tokens: int, seed: int, mask: bool = False) -> dict[str, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    m = (torch.rand(rows, tokens, generator=g) > 0.3).float() if mask else None
    hidden, scale = torch.randn(rows, tokens, 8, generator=g), torch.randn(rows, 8, generator=g)
    return {"hidden": hidden, "scale": scale, "mask": m}


def _loop(blocks, inputs, start, stop) -> torch.Tensor:
    hidden = inputs["hidden"]
    with torch.no_grad():
        for block in blocks[start:stop]:
            hidden = call(block, {**inputs, "hidden": hidden})
    return hidden


BLOCKS = [Block(i) for i in range(5)]


def test_off_cuda_and_disabled_the_blocks_run_eagerly() -> None:
    assert block_graphs.BLOCK_GRAPHS is False  # off: measured no faster where the host keeps pace
    inputs = _inputs(2, 6, seed=1, mask=True)
    for graphs in (BlockGraphs(call), BlockGraphs(call, enabled=True)):  # the CPU: never replayed
        got = graphs.run(BLOCKS, inputs, 1, 4)
        assert torch.equal(got, _loop(BLOCKS, inputs, 1, 4)) and graphs.last_path == "eager"
        assert graphs.shapes == [] and graphs.captures == 0
    for graphs in (BlockGraphs(call), StandIn()):  # an empty piece: the hidden state as it came
        assert torch.equal(graphs.run(BLOCKS, inputs, 2, 2), inputs["hidden"]) and graphs.last_path == "none"


def test_pieces_replay_one_graph_a_block_and_interleaved_requests_keep_their_states() -> None:
    graphs = StandIn()
    a, b = _inputs(2, 6, seed=1), _inputs(2, 6, seed=2)  # one shape: one set of buffers
    want_a, want_b = _loop(BLOCKS, a, 0, 5), _loop(BLOCKS, b, 0, 5)
    a1 = graphs.run(BLOCKS, a, 0, 2)
    b1 = graphs.run(BLOCKS, b, 0, 3)
    a2 = graphs.run(BLOCKS, {**a, "hidden": a1}, 2, 5)
    b2 = graphs.run(BLOCKS, {**b, "hidden": b1}, 3, 5)
    assert torch.equal(a2, want_a) and torch.equal(b2, want_b)
    assert graphs.captured == [0, 1, 2, 3, 4] and graphs.graphs() == 5 and len(graphs.shapes) == 1
    assert graphs.last_path == "graph"
    before = a["hidden"].clone()
    out = graphs.run(BLOCKS, a, 0, 5)
    assert torch.equal(a["hidden"], before) and out.data_ptr() != a["hidden"].data_ptr()  # inputs untouched
    assert torch.equal(out, want_a) and graphs.captured == [0, 1, 2, 3, 4]  # replayed, not captured again


def test_each_shape_has_its_graphs_and_the_least_recently_used_is_dropped() -> None:
    graphs = StandIn(max_shapes=2)
    shapes = [_inputs(2, 6, seed=1), _inputs(1, 6, seed=2), _inputs(2, 6, seed=3, mask=True)]
    for inputs in shapes:
        assert torch.equal(graphs.run(BLOCKS, inputs, 0, 2), _loop(BLOCKS, inputs, 0, 2))
    assert graphs.shapes == [shape_key(shapes[1]), shape_key(shapes[2])]  # the first dropped
    assert graphs.captures == 6 and graphs.graphs() == 4
    graphs.run(BLOCKS, shapes[1], 0, 1)  # now the most recently used
    graphs.run(BLOCKS, shapes[0], 0, 1)  # back: captured anew, dropping the masked shape
    assert graphs.shapes == [shape_key(shapes[1]), shape_key(shapes[0])] and graphs.captures == 7
    graphs.drop()
    assert graphs.shapes == [] and graphs.graphs() == 0
    assert shape_key(shapes[0]) != shape_key({**shapes[0], "hidden": shapes[0]["hidden"].double()})
    with pytest.raises(ValueError, match="max_shapes"):
        BlockGraphs(call, max_shapes=0)


def test_a_swapped_module_is_captured_anew_and_a_refused_capture_stays_eager() -> None:
    graphs = StandIn(refuse=frozenset({1}))
    inputs = _inputs(2, 6, seed=4)
    assert torch.equal(graphs.run(BLOCKS, inputs, 0, 3), _loop(BLOCKS, inputs, 0, 3))
    assert graphs.captured == [0, 2] and graphs.last_path == "mixed"
    other = [BLOCKS[0], Block(9), Block(10)]  # a model swapped in at indices 1 and 2
    assert torch.equal(graphs.run(other, inputs, 0, 3), _loop(other, inputs, 0, 3))
    assert graphs.captured == [0, 2, 2]  # index 1 stays eager at this shape; 2 is a new module


def test_bad_pieces_are_refused() -> None:
    graphs = BlockGraphs(call)
    inputs = _inputs(1, 4, seed=5)
    with pytest.raises(ValueError, match="out of 0:5"):
        graphs.run(BLOCKS, inputs, 3, 6)
    with pytest.raises(ValueError, match="out of 0:5"):
        graphs.run(BLOCKS, inputs, 3, 2)
    with pytest.raises(ValueError, match="'hidden'"):
        graphs.run(BLOCKS, {**inputs, "hidden": None}, 0, 1)


def test_the_zimage_denoisers_pieces_go_through_its_block_graphs(zimage_dir: Path) -> None:
    """The denoiser's pieces through the stand-in replays: bitwise its eager pieces."""
    den = load_zimage(zimage_dir, device="cpu")
    shape = Shape(width=32, height=32)
    latents = den.init_latents(shape, gens([1, 2]))
    sampler = den.sampler(shape, 2)
    conditions = den.encode(["a red fox", "the sea at night"])
    whole = den.predict(latents, 0, sampler, conditions, "cond")
    den.block_graphs = StandIn(block_call=zimage._layer_call)
    state = den.start(latents, 0, sampler, conditions, "cond")
    for block in range(den.num_blocks):
        state = den.run_blocks(state, block, block + 1)
    assert torch.equal(den.finish(state), whole)
    assert den.block_graphs.captured == list(range(den.num_blocks))
