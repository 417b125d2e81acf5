"""Prompt prefixes reused across requests: what each slot's caches hold, and the slot pool.

Every response of a conversation reads the whole conversation again, so the prompt of a turn
starts with the prompt (and reply) of the turn before, and out-of-band responses over one
context read the same prompt several times. A slot's thinker cache keeps, after its request
ends, the keys/values of everything it read and fed; its talker cache keeps those of the user
turns. :class:`SlotPool` remembers what each slot holds (a :class:`Prefix`) and finds, for a new
prompt, the slot whose entries share the longest prefix with it; the pipeline copies those
entries into the new request's slot and reads only the rest (``Thinker.forward_prompt(start=)``).

What a prompt position *is* is its key (``PromptInputs.fingerprint``): the token id, or for an
audio or image placeholder a negative digest of the part's content, so two prompts share a
prefix only where their tokens and their media are the same. The keys of a prefix determine
its keys/values exactly (causal attention; the multimodal RoPE positions of a prefix depend only
on the prefix), so reading the rest after a copied prefix computes what reading the whole prompt
computes, up to the floating-point order of the attention over pieces.

Slots are handed out lowest first (the busy slots stay packed low, so batched steps stay
small). A slot taken while it holds a prefix keeps it until its request starts reading its
prompt: then the prefix moves to the highest free slot that holds none, or, with none left, over
the least recently used prefix if that is older; else it is dropped (its request may still
reuse it in place).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...codecs.streaming import SlotAllocator


def media_key(data: bytes) -> int:
    """A negative 56-bit digest of an audio or image part's content (token ids are >= 0)."""
    return -1 - int.from_bytes(hashlib.blake2b(data, digest_size=7).digest(), "little")


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """The length of the common prefix of two key arrays."""
    n = min(a.shape[0], b.shape[0])
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


@dataclass
class Prefix:
    """What a slot's caches hold: the keys of its first ``len(keys)`` thinker entries, and how
    many user-turn positions its talker cache holds (0: none)."""

    keys: np.ndarray  # int64 [n]
    talker_user: int = 0


@dataclass(frozen=True)
class Reuse:
    """A prefix to copy from ``slot``: ``thinker`` entries, ``talker`` user positions."""

    slot: int
    thinker: int
    talker: int


#: A shorter common prefix is read again: copying it would save less than the smallest piece.
MIN_REUSE = 64


def plan_reuse(
    keys: np.ndarray, user: np.ndarray | None, slot: int, held: Prefix
) -> Reuse | None:
    """How much of the prompt ``keys`` [L] the prefix ``held`` (in ``slot``) can give: its
    common prefix, short of the prompt's last position (the pass reads at least one, which
    gives the first reply token). ``user`` [L] bool marks the prompt's user-turn positions when
    the reply is spoken (None: text only): then the talker reuses the user positions the held
    prefix has, and the thinker prefix ends before any audio or image position of a user turn
    the talker must read (its talker input is a thinker hidden state the pass must compute)."""
    length = min(common_prefix(keys, held.keys), keys.shape[0] - 1)
    talker = 0
    if user is not None and length > 0:
        at = np.flatnonzero(user)
        talker = min(int(np.searchsorted(at, length)), held.talker_user)
        later = at[talker:]
        media = later[(later < length) & (keys[later] < 0)]
        if media.size:
            length = int(media[0])
    return Reuse(slot, length, talker) if length > 0 else None


class HeldPrefixes(dict[int, Prefix]):
    """The prefix each slot holds (a dict), indexed by its first :data:`MIN_REUSE` keys: a
    prompt can reuse only the prefixes that begin as it does, so :meth:`SlotPool.best` reads
    those alone, not every slot's."""

    def __init__(self) -> None:
        super().__init__()
        self._by_head: dict[bytes, dict[int, None]] = {}

    @staticmethod
    def head(keys: np.ndarray) -> bytes | None:
        return keys[:MIN_REUSE].tobytes() if keys.shape[0] >= MIN_REUSE else None

    def beginning(self, keys: np.ndarray) -> list[int]:
        """The slots whose prefix has ``keys``' first :data:`MIN_REUSE` keys (oldest first)."""
        head = self.head(keys)
        return list(self._by_head.get(head, ())) if head is not None else []

    def __setitem__(self, slot: int, prefix: Prefix) -> None:
        self._unindex(slot)
        super().__setitem__(slot, prefix)
        head = self.head(prefix.keys)
        if head is not None:
            self._by_head.setdefault(head, {})[slot] = None

    def __delitem__(self, slot: int) -> None:
        self._unindex(slot)
        super().__delitem__(slot)

    def pop(self, slot: int, *default: Any) -> Any:  # type: ignore[override]
        self._unindex(slot)
        return super().pop(slot, *default)

    def clear(self) -> None:
        super().clear()
        self._by_head.clear()

    def _unindex(self, slot: int) -> None:
        prefix = self.get(slot)
        head = self.head(prefix.keys) if prefix is not None else None
        if head is None:
            return
        bucket = self._by_head[head]
        del bucket[slot]
        if not bucket:
            del self._by_head[head]


class SlotPool:
    """Slot numbers handed out lowest first, and the prefix each slot holds (busy slots once
    their prompt is read, free slots after their request ended). ``move(source, target,
    prefix)`` copies a held prefix's cache entries from one slot to another."""

    def __init__(self, count: int, move: Callable[[int, int, Prefix], None]) -> None:
        self._slots = SlotAllocator(count)
        self._move = move
        self.held = HeldPrefixes()
        self._used: dict[int, int] = {}  # slot -> tick of its prefix's last use (LRU)
        self._clock = itertools.count()

    def __len__(self) -> int:
        return len(self._slots)

    def take(self) -> int:
        """The lowest free slot (a prefix it holds stays until :meth:`vacate`)."""
        return self._slots.take()

    def vacate(self, slot: int, exclude: int | None = None) -> int | None:
        """Before a taken slot is written: its prefix moves out of the way (see the module doc),
        not into ``exclude``; returns where to (None: nowhere, dropped)."""
        prefix = self.held.pop(slot, None)
        used = self._used.pop(slot, 0)
        if prefix is None:
            return None
        target = self._room(used, exclude)
        if target is not None:
            self._move(slot, target, prefix)
            self.held[target], self._used[target] = prefix, used
        return target

    def park(self, slot: int) -> tuple[int, bool] | None:
        """Where busy ``slot``'s request goes while it takes no steps (held): the highest free slot
        above it that holds no prefix, else the least recently used holder above it, whose prefix
        then goes to ``slot`` (``swap`` True: the caller swaps the two slots' caches rather than
        copying one); None: no free slot above. The move is recorded (``slot`` is free then, and
        the prefix the request's slot holds goes along); the caller moves the request's state."""
        above = [s for s in self._slots.free_slots() if s > slot]
        if not above:
            return None
        empty = [s for s in above if s not in self.held]
        target = max(empty) if empty else min(above, key=self._used.__getitem__)
        displaced = (self.held.pop(target), self._used.pop(target)) if target in self.held else None
        self._take_over(slot, target)
        if displaced is not None:
            self.held[slot], self._used[slot] = displaced
        return target, displaced is not None

    def unpark(self, slot: int) -> tuple[int, bool] | None:
        """Where busy ``slot``'s request goes once it steps again: the lowest free slot, when it
        is below ``slot`` (a prefix held there moves out of the way, as in :meth:`vacate`); None:
        it stays. Recorded as :meth:`park` records."""
        target = min(self._slots.free_slots(), default=None)
        if target is None or target > slot:
            return None
        self.vacate(target, exclude=target)  # while ``slot`` is busy: never into it
        self._take_over(slot, target)
        return target, False

    def _take_over(self, slot: int, target: int) -> None:
        """Records that busy ``slot``'s request lives in free ``target`` now, with its prefix."""
        self._slots.move(slot, target)
        if slot in self.held:
            self.held[target], self._used[target] = self.held.pop(slot), self._used.pop(slot)

    def _room(self, used: int, exclude: int | None = None) -> int | None:
        """A free slot (not ``exclude``) to move a prefix last used at ``used`` into: the highest
        holding none, else the least recently used holder if it is older; None: drop the prefix."""
        free = [s for s in self._slots.free_slots() if s != exclude]
        empty = [s for s in free if s not in self.held]
        if empty:
            return max(empty)
        oldest = min((s for s in free if s in self.held), key=self._used.__getitem__, default=None)
        if oldest is not None and self._used[oldest] < used:
            del self.held[oldest]
            return oldest
        return None

    def clear(self) -> None:
        """Forgets every held prefix (the caches stay as they are)."""
        self.held.clear()
        self._used.clear()

    def hold(self, slot: int, prefix: Prefix | None) -> None:
        """Records what ``slot`` holds now (None: nothing reusable)."""
        if prefix is None:
            self.held.pop(slot, None)
            self._used.pop(slot, None)
        else:
            self.held[slot] = prefix
            self._used[slot] = next(self._clock)

    def give(self, slot: int, prefix: Prefix | None) -> None:
        """Frees ``slot``, holding ``prefix`` for later requests."""
        self.hold(slot, prefix)
        self._slots.give(slot)

    def best(self, keys: np.ndarray, user: np.ndarray | None, at_least: int = MIN_REUSE) -> Reuse | None:
        """The longest prefix of the prompt ``keys``, of ``at_least`` positions, that a slot
        holds (see :func:`plan_reuse`); marks it used."""
        best: Reuse | None = None
        if at_least < MIN_REUSE:
            candidates = [s for s, p in self.held.items() if p.keys.shape[0] and p.keys[0] == keys[0]]
        else:
            candidates = self.held.beginning(keys)
        for slot in candidates:
            reuse = plan_reuse(keys, user, slot, self.held[slot])
            if reuse is None or reuse.thinker < at_least:
                continue
            if best is None or reuse.thinker > best.thinker:
                best = reuse
        if best is not None:
            self._used[best.slot] = next(self._clock)
        return best
