"""The cuDNN graph plumbing the kernels share (``kernels/cudnn_graphs.py``): the plan cache keeps
built plans by shape (least recently used dropped), remembers a shape whose build raised and does
not build it again; the front end loads or says None."""

from __future__ import annotations

import logging
import os
import sys

import pytest
import torch
from omnirt.kernels import cudnn_graphs


def test_the_plan_cache_builds_once_keeps_the_newest_and_remembers_declines(caplog):
    cache: cudnn_graphs.PlanCache[str] = cudnn_graphs.PlanCache(2, "a test graph")
    built = []

    def build(name: str):
        def make() -> str:
            built.append(name)
            if name == "bad":
                raise RuntimeError("CUDNN_STATUS_NOT_SUPPORTED_LAYOUT")
            return f"plan {name}"

        return make

    assert cache.get("a", build("a")) == "plan a" and cache.get("a", build("a")) == "plan a"
    with caplog.at_level(logging.WARNING, logger="omnirt.kernels.cudnn_graphs"):
        assert cache.get("bad", build("bad")) is None
        assert cache.get("bad", build("bad")) is None
    assert built == ["a", "bad"] and cache.declined == {"bad"}
    (record,) = caplog.records  # once
    assert record.getMessage() == (
        "cuDNN declined a test graph bad (CUDNN_STATUS_NOT_SUPPORTED_LAYOUT); "
        "the caller's own path runs there"
    )
    cache.get("b", build("b"))
    cache.get("a", build("a"))  # a used again: b is now the oldest
    cache.get("c", build("c"))
    assert len(cache) == 2 and cache["a"] == "plan a" and cache["c"] == "plan c"
    assert cache.get("b", build("b")) == "plan b" and built[-1] == "b"  # dropped, so built again


def test_the_front_end_loads_or_is_none(monkeypatch):
    """The front end where it is installed (CI installs the ``cudnn`` extra, so there it must
    load); None, not an error, where it cannot be imported."""
    cudnn = cudnn_graphs.frontend()
    if os.environ.get("CI"):
        assert cudnn is not None
    assert cudnn is None or hasattr(cudnn, "pygraph")
    monkeypatch.setitem(sys.modules, "cudnn", None)  # an import of it raises ImportError
    assert cudnn_graphs.frontend() is None


def test_the_fastest_plan_is_kept_and_failing_plans_are_passed_over(monkeypatch):
    """``fastest_plan`` times the first ``limit`` plans and keeps the fastest with a workspace of
    its size; a plan that raises is passed over; none running raises."""

    class Graph:
        sizes = [16, 0, 32, 8, 64]

        def get_execution_plan_count(self) -> int:
            return len(self.sizes)

        def get_workspace_size_plan_at_index(self, index: int) -> int:
            return self.sizes[index]

    times = {0: 3.0, 1: None, 2: 1.5, 3: 2.0, 4: 0.5}  # plan 1 fails; 4 is past the limit

    def time_plan(cudnn, graph, pack, workspace, index, handle, repeats):
        assert workspace.numel() == Graph.sizes[index]
        if times[index] is None:
            raise RuntimeError("CUDNN_STATUS_EXECUTION_FAILED")
        return times[index]

    monkeypatch.setattr(cudnn_graphs, "time_plan", time_plan)
    cpu = torch.device("cpu")
    index, workspace, ms = cudnn_graphs.fastest_plan(None, Graph(), {}, None, cpu, 4)
    assert (index, workspace.numel(), ms) == (2, 32, 1.5)
    assert cudnn_graphs.fastest_plan(None, Graph(), {}, None, cpu, 5)[0] == 4
    # ``accept`` (here: refusing the fastest plan's output) passes plans over
    ran = []
    accepted = lambda: ran.append(1) or len(ran) != 2  # noqa: E731  (the second plan that ran: plan 2)
    assert cudnn_graphs.fastest_plan(None, Graph(), {}, None, cpu, 4, accept=accepted)[:1] == (3,)
    times.update({0: None, 2: None, 3: None})
    with pytest.raises(RuntimeError, match="no execution plan"):
        cudnn_graphs.fastest_plan(None, Graph(), {}, None, cpu, 4)
    times.update({3: 2.0})
    with pytest.raises(RuntimeError, match="accepted"):
        cudnn_graphs.fastest_plan(None, Graph(), {}, None, cpu, 4, accept=lambda: False)
