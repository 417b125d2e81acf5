"""A real tiny Mimi for the duplex tests."""

from __future__ import annotations

import pytest

from tests.duplex.helpers import tiny_mimi


@pytest.fixture
def make_mimi():
    return tiny_mimi
