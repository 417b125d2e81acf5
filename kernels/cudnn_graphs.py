"""What the kernels built as cuDNN frontend graphs share (``fp8_attention``, ``cudnn_conv``): the
front end, loaded if it can be; one cuDNN handle per device; a graph built to its execution plans;
the fastest of a graph's first plans, timed on a call's tensors; and a cache of built plans per
shape that remembers the shapes cuDNN declined, so a caller asks once and then runs its own path
for them."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

import torch

log = logging.getLogger(__name__)

_handles: dict[int, Any] = {}
_handles_lock = threading.Lock()

P = TypeVar("P")


def frontend() -> Any | None:
    """The ``cudnn`` module (``nvidia-cudnn-frontend``, the ``cudnn`` extra), or None where it is
    not installed or has no libcudnn to load."""
    try:
        import cudnn
    except Exception:  # not installed, or no libcudnn to load
        return None
    return cudnn


def handle(cudnn: Any, device: int) -> Any:
    """The cuDNN handle of CUDA device ``device`` (one per device, made at the first call)."""
    with _handles_lock:
        made = _handles.get(device)
        if made is None:
            with torch.cuda.device(device):
                made = _handles[device] = cudnn.create_handle()
    return made


def build_plans(cudnn: Any, graph: Any, policy: Any = None, *, first: int = 0) -> None:
    """Validates ``graph`` and builds its execution plans (heuristics A, then the fallback list):
    cuDNN's first by default, or as ``policy`` says (``cudnn.build_plan_policy``), or with
    ``first``, each of the first ``first`` plans that builds (a plan that does not is left unbuilt:
    :func:`fastest_plan` passes over it). Raises where cuDNN declines the graph."""
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    if first > 0:
        build_first_plans(graph, first)
    elif policy is None:
        graph.build_plans()
    else:
        graph.build_plans(policy)


def build_first_plans(graph: Any, first: int) -> None:
    """Builds each of the first ``first`` execution plans of ``graph``, whose plans
    :func:`build_plans` has made (cuDNN makes a graph's plan list once: a graph built with
    cuDNN's first plan gets its others built here, for :func:`fastest_plan`); a plan that does not
    build, or is built already, is left as it is."""
    for index in range(min(graph.get_execution_plan_count(), first)):
        try:
            graph.build_plan_at_index(index)
        except Exception as error:  # this plan only
            log.debug("cuDNN plan %d not built: %s", index, error)


def fastest_plan(
    cudnn: Any, graph: Any, pack: dict[int, torch.Tensor], handle: Any, device: torch.device, limit: int,
    *, repeats: int = 3, accept: Callable[[], bool] | None = None,
) -> tuple[int, torch.Tensor, float]:  # fmt: skip
    """Of ``graph``'s built plans, the first ``limit`` timed on ``pack`` (:func:`time_plan`): the
    index of the fastest, a workspace for it and its milliseconds. Plans that fail to run are passed
    over, and so are those after whose run ``accept()`` (reading ``pack``'s output) says no; raises
    where none is left. Not while a CUDA graph is being captured (timing synchronizes)."""
    best: tuple[float, int, torch.Tensor] | None = None
    for index in range(min(graph.get_execution_plan_count(), limit)):
        try:
            size = graph.get_workspace_size_plan_at_index(index)
            workspace = torch.empty(size, dtype=torch.uint8, device=device)
            ms = time_plan(cudnn, graph, pack, workspace, index, handle, repeats)
        except Exception as error:  # a plan that was not built or does not run here
            log.debug("cuDNN plan %d passed over: %s", index, error)
            continue
        if accept is not None and not accept():
            log.debug("cuDNN plan %d passed over: its output was not accepted", index)
            continue
        if best is None or ms < best[0]:
            best = (ms, index, workspace)
    if best is None:
        raise RuntimeError("no execution plan of the graph ran" + (" and was accepted" if accept else ""))
    return best[1], best[2], best[0]


def time_plan(
    cudnn: Any, graph: Any, pack: dict[int, torch.Tensor], workspace: torch.Tensor, index: int, handle: Any,
    repeats: int,
) -> float:  # fmt: skip
    """Milliseconds of plan ``index`` on ``pack`` (:func:`time_ms`, on the current stream of the
    workspace's device)."""
    stream = torch.cuda.current_stream(workspace.device)
    cudnn.set_stream(handle, stream.cuda_stream)
    run = lambda: graph.execute_plan_at_index(pack, workspace, index, handle=handle)  # noqa: E731
    return time_ms(run, repeats, stream)


def time_ms(run: Callable[[], Any], repeats: int, stream: torch.cuda.Stream | None = None) -> float:
    """Milliseconds of ``run()``: a warm run, then the best of ``repeats``, each between CUDA events
    on ``stream`` (the current one by default)."""
    stream = stream or torch.cuda.current_stream()
    run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        run()
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end))
    return min(times)


class PlanCache(Generic[P]):
    """Built plans by shape, the least recently used dropped past ``limit``; a shape whose build
    raised is remembered as declined (:attr:`declined`) and not tried again."""

    def __init__(self, limit: int, what: str) -> None:
        self.limit = limit
        self.what = what
        self.declined: set[Hashable] = set()
        self._plans: OrderedDict[Hashable, P] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._plans)

    def __getitem__(self, shape: Hashable) -> P:
        return self._plans[shape]

    def get(self, shape: Hashable, build: Callable[[], P]) -> P | None:
        """The plan of ``shape``, built by ``build`` the first time; None where cuDNN declined it
        (``build`` raised: logged once, with the reason)."""
        with self._lock:
            plan = self._plans.get(shape)
            if plan is not None:
                self._plans.move_to_end(shape)
                return plan
            if shape in self.declined:
                return None
            try:
                plan = build()
            except Exception as error:  # cuDNN declines it
                self.declined.add(shape)
                log.warning("cuDNN declined %s %s (%s); the caller's own path runs there",
                            self.what, shape, error)  # fmt: skip
                return None
            self._plans[shape] = plan
            while len(self._plans) > self.limit:
                self._plans.popitem(last=False)
            return plan
