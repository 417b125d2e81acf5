"""The one slot allocator of every slot pool: lowest free first, checked give."""

from __future__ import annotations

import pytest
import torch
from omnirt.codecs.streaming import SlotAllocator, move_row


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


def _compact(slots: SlotAllocator, buckets: list[int]) -> list[tuple[int, int]]:
    moves = []
    while (move := slots.compaction(buckets)) is not None:
        slots.move(*move)
        moves.append(move)
    return moves


def test_compaction_moves_the_highest_into_the_lowest_free_until_the_bucket_fits():
    slots = SlotAllocator(64)
    for _ in range(64):
        slots.take()
    for slot in range(63):
        slots.give(slot)
    assert slots.rows() == 64 and slots.busy() == 1
    assert _compact(slots, [1, 2, 4, 8, 16, 32, 64]) == [(63, 0)]
    assert slots.rows() == 1 and 0 in slots and 63 not in slots
    assert slots.take() == 1  # the heap still hands out the lowest free slot
    assert sorted(slots.free_slots()) == list(range(2, 64))


def test_compaction_moves_only_what_lowers_the_bucket():
    slots = SlotAllocator(32)
    for _ in range(20):
        slots.take()
    for slot in (2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13):
        slots.give(slot)
    # busy: 0, 1, 14..19 (8 slots in rows 20): bucket 32 at 8 slots needs 8 -> the top six move
    assert _compact(slots, [8, 16, 32]) == [(19, 2), (18, 3), (17, 4), (16, 5), (15, 6), (14, 7)]
    assert slots.rows() == 8
    # at the CPU's minimum of 16 rows nothing is due: 20 rows and 8 busy fit in the 32 bucket
    slots = SlotAllocator(32)
    for _ in range(20):
        slots.take()
    slots.give(3)
    assert slots.compaction([16, 32]) is None
    assert SlotAllocator(4).compaction([1, 2, 4]) is None  # nothing busy


def test_bad_moves_raise_and_change_nothing():
    slots = SlotAllocator(4)
    for _ in range(3):
        slots.take()
    slots.give(1)
    for source, target, match in (
        (1, 3, "not in use"),  # source free
        (2, 0, "not a free slot"),  # target busy
        (2, 2, "not a free slot"),
        (2, 7, "not a slot of this pool"),
        (2, True, "not a free slot"),
        (2, -1, "not a slot of this pool"),
    ):
        with pytest.raises(ValueError, match=match):
            slots.move(source, target)
    assert sorted(slots.free_slots()) == [1, 3] and slots.rows() == 3 and slots.busy() == 2


def test_move_row_copies_one_row_of_every_buffer_and_refuses_bad_slots():
    buffers = [torch.arange(12.0).view(4, 3), torch.arange(8).view(4, 2)]
    for source, target, match in ((0, 4, r"in \[0, 4\)"), (True, 1, r"in \[0, 4\)"), (-1, 1, r"in \[0, 4\)"),
                                  (2, 2, "cannot move code2wav slot 2 onto itself")):
        with pytest.raises(ValueError, match=match):
            move_row(buffers, source, target, 4, "code2wav slot")
    assert torch.equal(buffers[0], torch.arange(12.0).view(4, 3))  # nothing changed
    move_row(buffers, 3, 1, 4)
    assert buffers[0][1].tolist() == [9.0, 10.0, 11.0] and buffers[1][1].tolist() == [6, 7]
    assert buffers[0][3].tolist() == [9.0, 10.0, 11.0]  # the source keeps a stale copy
    assert buffers[0][0].tolist() == [0.0, 1.0, 2.0] and buffers[0][2].tolist() == [6.0, 7.0, 8.0]
