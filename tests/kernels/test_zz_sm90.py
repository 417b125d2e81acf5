"""The kernels that this session's CPU tests launched under the interpreter compile for the H200
(``cuda:90``), with the compile-time constants the tests gave them (``tests/kernels/sm90.py``).
Named to run after the kernel tests of the suite; run alone it has nothing to compile (skipped,
or failed under CI, where the whole suite runs)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from . import sm90
from .conftest import interpreted

#: Kernels no CPU test launches, and why.
NOT_LAUNCHED_ON_CPU = {
    "_ring_attention_kernel": "the Mimi ring attention runs its torch chain on the CPU (tests/gpu)",
    "_ring_attention_dot_kernel": "the Mimi ring attention runs its torch chain on the CPU (tests/gpu)",
}


def _kernels() -> set[str]:
    """Every ``@triton.jit`` function of ``kernels/`` whose name ends in ``_kernel``."""
    root = Path(__file__).resolve().parents[2] / "kernels"
    found = set()
    for path in root.glob("*.py"):
        found.update(re.findall(r"@triton\.jit\s+def (\w+_kernel)\(", path.read_text()))
    return found


@interpreted
def test_every_launched_kernel_compiles_for_the_h200():
    launched = {name for _, name in sm90.RECORDED}
    if not launched:
        if os.environ.get("CI"):
            pytest.fail("no kernel launch was recorded: the kernel tests did not run before this one")
        pytest.skip("run with the kernel tests (tests/kernels, tests/diffusion): nothing was launched")
    failures = sm90.compile_recorded()
    assert not failures, "\n\n".join(failures)
    if os.environ.get("CI"):  # the whole suite ran: every kernel was launched on the CPU
        missing = _kernels() - launched - set(NOT_LAUNCHED_ON_CPU)
        assert not missing, f"kernels no CPU test launched: {sorted(missing)}"
