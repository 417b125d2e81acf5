"""Per-slot allowed-token masks for the thinker's draws (constrained decoding, :mod:`.constrain`).

Each slot has a row of ``ceil(V / 32)`` int32 words on the device, bit ``t % 32`` of word
``t // 32`` allowing token ``t`` (llguidance's layout). A row of all ones (every unconstrained
slot) allows every token, and the masked logits are then bitwise the logits. The decode step
reads rows ``0..B-1`` in place, so it can be captured in a CUDA graph; the host writes a
constrained slot's next row into one pinned buffer while the GPU runs the talker, and
:meth:`SlotMasks.upload` copies the rows that changed (non-blocking) before the next thinker step.
"""

from __future__ import annotations

import torch

ALL = -1  # an int32 word with every bit set


def mask_words(vocab: int) -> int:
    return (vocab + 31) // 32


class BitmaskApplier:
    """Applies [B, ceil(V/32)] int32 bitmasks to [B, V] logits (-inf where a bit is clear)."""

    def __init__(self, vocab: int, device: torch.device) -> None:
        ids = torch.arange(vocab, device=device)
        self.word = ids >> 5  # the word of each token
        self.bit = (ids & 31).to(torch.int32)  # its bit in that word

    def __call__(self, logits: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
        allowed = (bits.index_select(1, self.word) >> self.bit) & 1
        return logits.masked_fill(allowed == 0, float("-inf"))


class SlotMasks:
    """The masks of ``num_slots`` slots over a vocabulary of ``vocab`` tokens (rows = slots)."""

    def __init__(self, num_slots: int, vocab: int, device: torch.device) -> None:
        self.vocab = vocab
        self.words = mask_words(vocab)
        self.bits = torch.full((num_slots, self.words), ALL, dtype=torch.int32, device=device)
        pinned = device.type == "cuda"
        self.host = torch.full((num_slots, self.words), ALL, dtype=torch.int32, pin_memory=pinned)
        self.apply_bits = BitmaskApplier(vocab, device)
        self._dirty: set[int] = set()

    def apply(self, logits: torch.Tensor, start: int = 0) -> torch.Tensor:
        """``logits`` [B, V] of slots ``start..start+B-1`` with the tokens their rows forbid at -inf."""
        return self.apply_bits(logits, self.bits[start : start + logits.shape[0]])

    def set(self, slot: int, row: torch.Tensor) -> None:
        """``row`` [words] int32 (host) as the slot's mask from the next :meth:`upload` on."""
        self.host[slot].copy_(row)
        self._dirty.add(slot)

    def changed(self, slot: int) -> None:
        """The slot's host row was written in place (e.g. filled by llguidance)."""
        self._dirty.add(slot)

    def upload(self) -> None:
        """Copies the changed rows to the device (non-blocking, in stream order: before the next
        step that reads them). The host rows must stay untouched until the tick's sync."""
        for slot in sorted(self._dirty):
            self.bits[slot].copy_(self.host[slot], non_blocking=True)
        self._dirty.clear()

    def move(self, source: int, target: int) -> None:
        """Slot ``target`` takes slot ``source``'s mask, on the host and the device (a row still
        to upload goes up from ``target``); ``source`` allows every token again."""
        self.host[target].copy_(self.host[source])
        self.bits[target].copy_(self.bits[source])
        if source in self._dirty:
            self._dirty.add(target)
        self.reset(source)

    def reset(self, slot: int) -> None:
        """Every token allowed again (no device sync)."""
        self.host[slot].fill_(ALL)
        self.bits[slot].fill_(ALL)
        self._dirty.discard(slot)
