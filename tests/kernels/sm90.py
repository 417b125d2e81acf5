"""Every Triton kernel the CPU tests launch under the interpreter, compiled for the H200 (sm_90).

Triton's interpreter runs a kernel's Python body with NumPy: it accepts code that the compiler
refuses (a loop variable that changes its integer width, say) and never builds the GPU path of a
kernel. :func:`record` notes each kernel launch of the session (its arguments' types and its
compile-time constants, at most :data:`PER_KERNEL` distinct sets of constants a kernel) and
:func:`compile_recorded` compiles them all for ``cuda:90`` in a fresh process without
``TRITON_INTERPRET`` (Triton's compiler and ``ptxas`` need no GPU), so a compile error shows up in
CI rather than on the lent GPU. Constants that select the interpreter's stand-in for a GPU path
(``LIBDEVICE``) are compiled with the GPU's value.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import torch

#: Constants whose interpreter value stands in for a GPU path: the value the GPU launch passes.
GPU_VALUES = {"LIBDEVICE": True}
#: Launch options passed on to the compiler.
OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion", "enable_reflect_ftz")

_DTYPES = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
    torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5",
}  # fmt: skip

#: (module, kernel) -> the specs recorded for it.
RECORDED: dict[tuple[str, str], list[dict]] = {}
#: (module, kernel) -> the (constant, value) pairs its kept specs cover.
_COVERED: dict[tuple[str, str], set[tuple[str, object]]] = {}


def _type(value: object) -> str | None:
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    return None


def record(fn, args: tuple, kwargs: dict) -> None:
    """Notes a launch of the kernel ``fn`` (the Python function under ``@triton.jit``)."""
    names = list(inspect.signature(fn).parameters.values())
    bound = dict(zip([p.name for p in names], args, strict=False))
    bound.update({k: v for k, v in kwargs.items() if k not in OPTIONS})
    signature: dict[str, str] = {}
    constants: dict[str, object] = {}
    for param in names:
        value = bound.get(param.name, param.default)
        if "constexpr" in str(param.annotation) or value is None:
            value = GPU_VALUES.get(param.name, value)
            if not isinstance(value, (bool, int, float, str, type(None))):
                return  # a constant the spec cannot carry: not recorded
            signature[param.name] = "constexpr"
            constants[param.name] = value
        else:
            kind = _type(value)
            if kind is None:
                return
            signature[param.name] = kind
    options = {k: kwargs[k] for k in OPTIONS if k in kwargs}
    key = (fn.__module__, fn.__name__)
    covered = _COVERED.setdefault(key, set())
    pairs = {(name, repr(value)) for name, value in constants.items()}
    if not pairs <= covered or key not in RECORDED:
        covered.update(pairs)
        spec = {"signature": signature, "constants": constants, "options": options}
        RECORDED.setdefault(key, []).append(spec)


_COMPILER = r"""
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

failures = []
for module, name, spec in json.load(sys.stdin):
    fn = getattr(importlib.import_module(module), name)
    source = ASTSource(fn=fn, signature=spec["signature"], constexprs=spec["constants"])
    try:
        triton.compile(source, target=GPUTarget("cuda", 90, 32), options=spec["options"])
    except Exception as error:  # the compiler's message is the finding
        failures.append(f"{module}.{name} {spec['constants']}: {type(error).__name__}: {str(error)[-1500:]}")
print(json.dumps(failures))
"""


def compile_recorded() -> list[str]:
    """Compiles every recorded spec for ``cuda:90`` in a fresh process; the failures' messages."""
    specs = [(module, name, spec) for (module, name), kept in RECORDED.items() for spec in kept]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILER], input=json.dumps(specs), capture_output=True, text=True, env=env,
        timeout=1200, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        return [f"the compiler process failed ({done.returncode}): {done.stderr[-3000:]}"]
    return json.loads(done.stdout.strip().splitlines()[-1])
