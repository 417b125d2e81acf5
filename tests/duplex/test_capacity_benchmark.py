"""benchmarks/duplex_capacity.py's CPU smoke run (tiny config): every level measured, the tables
and the summary printed."""

from __future__ import annotations

import re
from collections.abc import Iterator
from types import ModuleType

import pytest

from tests.scripts import benchmark_module


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    with benchmark_module("duplex_capacity.py", "duplex_capacity") as module:
        yield module


def test_cpu_smoke_measures_every_level_and_prints_the_tables(bench, capsys):
    argv = ["--config", "tiny", "--device", "cpu", "--sessions", "1", "3", "--frames", "6", "40"]
    assert bench.main([*argv, "--ticks", "2", "--warmup", "1", "--modes", "graphs", "eager"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (auto|fp8) \| (\d+) \| (\d+) \| (\d+) \| (graphs|eager) \|(.*)$", out, re.M)
    assert len(rows) == 2 * 2 * 2 * 2  # KV storages x lengths x session levels x modes
    for kv, frames, window, n, mode, rest in rows:
        cells = [c.strip() for c in rest.split("|") if c.strip()]
        assert frames == window and len(cells) == 7, (kv, frames, n, mode, rest)
        assert all(float(c) > 0 for c in cells)  # six times and the ratio against eager
    assert "Memory per session" in out and out.count("| 3000 | 4.0 |") == 1
    # the summary: the largest level under 80 ms (timing on a shared CPU: any level, or none)
    assert re.search(r"^- fp8 KV, 40 frames, graphs: (1|3|none)$", out, re.M)
    assert re.search(r"^- 32 sessions, p99 < 35 ms: not measured$", out, re.M)


def test_levels_that_do_not_fit_are_marked(bench, capsys):
    argv = ["--config", "tiny", "--device", "cpu", "--sessions", "1", "2", "--frames", "8", "--ticks", "1"]
    # the CPU run sizes against the H200's 139 GiB: a reserve above it leaves no room for a slot
    assert bench.main([*argv, "--modes", "eager", "--kv-dtypes", "fp8", "--reserve-gib", "200"]) == 0
    out = capsys.readouterr().out
    assert out.count("does not fit (0 slots") == 2
    assert "- fp8 KV, 8 frames, eager: none" in out
    assert bench.fit_slots(per_slot=10, free=100, reserve=85) == 1
