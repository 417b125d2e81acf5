"""Cancelling an engine request when its HTTP client goes away."""

from __future__ import annotations

import logging

from omnirt.stages.engine import RequestStream
from starlette.requests import Request

log = logging.getLogger(__name__)


async def cancel_on_disconnect(request: Request, stream: RequestStream) -> None:
    """Cancel ``stream`` when the client disconnects (the body has been read: only that can come).

    Run it as a task while the handler waits for the engine; cancel the task when done."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            log.info("client went away; cancelling %s", stream.request_id)
            stream.cancel()
            return
