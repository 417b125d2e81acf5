"""OpenAI-shaped JSON errors: ``{"error": {"message", "type", "param", "code"}}``.

Handlers raise :class:`APIError`; the exception handlers installed by ``create_app`` turn it,
Starlette's own ``HTTPException`` (unknown URL 404, wrong method 405) and any unexpected
exception (500) into that shape with the right status code. Bad input is always answered,
never fatal. A client that goes away before its body is read whole (``ClientDisconnect``) is not
the server's error: one INFO line, no traceback, and 499 (nginx's "client closed request") in the
request metrics, answered to nobody.
"""

from __future__ import annotations

import logging
from typing import Any

from omnirt.stages.types import Finished
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from ..redact import public_message

log = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
#: The status counted for a request whose client went away before it was read (nginx's).
CLIENT_CLOSED_REQUEST = 499
SERVER_ERROR = "server_error"


class APIError(Exception):
    """An error answered to the client as ``status`` + the OpenAI error body.

    The message is scrubbed of memory addresses and filesystem paths (:mod:`..redact`): whatever
    exception text a handler puts in it, the client never sees the server's internals.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        message = public_message(message)
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, *, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str) -> APIError:
    return APIError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        param="model",
        code="model_not_found",
    )


def invalid_api_key(presented: bool) -> APIError:
    message = (
        "Incorrect API key provided."
        if presented
        else "You didn't provide an API key. Send it as an HTTP header: 'Authorization: Bearer YOUR_KEY'."
    )
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def body_too_large(limit: int) -> APIError:
    return APIError(
        413, f"Request body is larger than this server's limit of {limit} bytes.", code="request_too_large"
    )


# -- engine failures ------------------------------------------------------------------------------

def from_engine_error(finished: Finished) -> APIError:
    """Map an engine ``Finished('error')`` to an HTTP error by its ``code``.

    ``rejected``: the pipeline refused the input (the client's error, 400, with its message);
    ``overloaded``: the engine queue is full (429, retry later); ``shutdown``: 503; ``internal``
    (a model step failed) and anything unknown: 500, without internals in the message.
    """
    text = finished.error or "the request failed"
    if finished.code == "rejected":
        return APIError(400, text, code="invalid_value")
    if finished.code == "overloaded":
        return APIError(
            429,
            "The engine is at capacity; retry shortly.",
            type="rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": "1"},
        )
    if finished.code == "shutdown":
        return APIError(503, "The server is shutting down.", type=SERVER_ERROR, code="service_unavailable")
    log.error("engine error: %s", text)
    return APIError(500, "The server had an error while processing your request.", type=SERVER_ERROR)


# -- pydantic validation --------------------------------------------------------------------------


def _param(loc: tuple[int | str, ...]) -> str | None:
    """A pydantic location as an OpenAI ``param``.

    ``('messages', 0, 'user', 'content', 'list[...]', 1, 'text', 'text')`` becomes
    ``messages[0].content[1].text``.

    Union members show up in pydantic locations: discriminator tags right after a list index
    (``'user'`` above: every list of objects in the request schema is a discriminated union),
    class names (the tags of unions that are not list items) and member names such as ``'str'``
    or ``'list[...]'``. All are dropped.
    """
    out = ""
    prev: int | str | None = None
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in {"str", "int", "float", "bool", "none", "dict"} or part[:1].isupper():
            pass  # a union member: a type, or the class-name tag of ``chat_schema.by_type``
        elif isinstance(prev, int) and i + 1 < len(loc):
            pass  # a discriminator tag
        else:
            out += f".{part}" if out else part
        prev = part
    return out or None


def from_validation_error(exc: ValidationError) -> APIError:
    """A problem pydantic found, as a 400 naming the parameter (OpenAI uses 400, not 422)."""
    errors = exc.errors(include_url=False)
    # Where a union failed in every member, the deepest error is the one that says what is wrong
    # (``content[0].text`` missing, not "content is not a string").
    first = max(errors, key=lambda e: len(e["loc"]))
    kind = first["type"]
    if kind == "json_invalid":
        return bad_request(
            "We could not parse the JSON body of your request. The body must be valid JSON "
            f"({first['msg'].removeprefix('Invalid JSON: ')}).",
            code="invalid_json",
        )
    param = _param(tuple(first["loc"]))
    if param is None and kind == "model_type":
        return bad_request("The request body must be a JSON object.", code="invalid_type")
    if kind == "missing":
        return bad_request(
            f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter"
        )
    # A union reports one error per member at the same place: say all of them.
    alternatives = [e["msg"] for e in errors if _param(tuple(e["loc"])) == param]
    detail = "; or ".join(dict.fromkeys(alternatives))
    code = "invalid_type" if kind.endswith("_type") or kind.endswith("_parsing") else "invalid_value"
    return bad_request(f"Invalid value for '{param}': {detail}.", param=param, code=code)


# -- exception handlers ---------------------------------------------------------------------------


async def handle_api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def handle_http_exception(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's routing errors (unknown URL, wrong method) in the OpenAI shape."""
    assert isinstance(exc, HTTPException)
    url = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        message = f"Invalid URL ({url})."
        code = "not_found"
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        message = f"Method not allowed ({url}); this URL accepts {allowed or 'other methods'}."
        code = "method_not_allowed"
    else:
        message = str(exc.detail)
        code = None
    kind = SERVER_ERROR if exc.status_code >= 500 else INVALID_REQUEST
    return APIError(exc.status_code, message, type=kind, code=code, headers=exc.headers).response()


async def handle_client_disconnect(request: Request, exc: Exception) -> Response:
    """The client closed its connection before the body was read: nobody gets the answer."""
    log.info("client went away before %s %s was read whole", request.method, request.url.path)
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def handle_unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return APIError(
        500, "The server had an error while processing your request.", type=SERVER_ERROR
    ).response()


EXCEPTION_HANDLERS = {
    APIError: handle_api_error,
    HTTPException: handle_http_exception,
    ClientDisconnect: handle_client_disconnect,
    Exception: handle_unexpected,
}
