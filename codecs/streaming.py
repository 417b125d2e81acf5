"""Per-slot streaming state shared by the codecs (``mimi``, ``code2wav``): many streams, one batch.

A streaming module declares its state as named buffers of shape ``[max_slots, ...]``. The
buffers are allocated once (``alloc_state``) and never reallocated: a slot is reset in place
when a stream starts, and a step on ``rows`` streams works on the views ``buffer[:rows]``. So
the tensors a captured CUDA graph reads and writes keep their addresses for the life of the
pool.

Every step takes an exec mask (bool, one per row). State moves forward only where the mask is
True (``commit``): a row without a new frame keeps its state bit for bit, whatever the other
rows do, and the batch keeps one shape. (code2wav's step, which decodes several frames a row,
takes a frame count per row instead, 0 where a mask would be False: each row's state is taken
where its frames end, ``code2wav/step.py``'s ``_decoded_tail``.)

Also the RoPE inverse frequencies both codecs' transformers use (:func:`rope_inv_freq`), and
:class:`SlotAllocator`, the one slot allocator of every slot pool (the codecs' pools, the speech
decoders, the duplex LM): lowest free slot first, so that busy slots stay low and a batch of the
first ``rows()`` slots covers them all. When streams leave from the middle, ``compaction`` plans
the moves (the highest busy slot into the lowest free one) that bring the batch back to the
bucket the busy count needs; the pool that owns the state copies the rows, ``move`` records it.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class StateSpec:
    """One state buffer: per-slot shape, fill value on reset, dtype (None: the model dtype)."""

    shape: tuple[int, ...]
    fill: float | int | bool = 0
    dtype: torch.dtype | None = None


class SlotAllocator:
    """Slot numbers ``0..count-1`` handed out lowest first."""

    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError(f"a slot pool needs at least one slot, got {count}")
        self.count = count
        self._free = list(range(count))  # a heap
        self._busy: set[int] = set()

    def __len__(self) -> int:
        """Free slots."""
        return len(self._free)

    def __contains__(self, slot: object) -> bool:
        """Whether ``slot`` is taken."""
        return slot in self._busy

    def free_slots(self) -> Iterator[int]:
        """The free slots, in no particular order."""
        return iter(self._free)

    def take(self) -> int:
        """The lowest free slot; ``ValueError`` when none is free."""
        if not self._free:
            raise ValueError(f"no free slot: all {self.count} are in use")
        slot = heapq.heappop(self._free)
        self._busy.add(slot)
        return slot

    def give(self, slot: int) -> None:
        """Frees a taken slot; ``ValueError`` for a slot that is not taken."""
        if slot not in self._busy:
            raise ValueError(f"slot {slot!r} is not in use")
        self._busy.remove(slot)
        heapq.heappush(self._free, slot)

    def rows(self) -> int:
        """The batch that covers every busy slot: the highest busy slot + 1 (0 when none is)."""
        return max(self._busy) + 1 if self._busy else 0

    def busy(self) -> int:
        """Taken slots."""
        return len(self._busy)

    def move(self, source: int, target: int) -> None:
        """Records that the stream of taken slot ``source`` now lives in free slot ``target``:
        ``target`` is taken, ``source`` free. ``ValueError`` (nothing changes) otherwise."""
        if source not in self._busy:
            raise ValueError(f"cannot move from slot {source!r}: it is not in use")
        if isinstance(target, bool) or not isinstance(target, int) or target in self._busy:
            raise ValueError(f"cannot move to slot {target!r}: it is not a free slot")
        if target not in self._free:
            raise ValueError(f"cannot move to slot {target!r}: not a slot of this pool (0..{self.count - 1})")
        self._free.remove(target)
        self._free.append(source)
        heapq.heapify(self._free)
        self._busy.remove(source)
        self._busy.add(target)

    def compaction(self, buckets: Sequence[int]) -> tuple[int, int] | None:
        """The next move ``(source, target)`` that lowers the batch, or None when none is due.

        ``buckets``: the batch sizes the steps run at (ascending or not; a batch runs at the
        smallest bucket that holds it; sizes past the largest count as their own bucket). A move
        is due while the bucket that covers the busy slots (``rows()``) is larger than the one the
        busy count needs; it takes the highest busy slot into the lowest free slot, so a loop of
        ``compaction``/``move`` moves the fewest streams, the highest ones."""
        if not self._busy:
            return None
        sizes = sorted(set(buckets))

        def bucket(n: int) -> int:
            return next((b for b in sizes if b >= n), n)

        if bucket(self.rows()) <= bucket(len(self._busy)):
            return None
        return max(self._busy), self._free[0]


def rope_inv_freq(base: float, head_dim: int, device: torch.device | str | None = None) -> torch.Tensor:
    """RoPE inverse frequencies, float32, computed as transformers' default rope does."""
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim))


def move_row(
    buffers: Iterable[torch.Tensor], source: int, target: int, max_slots: int, what: str = "slot"
) -> None:
    """Copies row ``source`` of every state buffer onto row ``target``, in place on the device,
    no sync (a pool's ``move``: the stream goes on in ``target`` as it would have in ``source``,
    which keeps a stale copy until a new stream resets it). ValueError, nothing changed, for
    slots out of range or equal; ``what`` names the slots in the message."""
    for slot in (source, target):
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < max_slots:
            raise ValueError(f"{what} must be an int in [0, {max_slots}), got {slot!r}")
    if source == target:
        raise ValueError(f"cannot move {what} {source} onto itself")
    with torch.no_grad():
        for buffer in buffers:
            buffer[target] = buffer[source]


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
