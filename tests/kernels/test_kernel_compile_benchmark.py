"""``benchmarks/kernel_compile.py``: Triton compile times for sm_90 measured without a GPU."""

from __future__ import annotations

import pytest

from ..scripts import benchmark_module


def test_a_compile_is_timed_with_its_coalescing_pass():
    with benchmark_module("kernel_compile.py", "kernel_compile_bench") as bench:
        seconds, coalesce = bench.measure(bench.Case("draw", "test", 64, unroll=2), 90)
    assert seconds > 0
    assert coalesce is not None and 0 < coalesce < seconds


def test_a_kernel_that_does_not_compile_is_reported():
    with benchmark_module("kernel_compile.py", "kernel_compile_bench") as bench:
        with pytest.raises(RuntimeError, match="compiling draw"):
            bench.measure(bench.Case("draw", "for a target Triton has no backend for", 64), 10)


def test_bad_arguments_are_refused(capsys):
    with benchmark_module("kernel_compile.py", "kernel_compile_bench") as bench:
        for argv in (["--kernels", "draw,nope"], ["--repeats", "0"]):
            with pytest.raises(SystemExit):
                bench.main(argv)
    assert "--kernels are draw and group" in capsys.readouterr().err
