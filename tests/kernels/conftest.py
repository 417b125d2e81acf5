"""The kernel tests need Triton (a dependency on Linux x86-64): skipped without it locally, a
failure under CI (``CI`` set), where a green run must mean they ran. Tests that launch a kernel on
CPU tensors carry ``interpreted`` (they need ``TRITON_INTERPRET=1``, which tests/conftest.py sets
on a machine without a GPU; on a GPU machine tests/gpu covers the kernels)."""

from __future__ import annotations

import os

import pytest

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - depends on the install
    if os.environ.get("CI"):
        raise
    collect_ignore_glob = ["test_*.py"]

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="kernels on CPU tensors need TRITON_INTERPRET=1"
)
