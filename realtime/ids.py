"""Ids of server-generated objects: ``<prefix>_<random base62>``, at most 32 characters."""

from __future__ import annotations

import secrets
import string

ALPHABET = string.ascii_letters + string.digits
MAX_ID_LENGTH = 32
_RANDOM_CHARS = 20


def new_id(prefix: str, *, random_chars: int = _RANDOM_CHARS) -> str:
    """``new_id("item")`` -> ``item_`` + 20 random base62 characters."""
    value = f"{prefix}_{''.join(secrets.choice(ALPHABET) for _ in range(random_chars))}"
    assert len(value) <= MAX_ID_LENGTH, value
    return value
