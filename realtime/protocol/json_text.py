"""Parsing client JSON strictly: standard JSON only, every failure a ``ValueError``.

Python's ``json.loads`` accepts ``NaN``, ``Infinity`` and ``1e999`` (read as an infinite float):
not JSON, and echoed back they make frames no other parser reads. It also raises
``RecursionError`` past its stack depth and a plain ``ValueError`` for integers of more than
4,300 digits (``sys.get_int_max_str_digits``). Client frames are parsed here instead (and JSON
text inside form fields), so each of those is one :class:`InvalidJson` with a message that says
what was wrong. (JSON request bodies go through pydantic's parser, which refuses them too.)
"""

from __future__ import annotations

import json
import math
from typing import Any

#: Longest integer literal accepted (a 64-bit integer has at most 20 digits; nothing in the API
#: takes more). Longer ones would be converted only to be refused by a field bound.
MAX_INT_DIGITS = 100


class InvalidJson(ValueError):
    """The text is not standard JSON within the bounds above."""


def _constant(name: str) -> Any:
    raise InvalidJson(f"{name} is not a JSON value")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise InvalidJson(f"the number {text[:32]} is out of range")
    return value


def _integer(text: str) -> int:
    if len(text) > MAX_INT_DIGITS + 1:  # a sign
        raise InvalidJson(f"an integer of {len(text)} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def loads(text: str | bytes) -> Any:
    """Parse ``text`` as standard JSON; raises :class:`InvalidJson` with the reason."""
    try:
        return json.loads(text, parse_constant=_constant, parse_int=_integer, parse_float=_finite)
    except InvalidJson:
        raise
    except RecursionError:
        raise InvalidJson("nested too deeply to parse") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise InvalidJson(str(exc)) from None
