"""Reading request bodies under the server's size limit, and JSON bodies into their models."""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from .errors import bad_request, body_too_large, from_validation_error

Body = TypeVar("Body", bound=BaseModel)


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body; 413 as soon as it is known to exceed ``limit`` bytes.

    A declared ``Content-Length`` over the limit is refused before anything is read; a chunked
    body is counted as it arrives and refused at the first chunk past the limit.
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise bad_request("Invalid Content-Length header.", code="invalid_value") from None
        if size > limit:
            raise body_too_large(limit)
    chunks: list[bytes] = []
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise body_too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def json_body(request: Request, model: type[Body], limit: int) -> Body:
    """A JSON endpoint's body: read under ``limit`` (413), then validated into ``model`` (400 in
    OpenAI's error shape). The caller checks the key and the content type first."""
    raw = await read_body(request, limit)
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
