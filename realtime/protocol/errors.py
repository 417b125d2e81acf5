"""Protocol-level errors (bad frames, bad fields) and the mapping from pydantic's errors."""

from __future__ import annotations

import re

from omnirt.sessions.errors import ErrorCode, SessionError
from pydantic import ValidationError
from pydantic_core import ErrorDetails


class ProtocolError(SessionError):
    """A client event that cannot be understood; carries the client's ``event_id`` when known."""

    def __init__(
        self, code: ErrorCode, message: str, param: str | None = None, *, event_id: str | None = None
    ) -> None:
        super().__init__(code, message, param)
        self.event_id = event_id


def join_path(*parts: object) -> str:
    return ".".join(str(p) for p in parts if p not in ("", None))


_FIELD = re.compile(r"^[a-z_][a-z0-9_]*$")
_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "none"}


def _is_union_tag(part: object) -> bool:
    """pydantic names the union member in ``loc`` (``constrained-int``, ``VoiceId``, ...)."""
    return isinstance(part, str) and (not _FIELD.match(part) or part in _TYPE_NAMES)


#: pydantic's bound errors: the bound's name in ``ctx`` and whether the value is under it.
_BOUNDS = {
    "greater_than_equal": ("ge", True),
    "greater_than": ("gt", True),
    "less_than_equal": ("le", False),
    "less_than": ("lt", False),
}


def _bound_error(kind: str, err: ErrorDetails, param: str) -> ProtocolError:
    """OpenAI's ``integer_below_min_value`` / ``decimal_above_max_value`` family."""
    name, below = _BOUNDS[kind]
    bound = (err.get("ctx") or {}).get(name)
    decimal = isinstance(bound, float)
    if decimal:
        code = ErrorCode.DECIMAL_BELOW_MIN if below else ErrorCode.DECIMAL_ABOVE_MAX
    else:
        code = ErrorCode.INTEGER_BELOW_MIN if below else ErrorCode.INTEGER_ABOVE_MAX
    what = ("decimal" if decimal else "integer") + (" below minimum" if below else " above maximum")
    op = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}[name]
    return ProtocolError(
        code,
        f"Invalid '{param}': {what} value. Expected a value {op} {bound}, "
        f"but got {err.get('input')!r} instead.",
        param,
    )


def from_validation(exc: ValidationError, prefix: str = "") -> ProtocolError:
    """The first problem pydantic found, as one error with a dotted ``param`` path and the code
    OpenAI's validation gives the same problem."""
    err = exc.errors()[0]
    param = join_path(prefix, *(p for p in err["loc"] if not _is_union_tag(p)))
    kind = err["type"]
    if kind == "missing":
        return ProtocolError(
            ErrorCode.MISSING_REQUIRED_PARAMETER, f"Missing required parameter: '{param}'.", param
        )
    if kind == "extra_forbidden":
        return ProtocolError(ErrorCode.UNKNOWN_PARAMETER, f"Unknown parameter: '{param}'.", param)
    if kind in _BOUNDS:
        return _bound_error(kind, err, param)
    if kind == "string_too_long":
        return ProtocolError(
            ErrorCode.STRING_ABOVE_MAX_LENGTH, f"Invalid '{param}': string too long ({err['msg']}).", param
        )
    if kind.endswith(("_type", "_parsing")) or kind == "int_from_float":
        return ProtocolError(ErrorCode.INVALID_TYPE, f"Invalid type for '{param}': {err['msg']}.", param)
    return ProtocolError(ErrorCode.INVALID_VALUE, f"Invalid value for '{param}': {err['msg']}.", param)
