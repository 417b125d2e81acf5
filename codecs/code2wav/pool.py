"""A fixed pool of code2wav streams: preallocated state, static inputs, one batched step."""

from __future__ import annotations

import torch
from torch import Tensor

from ..streaming import move_row
from .model import Code2WavModel
from .state import allocate_state, reset_slot
from .step import code2wav_step


class Code2WavPool:
    """``max_slots`` streams decoded together, up to ``steps`` frames per row per step.

    The pool moves ``model`` to ``device`` / ``dtype`` (RoPE frequencies stay float32) and
    holds the per-stream ``state`` (see :mod:`.state`). Three forms of the same step:

    - :meth:`step`: codes and frame counts for the whole pool;
    - :meth:`step_io`: the form ``stages/graphs.py``'s ``CudaGraphRunner`` captures, a dict
      ``{"codes": [b, steps, num_quantizers] int64, "counts": [b] int64}`` for slots ``0..b-1``
      (state rows ``[:b]`` are views, so their addresses never change) returning
      ``{"wav": [b, steps * samples_per_frame]}``; :meth:`make_inputs` gives its idle example
      inputs (a runner per ``steps``: the per-row shape of ``codes`` is part of a graph);
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

    def step(self, codes: Tensor, counts: Tensor) -> Tensor:
        """``counts[r]`` frames of ``codes[r]`` for every row of the pool; ``[max_slots, steps *
        samples_per_frame]`` out."""
        return code2wav_step(self.model, self.state, codes, counts)

    def step_rows(self, rows: list[int], codes: Tensor, counts: Tensor) -> Tensor:
        """:meth:`step` for the slots of ``rows`` (distinct, ascending) and no other: their state
        rows are gathered into a batch of ``len(rows)``, stepped, and written back; ``[len(rows),
        steps * samples_per_frame]`` out. The eager form: it costs the streams that have frames
        whatever slots they hold, but allocates per call (not for CUDA graphs)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        state = {name: tensor.index_select(0, index) for name, tensor in self.state.items()}
        wav = code2wav_step(self.model, state, codes, counts)
        for name, tensor in self.state.items():
            tensor.index_copy_(0, index, state[name])
        return wav

    def step_io(self, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        """:meth:`step` for slots ``0..b-1``, over and into dicts of tensors (see the class doc)."""
        rows = inputs["codes"].shape[0]
        state = {name: tensor[:rows] for name, tensor in self.state.items()}
        return {"wav": code2wav_step(self.model, state, inputs["codes"], inputs["counts"])}

    def make_inputs(self, batch: int, steps: int = 1) -> dict[str, Tensor]:
        """Inputs for ``batch`` slots of ``steps`` frames with every row idle: stepping them
        changes no state."""
        q = self.model.num_quantizers
        return {
            "codes": torch.zeros(batch, steps, q, dtype=torch.int64, device=self.device),
            "counts": torch.zeros(batch, dtype=torch.int64, device=self.device),
        }
