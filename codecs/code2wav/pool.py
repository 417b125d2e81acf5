"""A fixed pool of code2wav streams: preallocated state, static inputs, one batched step."""

from __future__ import annotations

import torch
from torch import Tensor

from ..streaming import move_row
from .model import Code2WavModel
from .state import allocate_state, reset_slot
from .step import code2wav_step


class Code2WavPool:
    """``max_slots`` streams decoded together, one frame per executing row per step.

    The pool moves ``model`` to ``device`` / ``dtype`` (RoPE frequencies stay float32) and
    holds the per-stream ``state`` (see :mod:`.state`). Three forms of the same step:

    - :meth:`step`: codes and exec mask for the whole pool;
    - :meth:`step_io`: the form ``stages/graphs.py``'s ``CudaGraphRunner`` captures, a dict
      ``{"codes": [b, num_quantizers] int64, "exec_mask": [b] bool}`` for slots ``0..b-1``
      (state rows ``[:b]`` are views, so their addresses never change) returning
      ``{"wav": [b, samples_per_frame]}``; :meth:`make_inputs` gives its idle example inputs;
    - :meth:`step_rows`: only the given slots, their state rows gathered and written back (eager).

    None of them validates codes: callers do (see :class:`.streamer.Code2WavStreamer`).
    """

    def __init__(self, model: Code2WavModel, max_slots: int, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        if max_slots < 1:
            raise ValueError(f"max_slots must be at least 1, got {max_slots}")
        device = torch.device(device) if device is not None else model.code_embedding.weight.device
        dtype = dtype or model.code_embedding.weight.dtype
        self.model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.model.rebuild_buffers(device)
        self.max_slots = max_slots
        self.device = device
        self.dtype = dtype
        self.state = allocate_state(self.model, max_slots, device, dtype)

    def reset(self, slot: int) -> None:
        """Fresh-stream state for ``slot``, in place; other slots are untouched."""
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"code2wav slot {slot} is outside the pool (0..{self.max_slots - 1})")
        reset_slot(self.state, slot)

    def move(self, source: int, target: int) -> None:
        """Moves the stream of slot ``source`` into slot ``target`` (another slot, free in the
        caller's allocator): every state row is copied in place on the device, no sync, so the
        stream goes on in ``target`` as it would have in ``source``. ``source`` keeps a stale copy,
        reset when a new stream takes it. Between steps only. ValueError, nothing changed, for
        slots out of range or equal."""
        move_row(self.state.values(), source, target, self.max_slots, "code2wav slot")

    @torch.no_grad()
    def step(self, codes: Tensor, exec_mask: Tensor) -> Tensor:
        """One frame for every row of ``exec_mask``; ``[max_slots, samples_per_frame]`` out."""
        return code2wav_step(self.model, self.state, codes, exec_mask)

    @torch.no_grad()
    def step_rows(self, rows: list[int], codes: Tensor) -> Tensor:
        """One frame for each slot of ``rows`` (distinct, ascending) and no other: their state rows
        are gathered into a batch of ``len(rows)``, stepped, and written back; ``[len(rows),
        samples_per_frame]`` out. The eager form: it costs the streams that have a frame whatever
        slots they hold, but allocates per call (not for CUDA graphs)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        state = {name: tensor.index_select(0, index) for name, tensor in self.state.items()}
        every = torch.ones(len(rows), dtype=torch.bool, device=self.device)
        wav = code2wav_step(self.model, state, codes, every)
        for name, tensor in self.state.items():
            tensor.index_copy_(0, index, state[name])
        return wav

    @torch.no_grad()
    def step_io(self, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        """:meth:`step` for slots ``0..b-1``, over and into dicts of tensors (see the class doc)."""
        rows = inputs["codes"].shape[0]
        state = {name: tensor[:rows] for name, tensor in self.state.items()}
        return {"wav": code2wav_step(self.model, state, inputs["codes"], inputs["exec_mask"])}

    def make_inputs(self, batch: int) -> dict[str, Tensor]:
        """Inputs for ``batch`` slots with every row idle: stepping them changes no state."""
        return {
            "codes": torch.zeros(batch, self.model.num_quantizers, dtype=torch.int64, device=self.device),
            "exec_mask": torch.zeros(batch, dtype=torch.bool, device=self.device),
        }
