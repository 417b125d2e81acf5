"""Shape bounds on every client event, checked before validation or any state sees it.

Pydantic checks each field's type and length; what no field type bounds is the shape of the
free-form values (``tools[].parameters``, the values a patch carries through): how deeply they
nest and how many values they hold. Deep values are refused here because everything downstream
walks them recursively (``copy.deepcopy`` of the config on every ``session.update``, JSON Schema
validation, ``json.dumps`` of the echo): stored once, they would make every later event on the
session fail with a ``RecursionError``. Strings must be text: a lone surrogate escape (which
Python's parser accepts) is refused here, as pydantic refuses it in the fields it types.
"""

from __future__ import annotations

from typing import Any

from omnirt.sessions.errors import ErrorCode

from .errors import ProtocolError, join_path

#: Deepest nesting of objects and arrays in one client event, counting the event itself
#: (``{"session": {"tools": [{"parameters": ...}]}}`` leaves 28 levels to a tool's schema; real
#: schemas nest well under 20).
MAX_EVENT_DEPTH = 32
#: Most JSON values (objects, arrays, strings, numbers...) in one client event other than an
#: audio append (a schema with 1000 properties and enums of 1000 values is ~5,000).
MAX_EVENT_VALUES = 65_536


def check_shape(raw: Any, *, max_depth: int = MAX_EVENT_DEPTH, max_values: int = MAX_EVENT_VALUES) -> None:
    """Raise ``invalid_value`` (param: where) when ``raw`` (a parsed JSON value) nests deeper than
    ``max_depth``, holds more than ``max_values`` values, or holds a string (or key) that is not
    text. Iterative: any depth is safe here."""
    count = 0
    stack: list[tuple[Any, int, tuple[Any, ...]]] = [(raw, 1, ())]
    while stack:
        value, depth, path = stack.pop()
        count += 1
        if count > max_values:
            raise ProtocolError(
                ErrorCode.INVALID_VALUE,
                f"Invalid event: it holds more than this server's limit of {max_values} JSON values.",
            )
        if isinstance(value, str):
            check_text(value, path)
            continue
        if isinstance(value, dict):
            for key in value:
                check_text(key, path)
            children: Any = value.items()
        elif isinstance(value, list):
            children = enumerate(value)
        else:
            continue
        if depth > max_depth:
            param = join_path(*path)
            raise ProtocolError(
                ErrorCode.INVALID_VALUE,
                f"Invalid value for '{param}': objects and arrays nested more than {max_depth} levels "
                "deep (this server's limit).",
                param,
            )
        stack.extend((child, depth + 1, (*path, key)) for key, child in children)


def check_text(value: str, path: tuple[Any, ...]) -> None:
    """``invalid_value`` for a string holding a lone surrogate: a ``\\ud800``-``\\udfff`` JSON escape
    without its pair, which Python's JSON parser lets through and which is no character. Stored,
    it could never be sent back (no UTF-8 encoder takes it): the session's next echo would fail
    and drop the connection; the model's tokenizer refuses it too."""
    if not is_text(value):
        param = join_path(*path)
        raise ProtocolError(
            ErrorCode.INVALID_VALUE,
            f"Invalid value for '{param}': a string holds a lone surrogate escape (\\ud800-\\udfff "
            "without its pair), which is not text.",
            param or None,
        )


def is_text(value: str) -> bool:
    """False when ``value`` holds a lone surrogate (cannot be encoded as UTF-8)."""
    if value.isascii():
        return True
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True
