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
from collections.abc import Iterator
from contextlib import contextmanager

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
    if type(value).__name__ == "TensorDescriptor":  # triton.tools.tensor_descriptor's, for TMA loads
        block = ", ".join(str(int(b)) for b in value.block_shape)  # type: ignore[attr-defined]
        return f"tensordesc<{_DTYPES[value.base.dtype]}[{block}]>"  # type: ignore[attr-defined]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    return None


def _divisible(value: object) -> bool:
    """Whether a GPU launch would tell the compiler that ``value`` is a multiple of 16 (a tensor's
    address in bytes, an integer argument)."""
    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


def spec_of(fn, args: tuple, kwargs: dict) -> dict | None:
    """The compile spec of a launch of ``fn`` as the GPU launch specialises it: constants, an
    integer argument of 1 as a constant, the arguments divisible by 16 (``attrs``), and the
    launch options; None for a launch the spec cannot carry."""
    names = list(inspect.signature(fn).parameters.values())
    bound = dict(zip([p.name for p in names], args, strict=False))
    bound.update({k: v for k, v in kwargs.items() if k not in OPTIONS})
    signature: dict[str, str] = {}
    constants: dict[str, object] = {}
    attrs: list[int] = []
    for index, param in enumerate(names):
        value = bound.get(param.name, param.default)
        if "constexpr" in str(param.annotation) or value is None:
            value = GPU_VALUES.get(param.name, value)
            if not isinstance(value, (bool, int, float, str, type(None))):
                return None  # a constant the spec cannot carry
            signature[param.name] = "constexpr"
            constants[param.name] = value
        elif isinstance(value, int) and not isinstance(value, bool) and value == 1:
            signature[param.name] = "constexpr"  # as Triton specialises an argument of 1
            constants[param.name] = 1
        else:
            kind = _type(value)
            if kind is None:
                return None
            signature[param.name] = kind
            if _divisible(value):
                attrs.append(index)
    options = {k: kwargs[k] for k in OPTIONS if k in kwargs}
    return {"signature": signature, "constants": constants, "attrs": attrs, "options": options}


#: Specs of the launches made inside :func:`capture` blocks (innermost last).
_CAPTURES: list[list[tuple[str, str, dict]]] = []


@contextmanager
def capture() -> Iterator[list[tuple[str, str, dict]]]:
    """The ``(module, kernel, spec)`` of every launch made in the block (under the interpreter)."""
    launches: list[tuple[str, str, dict]] = []
    _CAPTURES.append(launches)
    try:
        yield launches
    finally:
        _CAPTURES.remove(launches)


def record(fn, args: tuple, kwargs: dict) -> None:
    """Notes a launch of the kernel ``fn`` (the Python function under ``@triton.jit``)."""
    spec = spec_of(fn, args, kwargs)
    if spec is None:
        return
    for launches in _CAPTURES:
        launches.append((fn.__module__, fn.__name__, spec))
    constants = spec["constants"]
    key = (fn.__module__, fn.__name__)
    covered = _COVERED.setdefault(key, set())
    pairs = {(name, repr(value)) for name, value in constants.items()}
    if not pairs <= covered or key not in RECORDED:
        covered.update(pairs)
        RECORDED.setdefault(key, []).append(spec)


_COMPILER = r"""
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

asm, failures = [], []
wanted = sys.argv[1:] == ["asm"]
for module, name, spec in json.load(sys.stdin):
    fn = getattr(importlib.import_module(module), name)
    attrs = {(i,): [["tt.divisibility", 16]] for i in spec.get("attrs", ())}
    source = ASTSource(fn=fn, signature=spec["signature"], constexprs=spec["constants"], attrs=attrs)
    try:
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=spec["options"])
        asm.append({"ttgir": kernel.asm["ttgir"], "ptx": kernel.asm["ptx"]} if wanted else {})
    except Exception as error:  # the compiler's message is the finding
        asm.append({})
        failures.append(f"{module}.{name} {spec['constants']}: {type(error).__name__}: {str(error)[-1500:]}")
print(json.dumps({"failures": failures, "asm": asm}))
"""


def _compile(specs: list, asm: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILER, *(["asm"] if asm else [])], input=json.dumps(specs),
        capture_output=True, text=True, env=env, timeout=1200, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        return {"failures": [f"the compiler process failed ({done.returncode}): {done.stderr[-3000:]}"]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def compile_recorded() -> list[str]:
    """Compiles every recorded spec for ``cuda:90`` in a fresh process; the failures' messages."""
    specs = [(module, name, spec) for (module, name), kept in RECORDED.items() for spec in kept]
    return _compile(specs, asm=False)["failures"]


def assembly(launches: list[tuple[str, str, dict]]) -> list[dict[str, str]]:
    """The TTGIR and PTX (``{"ttgir": ..., "ptx": ...}``) of each captured launch compiled for
    ``cuda:90`` (:func:`capture`); AssertionError with the compiler's messages if one fails."""
    done = _compile(launches, asm=True)
    assert not done["failures"], "\n\n".join(done["failures"])
    return done["asm"]
