"""Per-slot streaming state shared by the codecs (``mimi``, ``code2wav``): many streams, one batch.

A streaming module declares its state as named buffers of shape ``[max_slots, ...]``. The
buffers are allocated once (``alloc_state``) and never reallocated: a slot is reset in place
when a stream starts, and a step on ``rows`` streams works on the views ``buffer[:rows]``. So
the tensors a captured CUDA graph reads and writes keep their addresses for the life of the
pool.

Every step takes an exec mask (bool, one per row). State moves forward only where the mask is
True (``commit``): a row without a new frame keeps its state bit for bit, whatever the other
rows do, and the batch keeps one shape.

Also the RoPE inverse frequencies both codecs' transformers use (:func:`rope_inv_freq`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class StateSpec:
    """One state buffer: per-slot shape, fill value on reset, dtype (None: the model dtype)."""

    shape: tuple[int, ...]
    fill: float | int | bool = 0
    dtype: torch.dtype | None = None


def rope_inv_freq(base: float, head_dim: int, device: torch.device | str | None = None) -> torch.Tensor:
    """RoPE inverse frequencies, float32, computed as transformers' default rope does."""
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim))


def commit(buffer: torch.Tensor, new: torch.Tensor, exec_mask: torch.Tensor) -> None:
    """Writes ``new`` into ``buffer`` (same shape) on the rows where ``exec_mask`` is True."""
    mask = exec_mask.view(-1, *([1] * (new.dim() - 1)))
    with torch.no_grad():  # state is not differentiable
        torch.where(mask, new.to(buffer.dtype), buffer, out=buffer)


class StreamingModule(nn.Module):
    """Base class of modules with per-slot state. Subclasses define ``state_specs``."""

    def __init__(self) -> None:
        super().__init__()
        self._state: dict[str, torch.Tensor] = {}
        self._specs: dict[str, StateSpec] = {}

    def state_specs(self) -> dict[str, StateSpec]:
        return {}

    def alloc_state(self, max_slots: int, device: torch.device, dtype: torch.dtype) -> None:
        self._specs = self.state_specs()
        self._state = {
            name: torch.full((max_slots, *spec.shape), spec.fill, dtype=spec.dtype or dtype, device=device)
            for name, spec in self._specs.items()
        }

    def reset_slot(self, slot: int) -> None:
        for name, spec in self._specs.items():
            self._state[name][slot].fill_(spec.fill)

    def state(self, name: str, rows: int) -> torch.Tensor:
        """The first ``rows`` slots of one state buffer (a view: writes go to the pool)."""
        try:
            buffer = self._state[name]
        except KeyError:
            raise RuntimeError(f"{type(self).__name__}: state not allocated (call alloc_state)") from None
        return buffer[:rows]

    def state_buffers(self) -> dict[str, torch.Tensor]:
        """The stream state (views of the buffers; scratch entries, if any, left out)."""
        return dict(self._state)


def streaming_modules(root: nn.Module) -> list[tuple[str, StreamingModule]]:
    """Every streaming submodule of ``root`` (itself included), with its qualified name."""
    return [(name, module) for name, module in root.named_modules() if isinstance(module, StreamingModule)]
