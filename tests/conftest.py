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
