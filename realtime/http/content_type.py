"""Content types the JSON endpoints accept.

A body is parsed as JSON only when the request says it is JSON (``application/json``, or a
``+json`` type); anything else, or no ``Content-Type`` at all, is answered 415
``unsupported_media_type`` before the body is read. This keeps a web page's ``text/plain`` POST
(which browsers send cross-site without asking the server) from ever being treated as an API
call, and tells a client that forgot the header what is wrong instead of guessing.
"""

from __future__ import annotations

from starlette.requests import Request

from .errors import APIError

JSON = "application/json"
#: What ``POST /v1/videos`` takes besides JSON.
FORMS = ("multipart/form-data", "application/x-www-form-urlencoded")


def media_type(request: Request) -> str:
    """The request's media type, lower case, without parameters ("" when none was sent)."""
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower()


def is_json(kind: str) -> bool:
    return kind == JSON or (kind.startswith("application/") and kind.endswith("+json"))


def unsupported_media_type(kind: str, accepted: str) -> APIError:
    got = f"'{kind[:100]}'" if kind else "no Content-Type header"
    return APIError(
        415,
        f"Unsupported Content-Type: {got}; this endpoint accepts {accepted}.",
        param="Content-Type",
        code="unsupported_media_type",
    )


def require_json(request: Request) -> None:
    """415 unless the request declares a JSON body."""
    kind = media_type(request)
    if not is_json(kind):
        raise unsupported_media_type(kind, JSON)


def require_json_or_form(request: Request) -> None:
    """415 unless the request declares a JSON body or a form (multipart or urlencoded)."""
    kind = media_type(request)
    if not is_json(kind) and kind not in FORMS:
        raise unsupported_media_type(kind, f"{JSON}, {FORMS[0]} or {FORMS[1]}")
