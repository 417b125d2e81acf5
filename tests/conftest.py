"""Set-up for the whole test session.

Without a GPU the Triton kernels of ``kernels/`` run on the CPU under Triton's interpreter
(``TRITON_INTERPRET=1``, fp32), which must be set before any kernel module is imported: the
kernel tests in ``tests/kernels`` call the kernels directly. The dispatchers never hand CPU
tensors to a kernel, so nothing else runs interpreted.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _record_interpreted_launches() -> None:
    """Every kernel launch the interpreter runs is noted (``tests/kernels/sm90.py``), so that
    ``tests/kernels/test_zz_sm90.py`` can compile what the session launched for the H200."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # no Triton: nothing is launched
        return
    from tests.kernels import sm90

    run = InterpretedFunction.run

    def recorded(self, *args, grid, warmup, **kwargs):
        sm90.record(self.fn, args, kwargs)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recorded


if os.environ.get("TRITON_INTERPRET") == "1":
    _record_interpreted_launches()
