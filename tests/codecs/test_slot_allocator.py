"""The one slot allocator of every slot pool: lowest free first, checked give."""

from __future__ import annotations

import pytest
from omnirt.codecs.streaming import SlotAllocator


def test_lowest_free_slot_first_and_rows_cover_the_busy_ones():
    slots = SlotAllocator(4)
    assert [slots.take(), slots.take(), slots.take()] == [0, 1, 2]
    assert slots.rows() == 3 and len(slots) == 1
    slots.give(1)
    assert 1 not in slots and 2 in slots
    assert slots.rows() == 3  # a hole in the middle: the batch still covers slot 2
    assert slots.take() == 1  # the hole is filled before a higher slot
    slots.give(2)
    slots.give(1)
    assert slots.rows() == 1
    slots.give(0)
    assert slots.rows() == 0 and sorted(slots.free_slots()) == [0, 1, 2, 3]


def test_full_and_bad_gives_raise_and_change_nothing():
    slots = SlotAllocator(1)
    assert slots.take() == 0
    with pytest.raises(ValueError, match="no free slot"):
        slots.take()
    with pytest.raises(ValueError, match="not in use"):
        slots.give(3)
    slots.give(0)
    with pytest.raises(ValueError, match="not in use"):
        slots.give(0)
    assert len(slots) == 1 and slots.rows() == 0
    with pytest.raises(ValueError, match="at least one slot"):
        SlotAllocator(0)
