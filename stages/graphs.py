"""CUDA-graph capture and replay of a step function, one graph per batch-size bucket.

API
---
A *step* is any function ``step(inputs: dict[str, Tensor]) -> dict[str, Tensor]`` whose inputs
all share the leading (batch) dimension and whose outputs have it too. Typical steps advance
preallocated per-slot state in place (``state[:batch]`` views, so addresses never change) and
take an exec mask among their inputs.

``runner = CudaGraphRunner(step, make_inputs, buckets=(1, 8, 32), enabled=True)``

* ``make_inputs(batch) -> dict[str, Tensor]``: example inputs for one bucket. They become the
  graph's static input buffers, and the step runs on them during warm-up and capture, so they
  must leave any state unchanged (an exec mask of all False, for slot-pooled steps).
* ``runner.capture()``: at start-up, for each bucket (largest first, one shared memory pool):
  ``warmup`` eager runs on a side stream, then one capture. Does nothing when disabled or when
  the inputs are not on a CUDA device.
* ``runner(inputs)``: with ``b`` rows, picks the smallest captured bucket ``>= b``. If the
  per-row shapes, dtypes and device match that bucket's static inputs, it copies the inputs in
  (rows ``b..bucket-1`` zero-filled: False in a bool exec mask, so padded rows stay idle),
  replays the graph and returns the outputs' first ``b`` rows, cloned unless
  ``clone_outputs=False`` (then the views are overwritten by the next replay). Anything else
  (graphs disabled, no bucket large enough, other shapes) runs the step eagerly.
* ``pool``: a ``torch.cuda.graph_pool_handle()`` to share with other runners (graphs that
  never run at the same time can share one memory pool); by default the runner makes its own.
* ``runner.enabled = False`` switches graphs off at any time; ``runner.last_path`` says how the
  last call ran (``"graph"`` or ``"eager"``).
* ``capture_graph(call, pool)``: the capture sequence itself (warm-up on a side stream, then the
  capture), shared with the diffusion block pieces' graphs (``stages/diffusion/block_graphs.py``).
* ``prewarm(runners, workers)``: before the captures, one eager call of every runner's step at
  every bucket on ``workers`` threads: each step's first call at a bucket compiles its Triton
  kernels for that bucket's shapes, and a compile spends most of its time outside the GIL (LLVM,
  ``ptxas``), so the threads compile side by side what the captures would compile one after
  another on a machine whose Triton cache is empty.

The step must not sync with the host while captured (no ``.item()``, no Python branching on
tensor values, no device tensors used as sizes) and must draw random numbers, if any, from the
default CUDA generator. Replayed outputs equal eager outputs bitwise at the same bucket size;
an eager call with fewer rows than the bucket may differ in the last bits (other kernel
choices), so compare graph and eager at the same size.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import torch

log = logging.getLogger(__name__)

Step = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]

T = TypeVar("T")


def capture_graph(
    call: Callable[[], T],
    pool: object,
    *,
    warmup: int = 1,
    warm: Callable[[], object] | None = None,
    device: torch.device | None = None,
    capture_error_mode: str = "global",
) -> tuple[torch.cuda.CUDAGraph, T]:
    """The one capture sequence of the engine's graphs: ``warmup`` eager calls on a side stream
    (they compile and tune what a first call does, off the capturing stream), then one call
    captured into a new graph in ``pool``. Returns the graph and what the captured call returned
    (its static outputs, rewritten by each replay). ``warm``: what the warm-up calls, where it
    must differ from ``call`` (a captured call that updates state in place, warmed up by one that
    leaves it as it was); ``call`` by default. ``device``: the CUDA device to capture on
    (the current one by default). ``capture_error_mode``: as ``torch.cuda.graph`` takes it
    (``"thread_local"`` lets other threads keep running unsafe calls while this one captures)."""
    with torch.cuda.device(device):
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(warmup):
                (warm or call)()
        current.wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph, pool=pool, capture_error_mode=capture_error_mode):
            out = call()
        torch.cuda.synchronize()
    return graph, out


#: Batch sizes captured as CUDA graphs (those up to ``max_slots``, and ``max_slots`` itself).
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device`` without a host sync: on CUDA through pinned memory,
    copied in stream order (a plain ``.to(device)`` waits for every kernel queued before it)."""
    if device.type != "cuda":
        return host.to(device)
    # contiguous first: an expanded view (a RoPE index often is one) cannot be pinned as it is
    return host.contiguous().pin_memory().to(device, non_blocking=True)


def batch_buckets(max_slots: int) -> list[int]:
    return sorted({b for b in BATCH_BUCKETS if b < max_slots} | {max_slots})


def length_buckets(max_len: int, smallest: int = 256) -> list[int]:
    """Attention lengths to capture: powers of two from ``smallest`` below ``max_len``, then
    ``max_len`` itself (every length up to ``max_len`` falls in one)."""
    out, n = [], smallest
    while n < max_len:
        out.append(n)
        n *= 2
    return [*out, max_len]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]


def check_distinct(inputs: Mapping[str, torch.Tensor]) -> None:
    """Static inputs must not share a storage: each call copies every input into its buffer, so
    two names on one buffer would hand the graph the last one's values under both names."""
    seen: dict[int, str] = {}
    for name, tensor in inputs.items():
        if tensor.numel() == 0:
            continue
        other = seen.setdefault(tensor.untyped_storage().data_ptr(), name)
        if other != name:
            raise ValueError(f"make_inputs gave {other!r} and {name!r} one buffer; give each input its own")


def batch_size(tensors: Mapping[str, torch.Tensor]) -> int:
    """The shared leading dimension of ``tensors``; ValueError when they disagree or are empty."""
    if not tensors:
        raise ValueError("a step needs at least one input tensor")
    sizes = {name: t.shape[0] if t.dim() else None for name, t in tensors.items()}
    distinct = set(sizes.values())
    if None in distinct or len(distinct) != 1:
        raise ValueError(f"step inputs must share their leading (batch) dimension, got {sizes}")
    return distinct.pop()


class CudaGraphRunner:
    """Runs ``step`` through CUDA graphs captured per batch-size bucket (see module docstring)."""

    def __init__(
        self,
        step: Step,
        make_inputs: Callable[[int], dict[str, torch.Tensor]],
        buckets: Sequence[int],
        *,
        enabled: bool = True,
        warmup: int = 2,
        clone_outputs: bool = True,
        pool: object | None = None,
    ) -> None:
        if not buckets or any(b < 1 for b in buckets):
            raise ValueError(f"buckets must be positive batch sizes, got {list(buckets)}")
        self.step = step
        self.make_inputs = make_inputs
        self.buckets = sorted(set(int(b) for b in buckets))
        self.enabled = enabled
        self.warmup = warmup
        self.clone_outputs = clone_outputs
        self.last_path = ""
        self._graphs: dict[int, _Captured] = {}
        self._pool: object | None = pool

    @property
    def captured_buckets(self) -> list[int]:
        return sorted(self._graphs)

    @property
    def graphs(self) -> int:
        """Graphs captured."""
        return len(self._graphs)

    def capture(self, buckets: Sequence[int] | None = None) -> None:
        """Warm up and capture every bucket (or those of ``buckets``), largest first. No-op when
        disabled or off CUDA."""
        if not self.enabled or not torch.cuda.is_available():
            return
        wanted = self.buckets if buckets is None else [b for b in self.buckets if b in set(buckets)]
        for bucket in reversed(wanted):
            if bucket in self._graphs:
                continue
            inputs = self.make_inputs(bucket)
            if batch_size(inputs) != bucket:
                raise ValueError(f"make_inputs({bucket}) returned a batch of {batch_size(inputs)}")
            check_distinct(inputs)
            if any(t.device.type != "cuda" for t in inputs.values()):
                return
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            step = functools.partial(self.step, inputs)
            graph, outputs = capture_graph(step, self._pool, warmup=self.warmup)
            if batch_size(outputs) != bucket:
                raise ValueError(f"step outputs must keep the batch dimension ({bucket})")
            self._graphs[bucket] = _Captured(graph, inputs, outputs)

    def drop(self) -> None:
        """Forgets every captured graph (their memory goes back to the pool); :meth:`capture` then
        captures the step anew, as it is now (a benchmark's baseline with other kernels)."""
        self._graphs.clear()

    def warm_calls(self) -> list[Callable[[], None]]:
        """For :func:`prewarm`: one eager call of the step for each bucket not captured yet, on
        inputs of its own from ``make_inputs`` (which leave any state unchanged). None when
        disabled or off CUDA."""
        if not self.enabled or not torch.cuda.is_available():
            return []
        return [functools.partial(self._warm, b) for b in reversed(self.buckets) if b not in self._graphs]

    def _warm(self, bucket: int) -> None:
        inputs = self.make_inputs(bucket)
        devices = {t.device for t in inputs.values()}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            return
        with torch.cuda.device(next(iter(devices))), torch.no_grad():  # a thread's device is its own
            self.step(inputs)

    def bucket_for(self, batch: int) -> int | None:
        """The smallest captured bucket that holds ``batch`` rows, or None."""
        for bucket in self.captured_buckets:
            if bucket >= batch:
                return bucket
        return None

    def _matches(self, captured: _Captured, inputs: Mapping[str, torch.Tensor]) -> bool:
        if set(inputs) != set(captured.inputs):
            return False
        for name, tensor in inputs.items():
            static = captured.inputs[name]
            if (
                tensor.shape[1:] != static.shape[1:]
                or tensor.dtype != static.dtype
                or tensor.device != static.device
            ):
                return False
        return True

    def __call__(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        batch = batch_size(inputs)
        bucket = self.bucket_for(batch) if self.enabled else None
        captured = self._graphs.get(bucket) if bucket is not None else None
        if captured is None or not self._matches(captured, inputs):
            self.last_path = "eager"
            with torch.no_grad():
                return self.step(inputs)
        for name, tensor in inputs.items():
            static = captured.inputs[name]
            static[:batch].copy_(tensor, non_blocking=True)  # async from pinned host memory
            if batch < bucket:
                static[batch:].zero_()
        captured.graph.replay()
        self.last_path = "graph"
        if self.clone_outputs:
            return {name: out[:batch].clone() for name, out in captured.outputs.items()}
        return {name: out[:batch] for name, out in captured.outputs.items()}


class LengthBucketedRunner:
    """A step with a static length as well as a batch: one :class:`CudaGraphRunner` per length
    bucket (``step(inputs, length)`` and ``make_inputs(batch, length)`` with the bucket's
    length), all sharing one memory pool, so replaying any of them never clobbers another's
    persistent state.

    ``runner(inputs, length)`` runs the smallest bucket ``>= length`` (eager when graphs are off
    or nothing is captured for the shape). Graphs sharing a pool must never run concurrently,
    and their outputs should be views of persistent buffers (not of pool memory), since the
    next replay of another graph of the pool may reuse an earlier graph's temporaries; else
    ``clone_outputs=True``.
    """

    def __init__(
        self,
        step: Callable[[dict[str, torch.Tensor], int], dict[str, torch.Tensor]],
        make_inputs: Callable[[int, int], dict[str, torch.Tensor]],
        *,
        batch_buckets: Sequence[int],
        length_buckets: Sequence[int],
        enabled: bool = True,
        pool: object | None = None,
        clone_outputs: bool = False,
    ) -> None:
        if not length_buckets:
            raise ValueError("length_buckets must not be empty")
        self.lengths = sorted(set(int(n) for n in length_buckets))
        self.runners = {
            n: CudaGraphRunner(
                (lambda inputs, n=n: step(inputs, n)),
                (lambda batch, n=n: make_inputs(batch, n)),
                batch_buckets,
                enabled=enabled,
                clone_outputs=clone_outputs,
                pool=pool,
            )
            for n in self.lengths
        }
        self.last_path = ""

    @property
    def enabled(self) -> bool:
        return all(r.enabled for r in self.runners.values())

    @enabled.setter
    def enabled(self, value: bool) -> None:
        for runner in self.runners.values():
            runner.enabled = value

    @property
    def graphs(self) -> int:
        return sum(len(r.captured_buckets) for r in self.runners.values())

    def capture(self, batches: Sequence[int] | None = None, lengths: Sequence[int] | None = None) -> None:
        """Captures every (batch, length) bucket, or the given batch buckets at the length buckets
        holding ``lengths``."""
        wanted = self.lengths if lengths is None else sorted({self.length_for(n) for n in lengths})
        for n in wanted:
            self.runners[n].capture(batches)

    def drop(self) -> None:
        for runner in self.runners.values():
            runner.drop()

    def warm_calls(self) -> list[Callable[[], None]]:
        """:meth:`CudaGraphRunner.warm_calls` of every length bucket."""
        return [call for n in self.lengths for call in self.runners[n].warm_calls()]

    def length_for(self, length: int) -> int:
        for n in self.lengths:
            if n >= length:
                return n
        raise ValueError(f"attention length {length} exceeds the largest bucket {self.lengths[-1]}")

    def __call__(self, inputs: dict[str, torch.Tensor], length: int) -> dict[str, torch.Tensor]:
        runner = self.runners[self.length_for(length)]
        out = runner(inputs)
        self.last_path = runner.last_path
        return out


#: The most threads :func:`default_compile_workers` gives (the H200 machine's 16 cores measured).
MAX_COMPILE_WORKERS = 16


def default_compile_workers() -> int:
    """The start-up's :func:`prewarm` threads when none is asked for: the CPUs this process may
    use, at most :data:`MAX_COMPILE_WORKERS`. Measured on the H200 (docs/benchmarks.md, issue 9):
    a real-size speech pipeline of 256 slots on a cold Triton cache started in 116.3 s with 16
    against 128.9 s without, the same graphs captured (the GPU tests bitwise with 8)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    return min(cpus, MAX_COMPILE_WORKERS)


def prewarm(runners: Iterable[CudaGraphRunner | LengthBucketedRunner], workers: int) -> float:
    """Runs every runner's :meth:`~CudaGraphRunner.warm_calls` on ``workers`` threads and waits for
    them and the device; returns the seconds it took (0 with fewer than 2 workers or no calls).

    What it is for: a step's first call at a bucket compiles its Triton kernels for the bucket's
    shapes (tens of kernels, up to about 10 s each, for a real-size speech pipeline on a machine
    whose Triton cache is empty), and :meth:`CudaGraphRunner.capture` makes those calls one after
    another; here they overlap (the steps' GPU work still runs in one stream order). The calls
    compute on idle rows, as the captures' own warm-up does. A call that fails is logged and
    left to the capture, which makes it again and raises."""
    calls = [call for runner in runners for call in runner.warm_calls()]
    if workers < 2 or not calls:
        return 0.0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="omnirt-prewarm") as pool:
        futures = [pool.submit(call) for call in calls]
        for future in futures:
            error = future.exception()
            if error is not None:
                log.warning("a warm-up call before the capture failed (the capture retries it): %r", error)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the calls' activations, side by side, before the captures' pool
    seconds = time.perf_counter() - t0
    log.info("warmed %d steps on %d threads in %.1f s", len(calls), workers, seconds)
    return seconds
