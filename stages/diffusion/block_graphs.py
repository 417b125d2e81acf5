"""CUDA graphs of a DiT's blocks, for the block pieces the scheduler runs.

An eager DiT block queues tens of kernels, each a Python call through its module, the fused
kernels' dispatchers and the launcher. With W8A8 layers the GPU's work per block shrinks and the
host's enqueue does not: on an H100 the fp8 Z-Image step took 61.5 ms replayed from one CUDA graph
and 88.8 ms run eagerly (the host's pace; ``docs/benchmarks.md``, 2026-12-07). Replaying each block
from a graph takes the host out of the step. Where the host keeps pace it gains nothing (the
measurement under :data:`BLOCK_GRAPHS`), so it is off by default.

:class:`BlockGraphs` keeps, per *shape* (the inputs' shapes, dtypes and device, and which are
None), static input buffers and one graph per block, captured the first time a piece reaches that
block at that shape: a warm-up call of the block on a side stream (it compiles what a first call
compiles), then the capture, whose last operation writes the block's output over the static
hidden state. So the graphs of one shape chain through one buffer. A piece (:meth:`run`) copies
the caller's inputs into the buffers, replays its blocks in order and returns a copy of the
hidden state: requests of one shape interleave their pieces, so nothing of one request stays in
the buffers between pieces.

The graphs of all shapes share one memory pool (they never run at the same time). At most
``max_shapes`` shapes are kept; the least recently used one is dropped for a new one. Off CUDA,
when disabled, or for a block whose capture failed, the blocks run eagerly: the same call, the
same arithmetic (a replay gives the bits of the eager call at the same shape).

What a shape's first piece costs: each of its blocks runs twice more (the warm-up and, captured,
not run), and each capture synchronises the device and collects garbage (``torch.cuda.graph``).
The scheduler's piece costs (``pieces.py``, a moving average) take that first measurement in and
size the next pieces smaller until it decays; a realtime frame may wait behind such a piece once
per new shape. A Z-Image request's shape is its size, its batch and its prompts' padded length.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..graphs import capture_graph

log = logging.getLogger(__name__)

#: Whether the denoisers replay their block pieces from graphs. Off: on an H100 whose host kept
#: pace with the eager launches, the replay was bitwise but no faster, 0.92-0.96x in fp8 and
#: 0.97-1.02x in bf16 (``benchmarks/block_graphs.py``, ``docs/benchmarks.md``, 2026-12-07 08:09).
#: It pays only where the host is too slow for the eager step. A denoiser's
#: ``block_graphs.enabled`` switches it at any time (``--no-cuda-graphs`` keeps it off).
BLOCK_GRAPHS = False

#: ``block(module, inputs) -> new hidden``: how the model calls one of its blocks, with the hidden
#: state under ``"hidden"`` and the rest of what the blocks take under names of their own.
BlockCall = Callable[[torch.nn.Module, Mapping[str, Tensor | None]], Tensor]

ShapeKey = tuple[tuple[str, tuple[int, ...] | None, torch.dtype | None, str | None], ...]


def shape_key(inputs: Mapping[str, Tensor | None]) -> ShapeKey:
    """What a block's graph is specific to: each input's shape, dtype and device (None for None)."""
    return tuple(
        (name, None, None, None) if t is None else (name, tuple(t.shape), t.dtype, str(t.device))
        for name, t in sorted(inputs.items())
    )


@dataclass
class _Shape:
    buffers: dict[str, Tensor | None]
    #: block index -> (the module captured, its graph); a graph of another module is not replayed
    graphs: dict[int, tuple[torch.nn.Module, torch.cuda.CUDAGraph]] = field(default_factory=dict)
    failed: set[int] = field(default_factory=set)  # blocks that run eagerly at this shape


class BlockGraphs:
    """Per-block CUDA graphs of ``blocks`` (see the module docstring)."""

    def __init__(
        self,
        call: BlockCall,
        *,
        max_shapes: int = 4,
        enabled: bool | None = None,
    ) -> None:
        if max_shapes < 1:
            raise ValueError(f"max_shapes must be at least 1, got {max_shapes}")
        self.call = call
        self.max_shapes = max_shapes
        self.enabled = BLOCK_GRAPHS if enabled is None else enabled
        self._shapes: OrderedDict[ShapeKey, _Shape] = OrderedDict()
        self._pool: object | None = None
        #: How the last :meth:`run` ran its blocks: ``"graph"``, ``"eager"``, ``"mixed"``, or
        #: ``"none"`` for an empty piece.
        self.last_path = ""
        self.captures = 0  # blocks captured, over every shape (dropped ones too)

    @property
    def shapes(self) -> list[ShapeKey]:
        """The shapes with buffers, least recently used first."""
        return list(self._shapes)

    def graphs(self) -> int:
        """Graphs held, over every shape kept."""
        return sum(len(s.graphs) for s in self._shapes.values())

    def applies(self, inputs: Mapping[str, Tensor | None]) -> bool:
        hidden = inputs.get("hidden")
        return (
            self.enabled
            and hidden is not None
            and hidden.device.type == "cuda"
            and all(t is None or t.device == hidden.device for t in inputs.values())
        )

    def drop(self) -> None:
        """Forgets every shape's graphs and buffers (the next piece captures anew)."""
        self._shapes.clear()

    def run(
        self,
        blocks: Sequence[torch.nn.Module],
        inputs: Mapping[str, Tensor | None],
        start: int,
        stop: int,
    ) -> Tensor:
        """``blocks[start:stop]`` over ``inputs`` (``"hidden"`` and the rest): the new hidden state,
        a tensor of the caller's own. A block is known by its index and its module: where another
        module stands at an index (a model swapped in), it is captured anew."""
        if not 0 <= start <= stop <= len(blocks):
            raise ValueError(f"blocks {start}:{stop} out of 0:{len(blocks)}")
        if "hidden" not in inputs or inputs["hidden"] is None:
            raise ValueError("a block piece needs its hidden state under 'hidden'")
        if not self.applies(inputs):
            self.last_path = "eager" if stop > start else "none"
            return self._eager(blocks[start:stop], dict(inputs))
        shape = self._shape(inputs)
        for name, tensor in inputs.items():
            buffer = shape.buffers[name]
            if tensor is not None and buffer is not None:
                buffer.copy_(tensor)
        hidden = shape.buffers["hidden"]
        assert hidden is not None
        paths = set()
        for index in range(start, stop):
            block = blocks[index]
            module, graph = shape.graphs.get(index, (None, None))
            if module is not block:
                graph = None if index in shape.failed else self._capture(shape, index, block)
            if graph is None:
                hidden.copy_(self.call(block, shape.buffers))
                paths.add("eager")
            else:
                graph.replay()
                paths.add("graph")
        self.last_path = paths.pop() if len(paths) == 1 else ("mixed" if paths else "none")
        return hidden.clone()

    def _eager(self, blocks: Sequence[torch.nn.Module], inputs: dict[str, Tensor | None]) -> Tensor:
        with torch.no_grad():
            for block in blocks:
                inputs["hidden"] = self.call(block, inputs)
        hidden = inputs["hidden"]
        assert hidden is not None
        return hidden

    def _shape(self, inputs: Mapping[str, Tensor | None]) -> _Shape:
        key = shape_key(inputs)
        shape = self._shapes.get(key)
        if shape is not None:
            self._shapes.move_to_end(key)
            return shape
        while len(self._shapes) >= self.max_shapes:
            old, _ = self._shapes.popitem(last=False)
            log.info("dropped the block graphs of the least recently used shape %s", _describe(old))
        buffers = {name: None if t is None else t.clone() for name, t in inputs.items()}
        shape = _Shape(buffers)
        self._shapes[key] = shape
        return shape

    def _capture(self, shape: _Shape, index: int, block: torch.nn.Module) -> torch.cuda.CUDAGraph | None:
        """Warms ``block`` up on the shape's buffers, then captures it as block ``index``; None (and
        the index stays eager at this shape) when the capture fails."""
        buffers = shape.buffers
        hidden = buffers["hidden"]
        assert hidden is not None
        try:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            # The warm-up leaves the buffers as they were; the captured call's last operation
            # writes the block's output over the hidden one.
            graph, _ = capture_graph(
                lambda: hidden.copy_(self.call(block, buffers)),
                self._pool,
                warm=lambda: self.call(block, buffers),
                device=hidden.device,
                capture_error_mode="thread_local",
            )
        except Exception:  # noqa: BLE001 - a block that cannot be captured runs eagerly
            log.warning("block %d could not be captured at %s: it runs eagerly", index, exc_info=True)
            shape.failed.add(index)
            return None
        shape.graphs[index] = (block, graph)
        self.captures += 1
        return graph


def _describe(key: ShapeKey) -> str:
    return ", ".join(f"{name} {list(shape) if shape is not None else None}" for name, shape, _, _ in key)
