"""What the server's internals may not show a client: memory addresses and filesystem paths; and
how long an error's message may be.

Exception text reaches clients in error messages (a decoder's ``str(exc)`` often carries a repr
such as ``<_io.BytesIO object at 0x7f...>``, a loader's a path under the operator's home);
:func:`public_message` scrubs both at the edge, where an error becomes an HTTP body or a realtime
event, so no layer below has to remember to, and elides the middle of a message that quotes a
long client value (:data:`MAX_ERROR_MESSAGE`). The full text stays in the server's log.
"""

from __future__ import annotations

import re
from pathlib import PurePath

#: ``<... object at 0x7f3a...>`` and any other hexadecimal address of 6+ digits.
_REPR = re.compile(r"<[^<>]{0,200}? at 0x[0-9a-fA-F]+>")
_ADDRESS = re.compile(r"\b0x[0-9a-fA-F]{6,}\b")
#: An absolute POSIX path of at least two components (``/home/u/model``, ``'/tmp/x.json'``),
#: or a Windows one. Not a URL's path (``https://host/a/b``: ``//`` is excluded), not this
#: server's own API paths (``/v1/...``), which error messages name, and not a JSON pointer into a
#: schema (``#/definitions/Item``).
_POSIX_PATH = re.compile(r"(?<![\w:/.~#-])(?:~|/(?!/|v1/))[\w.@+-]*(?:/[\w.@+-]+)+/?")
_WINDOWS_PATH = re.compile(r"\b[A-Za-z]:\\[^\s'\",;]+")


#: An error's message quotes what the client sent (an unknown id, a value, a field name); past
#: this length the quote is elided in the middle, so that an error stays small (and, on a
#: realtime connection, fits a frame and stays the error it is).
MAX_ERROR_MESSAGE = 4096


def elide(text: str, limit: int) -> str:
    """``text`` with its middle replaced by a marker when it is longer than ``limit`` characters
    (both ends kept: a message's quote is in the middle, its explanation at the end)."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}...({len(text) - 2 * half} characters elided)...{text[-half:]}"


def public_message(text: str) -> str:
    """``text`` without memory addresses or filesystem paths (each replaced by a placeholder),
    at most :data:`MAX_ERROR_MESSAGE` characters long (:func:`elide`)."""
    text = _REPR.sub("<object>", text)
    text = _ADDRESS.sub("<address>", text)
    text = _WINDOWS_PATH.sub("<path>", text)
    return elide(_POSIX_PATH.sub("<path>", text), MAX_ERROR_MESSAGE)


def public_source(source: str) -> str:
    """Where a model came from, as a client may see it: the folder's name, never its full path."""
    return PurePath(source).name or "local checkpoint"
