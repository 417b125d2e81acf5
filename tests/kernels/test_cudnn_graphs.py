"""The cuDNN graph plumbing the kernels share (``kernels/cudnn_graphs.py``): the plan cache keeps
built plans by shape (least recently used dropped), remembers a shape whose build raised and does
not build it again; the front end loads or says None."""

from __future__ import annotations

import logging
import os
import sys

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
