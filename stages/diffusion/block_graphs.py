"""CUDA graphs of a DiT's main blocks, one graph per block, replayed in any run of consecutive blocks.

Eagerly a Z-Image block is about twenty launches from Python (its modules, the fused kernels, the
W8A8 quantization): at 1024x1024 on the H200 the host took about as long to queue a step as the
GPU to run it, so GPU savings did not show. Replaying one graph per block costs one launch.

The runtime runs a transformer call's blocks in pieces of any grouping (``run_blocks(state, a,
b)``), so each block is its own graph, and every graph of one input layout (the hidden states'
shape, the other inputs' shapes) reads and writes two shared buffers in turn: block ``i`` reads
``buffers[i % 2]`` and writes ``buffers[(i + 1) % 2]``. A run copies the hidden states in once,
replays its blocks and clones the result out once; the other inputs (RoPE table, timestep
embedding, mask) are copied into their own static buffers at the start of a run when they are not
already those. A block's graph is captured the first time it runs at a layout (a warm-up call on
a side stream, then the capture; the block's output this time comes from replaying it). All
graphs share one memory pool (they never run at the same time). At most ``max_layouts`` layouts
are kept (least recently used dropped).

Replay gives the eager bits (the same kernels on the same inputs). Anything a graph cannot
capture (a host sync in a block) switches the graphs off for good, with a warning, and the block
runs eagerly from then on. Off CUDA, or with ``enabled`` False, every run is eager.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

#: ``call(block, hidden, *extra) -> hidden``: how one block runs.
BlockCall = Callable[..., torch.Tensor]
Layout = tuple[object, ...]


def layout_of(hidden: torch.Tensor, extra: Sequence[torch.Tensor | None]) -> Layout:
    return (
        tuple(hidden.shape), hidden.dtype, hidden.device,
        tuple(None if t is None else (tuple(t.shape), t.dtype, t.stride()) for t in extra),
    )  # fmt: skip


@dataclass(eq=False)
class _LayoutGraphs:
    buffers: tuple[torch.Tensor, torch.Tensor]
    extra: tuple[torch.Tensor | None, ...]
    graphs: dict[int, torch.cuda.CUDAGraph] = field(default_factory=dict)


class BlockGraphs:
    """Runs ``blocks[start:stop]`` through per-block CUDA graphs (see the module docstring)."""

    def __init__(self, call: BlockCall, *, enabled: bool = True, max_layouts: int = 8) -> None:
        self.blocks: Sequence[torch.nn.Module] = ()
        self.call = call
        self.enabled = enabled
        self.max_layouts = max_layouts
        self.captures = 0
        self.last_path = ""
        self._layouts: collections.OrderedDict[Layout, _LayoutGraphs] = collections.OrderedDict()
        self._pool: object | None = None

    def drop(self) -> None:
        """Forgets every graph and buffer (a model's weights changed, or memory is wanted back)."""
        self._layouts.clear()

    def run(
        self,
        blocks: Sequence[torch.nn.Module],
        hidden: torch.Tensor,
        extra: Sequence[torch.Tensor | None],
        start: int,
        stop: int,
    ) -> torch.Tensor:
        """``hidden`` through ``blocks[start:stop]``; ``extra`` the blocks' other inputs. Graphs
        belong to one list of blocks: given another (a model swapped), they are dropped."""
        if blocks is not self.blocks:
            self.blocks = blocks
            self.drop()
        if not 0 <= start <= stop <= len(self.blocks):
            raise ValueError(f"blocks {start}:{stop} out of 0:{len(self.blocks)}")
        if start == stop:
            return hidden
        if not (self.enabled and hidden.is_cuda and torch.cuda.is_available()):
            return self._eager(hidden, extra, start, stop)
        key = layout_of(hidden, extra)
        graphs = self._layouts.get(key)
        if graphs is None:
            graphs = self._new_layout(key, hidden, extra)
        self._layouts.move_to_end(key)
        graphs.buffers[start % 2].copy_(hidden)
        for static, given in zip(graphs.extra, extra, strict=True):
            if static is not None and given is not None and static.data_ptr() != given.data_ptr():
                static.copy_(given)
        for index in range(start, stop):
            graph = graphs.graphs.get(index)
            if graph is None:
                graph = self._capture(graphs, index)
                if graph is None:  # not capturable: eager from here on
                    out = graphs.buffers[index % 2]
                    return self._eager(out.clone(), graphs.extra, index, stop)
            graph.replay()
        self.last_path = "graph"
        return graphs.buffers[stop % 2].clone()

    def _eager(
        self, hidden: torch.Tensor, extra: Sequence[torch.Tensor | None], start: int, stop: int
    ) -> torch.Tensor:
        self.last_path = "eager"
        for index in range(start, stop):
            hidden = self.call(self.blocks[index], hidden, *extra)
        return hidden

    def _new_layout(
        self, key: Layout, hidden: torch.Tensor, extra: Sequence[torch.Tensor | None]
    ) -> _LayoutGraphs:
        while len(self._layouts) >= self.max_layouts:
            self._layouts.popitem(last=False)
        buffers = (torch.empty_like(hidden), torch.empty_like(hidden))
        statics = tuple(
            None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
            for t in extra
        )
        graphs = _LayoutGraphs(buffers, statics)
        self._layouts[key] = graphs
        return graphs

    def _capture(self, graphs: _LayoutGraphs, index: int) -> torch.cuda.CUDAGraph | None:
        block = self.blocks[index]
        source, target = graphs.buffers[index % 2], graphs.buffers[(index + 1) % 2]
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), torch.no_grad():
                self.call(block, source, *graphs.extra)  # lazy initialisation, kernel compiles
            torch.cuda.current_stream().wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # thread_local: other threads (a speech prefill worker) may use CUDA meanwhile
            with torch.no_grad(), torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                target.copy_(self.call(block, source, *graphs.extra))
        except Exception as exc:  # a block that syncs with the host, or an op graphs refuse
            log.warning(
                "DiT block %d cannot be captured as a CUDA graph (%s): blocks run eagerly", index, exc
            )
            self.enabled = False
            self._layouts.clear()
            torch.cuda.synchronize()
            return None
        graphs.graphs[index] = graph
        self.captures += 1
        return graph
