"""``stages/diffusion/pieces.py``: pieces of split calls planned from their parts' measured costs."""

from __future__ import annotations

import pytest
from omnirt.stages.diffusion.pieces import Piece, PieceCosts

KEY = ("transformer", (64, 64), 1)


def _measured(start: float = 0.01, block: float = 0.01, finish: float = 0.005) -> PieceCosts:
    costs = PieceCosts()
    costs.record(KEY, Piece(True, 0, 0, False), start)
    costs.record(KEY, Piece(False, 0, 1, False), block)
    costs.record(KEY, Piece(False, 1, 1, True), finish)
    return costs


def test_unmeasured_parts_run_alone_first():
    costs = PieceCosts()
    assert costs.next_piece(KEY, 4, 0, started=False, budget=1.0) == (Piece(True, 0, 0, False), None)
    costs.record(KEY, Piece(True, 0, 0, False), 0.01)
    assert costs.next_piece(KEY, 4, 0, started=True, budget=1.0) == (Piece(False, 0, 1, False), None)
    costs.record(KEY, Piece(False, 0, 1, False), 0.02)
    # the finish was never measured: the blocks that fit, then the finish alone
    assert costs.next_piece(KEY, 4, 1, started=True, budget=1.0) == (
        Piece(False, 1, 4, False),
        pytest.approx(0.06),
    )
    assert costs.next_piece(KEY, 4, 4, started=True, budget=1.0) == (Piece(False, 4, 4, True), None)


def test_a_piece_holds_what_fits_the_budget_and_at_least_one_block():
    costs = _measured()
    piece, seconds = costs.next_piece(KEY, 10, 0, started=False, budget=0.035)
    assert piece == Piece(True, 0, 2, False) and seconds == pytest.approx(0.03)
    # parts that add up to the budget exactly fit; the finish joins the last blocks when it fits
    assert costs.next_piece(KEY, 10, 7, started=True, budget=0.035) == (
        Piece(False, 7, 10, True),
        pytest.approx(0.035),
    )
    # a budget smaller than one block still runs one
    assert costs.next_piece(KEY, 10, 3, started=True, budget=0.001) == (
        Piece(False, 3, 4, False),
        pytest.approx(0.01),
    )


def test_a_pieces_time_is_shared_in_proportion_to_the_estimates():
    costs = _measured(start=0.01, block=0.02, finish=0.01)
    costs.record(KEY, Piece(True, 0, 1, False), 0.06)  # estimated 0.03: each part took twice as long
    assert costs.start_cost(KEY) == pytest.approx(0.01 + 0.2 * (0.02 - 0.01))
    piece, seconds = costs.next_piece(KEY, 1, 0, started=True, budget=1.0)
    assert piece == Piece(False, 0, 1, True)
    assert seconds == pytest.approx((0.02 + 0.2 * (0.04 - 0.02)) + 0.01)


def test_decode_parts_are_costed_by_class():
    costs = PieceCosts(decode_part_kinds=lambda shape: 3)
    key = ("vae", (64, 64), 1)
    # block i is part i + 1: the first frame's stages 1 and 2, then the other frames' 0, 1, 2, ...
    assert [costs.block_class(key, i) for i in range(6)] == [
        "first1",
        "first2",
        "block0",
        "block1",
        "block2",
        "block0",
    ]
    assert costs.block_class(KEY, 5) == "block"  # a transformer call's blocks: one class
