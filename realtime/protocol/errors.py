"""Protocol-level errors (bad frames, bad fields) and the mapping from pydantic's errors."""

from __future__ import annotations

import re

from omnirt.sessions.errors import ErrorCode, SessionError
from pydantic import ValidationError


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


def from_validation(exc: ValidationError, prefix: str = "") -> ProtocolError:
    """The first problem pydantic found, as one error with a dotted ``param`` path."""
    err = exc.errors()[0]
    param = join_path(prefix, *(p for p in err["loc"] if not _is_union_tag(p)))
    kind = err["type"]
    if kind == "missing":
        return ProtocolError(
            ErrorCode.MISSING_REQUIRED_PARAMETER, f"Missing required parameter: '{param}'.", param
        )
    if kind == "extra_forbidden":
        return ProtocolError(ErrorCode.UNKNOWN_PARAMETER, f"Unknown parameter: '{param}'.", param)
    return ProtocolError(ErrorCode.INVALID_VALUE, f"Invalid value for '{param}': {err['msg']}.", param)
