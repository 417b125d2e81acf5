"""A fixed pool of Mimi streams: checked encode/decode steps, in-place reset.

Slot ``i`` is row ``i`` of every state buffer. ``encode``/``decode`` take a batch of the first
``rows`` slots (``rows <= max_slots``) and an exec mask; keep active sessions in the lowest
slots so the batch stays small.

The pool runs its one-frame steps through ``encode_runner`` / ``decode_runner``: the eager steps
``encode_io`` / ``decode_io`` by default. A codec does not know about CUDA graphs: ``stages``
replaces the runners with graph runners of the same signature, captured per batch bucket from
``encode_io`` / ``encode_inputs`` (and the decode pair) at the pool's ``buckets``
(``stages/codec_graphs.py``); padded rows are idle. The buckets are those of ``buckets``
(default ``DEFAULT_BUCKETS``) up to ``max_slots``, plus ``max_slots`` itself.
``move`` copies a stream to another slot (compaction after streams leave from the middle).
Bad input raises ``ValueError`` before any state changes. The pool allocates its state inside
the model's modules (``StreamingMimi.alloc_state``): one model backs one pool.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..streaming import move_row
from .model import StreamingMimi

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

#: A one-frame step over named tensors (what a graph runner replays).
Runner = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


class MimiSlotPool:
    def __init__(
        self,
        model: StreamingMimi,
        max_slots: int,
        *,
        buckets: Sequence[int] | None = None,
        check_codes: bool = True,
    ) -> None:
        model.alloc_state(max_slots)
        self.model = model
        self.max_slots = max_slots
        self.check_codes = check_codes
        weight = model.encoder.layers[0].conv.weight
        self.device = weight.device
        # max_slots is always a bucket, so that every batch the pool accepts has a graph
        self.buckets = sorted({b for b in (buckets or DEFAULT_BUCKETS) if b <= max_slots} | {max_slots})
        self.encode_runner: Runner = self.encode_io
        self.decode_runner: Runner = self.decode_io

    # Steps (graph-capturable) ---------------------------------------------------------------
    @torch.no_grad()
    def encode_io(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{"audio": [rows, frame_size], "exec": [rows]}`` -> ``{"codes": [rows, K, 1]}``."""
        return {"codes": self.model.encode_step(inputs["audio"], inputs["exec"])}

    @torch.no_grad()
    def decode_io(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{"codes": [rows, K, 1], "exec": [rows]}`` -> ``{"audio": [rows, frame_size]}``."""
        return {"audio": self.model.decode_step(inputs["codes"], inputs["exec"])}

    def encode_inputs(self, rows: int) -> dict[str, torch.Tensor]:
        """Example inputs of :meth:`encode_io` (zeros, nothing executes)."""
        return {
            "audio": torch.zeros(rows, self.model.frame_size, device=self.device),
            "exec": torch.zeros(rows, dtype=torch.bool, device=self.device),
        }

    def decode_inputs(self, rows: int) -> dict[str, torch.Tensor]:
        """Example inputs of :meth:`decode_io` (zeros, nothing executes)."""
        return {
            "codes": torch.zeros(rows, self.model.num_quantizers, 1, dtype=torch.int64, device=self.device),
            "exec": torch.zeros(rows, dtype=torch.bool, device=self.device),
        }

    # Public API -------------------------------------------------------------------------------
    def reset(self, slot: int, *, encoder: bool = True, decoder: bool = True) -> None:
        """Starts a new stream in ``slot`` (in place; other slots untouched)."""
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.max_slots:
            raise ValueError(f"slot must be an int in [0, {self.max_slots}), got {slot!r}")
        self.model.reset_slot(slot, encoder=encoder, decoder=decoder)

    def move(self, source: int, target: int) -> None:
        """Moves the stream of slot ``source`` into slot ``target`` (another slot, free in the
        caller's allocator): every state row of the encoder and the decoder is copied in place on
        the device, no sync, so the stream goes on in ``target`` exactly as it would have in
        ``source`` (bitwise on CPU; on CUDA at the same batch bucket). ``source`` keeps a stale
        copy, to be reset when a new stream takes it. Between steps only. ValueError, nothing
        changed, for slots out of range or equal."""
        move_row(self.model.state_buffers().values(), source, target, self.max_slots)

    def _exec_mask(self, rows: int, exec_mask: torch.Tensor | None) -> torch.Tensor:
        if exec_mask is None:
            return torch.ones(rows, dtype=torch.bool, device=self.device)
        if not isinstance(exec_mask, torch.Tensor) or exec_mask.dtype != torch.bool:
            raise ValueError("exec_mask must be a bool tensor")
        if exec_mask.shape != (rows,):
            raise ValueError(f"exec_mask must have shape ({rows},), got {tuple(exec_mask.shape)}")
        return exec_mask.to(self.device)

    def _rows(self, rows: int) -> None:
        if not 1 <= rows <= self.max_slots:
            raise ValueError(f"batch of {rows} rows: must be between 1 and max_slots={self.max_slots}")

    def encode(self, audio: torch.Tensor, exec_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Audio [rows, n * frame_size] float -> codes [rows, K, n] int64 (zeros where not exec)."""
        if not isinstance(audio, torch.Tensor) or audio.dim() != 2 or not audio.is_floating_point():
            raise ValueError("audio must be a float tensor of shape [rows, n * frame_size]")
        rows, samples = audio.shape
        self._rows(rows)
        frame = self.model.frame_size
        if samples == 0 or samples % frame:
            raise ValueError(f"audio has {samples} samples per row: need a positive multiple of {frame}")
        mask = self._exec_mask(rows, exec_mask)
        return self.encode_runner({"audio": audio.to(self.device, torch.float32), "exec": mask})["codes"]

    def decode(self, codes: torch.Tensor, exec_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Codes [rows, K, n] int -> audio [rows, n * frame_size] float32 (zeros where not exec).

        Codes are range-checked on the host: always on CPU, on CUDA only with ``check_codes``
        (one device sync per call; pass ``check_codes=False`` for codes from a trusted model).
        """
        if (
            not isinstance(codes, torch.Tensor)
            or codes.dim() != 3
            or codes.is_floating_point()
            or codes.dtype == torch.bool
        ):
            raise ValueError("codes must be an integer tensor of shape [rows, num_quantizers, frames]")
        rows, k, frames = codes.shape
        self._rows(rows)
        if k != self.model.num_quantizers or frames == 0:
            raise ValueError(
                f"codes must have {self.model.num_quantizers} quantizers and >= 1 frame, "
                f"got shape {tuple(codes.shape)}"
            )
        if (self.check_codes or codes.device.type == "cpu") and codes.numel():
            low, high = int(codes.min()), int(codes.max())
            size = self.model.quantizer.codebook_size
            if low < 0 or high >= size:
                raise ValueError(f"codes must lie in [0, {size}), got values in [{low}, {high}]")
        mask = self._exec_mask(rows, exec_mask)
        return self.decode_runner({"codes": codes.to(self.device, torch.int64), "exec": mask})["audio"]
