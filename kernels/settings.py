"""What the fused kernels of ``kernels/`` share: the numerics presets, the on/off setting, and where
a Triton kernel may run.

- **Presets.** ``exact`` reproduces the rounding points of the eager chain a kernel replaces (each
  intermediate rounded where eager rounds it, sums in eager's order, fused multiply-adds only
  where eager's machine code has them): bitwise equal to eager on the shapes its GPU tests cover.
  ``fast`` computes in fp32 from the loaded inputs to the stored outputs and rounds once.
- **Setting.** ``FUSED`` is ``"auto"`` (the kernels run where their ``exact`` preset is
  bitwise, which each kernel module names; elsewhere the eager chain runs), ``"on"`` (every
  supported call) or ``"off"``. ``omnirt serve --fused-kernels`` sets it.
- **The Wan VAE decoder's fast path** (``stages/diffusion/wan_vae_fast.py``): ``VAE_FAST`` is
  ``"exact"`` (bitwise equal to diffusers' decoder, channels-last convolutions; the default),
  ``"fast"`` (non-bitwise reorderings, within a stated PSNR: the top level's convolutions as 2D
  ones over their time taps) or
  ``"off"``. ``omnirt serve --vae-fast`` sets it.
- **FP8 attention** (``kernels/fp8_attention.py``): ``FP8_ATTENTION`` ``"on"`` (the default)
  runs the attention of the fp8 W8A8 DiT blocks as cuDNN's fp8 flash attention (queries, keys,
  values and probabilities in e4m3: not bitwise), where it applies (measured on an H100, Z-Image
  1024x1024: the fp8 step 68.8 ms against 72.2, the final image 44.4 dB PSNR against bf16 where
  bf16 attention gives 44.6); ``"off"`` keeps it in the model's dtype. ``omnirt serve
  --fp8-attention`` sets it.
- **Held rows.** ``HOLD_ROWS``: the row kernels that read a row more than once (its sum or peak,
  then its values: ``rms_norm.py``'s norms, ``w8a8.py``'s per-token quantization) read it from
  memory once where it fits the program's registers and keep it there; off, each pass reads it
  again. The same bits either way (a measured speed setting, not a numerics one). Off: on an
  H100 the held forms ran at 0.64-0.93x the speed of reading again, but for the plain modulated norm
  (docs/benchmarks.md, 2026-12-07); not measured on an H200.
- **Where.** A kernel runs on CUDA tensors with Triton importable; on the CPU only under
  ``TRITON_INTERPRET=1`` (:func:`interpreted`, fp32), when a test calls it directly or installs the
  VAE hooks on a CPU model itself, never from a dispatcher.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import torch

try:  # Triton ships with CUDA builds of torch only
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    HAVE_TRITON = False

Preset = Literal["exact", "fast"]
Fused = Literal["auto", "on", "off"]
PRESETS: tuple[Preset, ...] = ("exact", "fast")
FUSED_SETTINGS: tuple[Fused, ...] = ("auto", "on", "off")

FUSED: Fused = "auto"

VaeLevel = Literal["exact", "fast", "off"]
VAE_LEVELS: tuple[VaeLevel, ...] = ("exact", "fast", "off")
VAE_FAST: VaeLevel = "exact"

Fp8Attention = Literal["on", "off"]
FP8_ATTENTION_SETTINGS: tuple[Fp8Attention, ...] = ("on", "off")
FP8_ATTENTION: Fp8Attention = "on"

HOLD_ROWS = False

T = TypeVar("T")


def set_fused(setting: str) -> None:
    """Sets :data:`FUSED` (``auto``, ``on`` or ``off``)."""
    global FUSED
    if setting not in FUSED_SETTINGS:
        raise ValueError(f"fused kernels must be one of {', '.join(FUSED_SETTINGS)}, not {setting!r}")
    FUSED = setting  # type: ignore[assignment]


def check_vae_level(level: str) -> VaeLevel:
    if level not in VAE_LEVELS:
        raise ValueError(f"the VAE fast path must be one of {', '.join(VAE_LEVELS)}, not {level!r}")
    return level  # type: ignore[return-value]


def set_vae_fast(level: str) -> None:
    """Sets :data:`VAE_FAST` (``exact``, ``fast`` or ``off``)."""
    global VAE_FAST
    VAE_FAST = check_vae_level(level)


def set_fp8_attention(setting: str) -> None:
    """Sets :data:`FP8_ATTENTION` (``on`` or ``off``)."""
    global FP8_ATTENTION
    if setting not in FP8_ATTENTION_SETTINGS:
        choices = ", ".join(FP8_ATTENTION_SETTINGS)
        raise ValueError(f"fp8 attention must be one of {choices}, not {setting!r}")
    FP8_ATTENTION = setting  # type: ignore[assignment]


def check_preset(preset: str) -> Preset:
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)}, not {preset!r}")
    return preset  # type: ignore[return-value]


def kernel_device(*tensors: torch.Tensor | None) -> bool:
    """Whether the tensors can be handed to a compiled Triton kernel: Triton importable, all on one
    CUDA device."""
    present = [t for t in tensors if t is not None]
    if not HAVE_TRITON or not present or present[0].device.type != "cuda":
        return False
    return all(t.device == present[0].device for t in present)


def dispatch(op: Callable[..., T], impl: Callable[..., T], *args: Any) -> T:
    """A kernel's launch: through its custom op ``op`` while ``torch.compile`` traces (the op is
    what it can trace), else ``impl`` (the op's body) directly, which CUDA graphs capture just the
    same. The custom op's Python dispatch cost about 0.15 ms of host time a call on the H200
    machine (2026-12-03): a Z-Image step's 170 calls were a quarter of the time its host took to
    queue the step."""
    return op(*args) if torch.compiler.is_compiling() else impl(*args)


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``: CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def wanted(bitwise: bool) -> bool:
    """Whether :data:`FUSED` asks for a kernel whose ``exact`` preset is (or is not) bitwise on
    this chain."""
    return FUSED == "on" or (FUSED == "auto" and bitwise)
