"""API-key check for the HTTP endpoints (``Authorization: Bearer KEY``)."""

from __future__ import annotations

from starlette.requests import Request

from ..auth import authorized, bearer_key
from .errors import invalid_api_key


def require_api_key(request: Request, keys: list[str]) -> None:
    """Raise a 401 ``invalid_api_key`` unless no keys are configured or one is presented."""
    if not authorized(request.headers, keys):
        raise invalid_api_key(presented=bearer_key(request.headers) is not None)
