"""One line, not a traceback, for the client mistakes that the transport (uvicorn) logs as errors.

uvicorn's WebSocket protocol meets a text frame that is not valid UTF-8 with ``logger.exception``
(a traceback at ERROR on ``uvicorn.error``) and closes the connection with 1007 (invalid frame
payload data, as RFC 6455 asks). The close is right; the traceback is not: it is the client's
doing, and any client could fill the log with them. :class:`ClientFaultFilter` turns that record
into one INFO line without the traceback (dropped when the logger is not at INFO).
"""

from __future__ import annotations

import logging

TRANSPORT_LOGGER = "uvicorn.error"
#: The message uvicorn logs with the traceback, and the line logged instead.
INVALID_UTF8 = "Invalid UTF-8 sequence received from client."
INVALID_UTF8_LINE = "a client sent a text frame that is not valid UTF-8; closed its connection with 1007"


class ClientFaultFilter(logging.Filter):
    """Rewrites the transport's tracebacks for client mistakes as one INFO line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != INVALID_UTF8:
            return True
        if not logging.getLogger(record.name).isEnabledFor(logging.INFO):
            return False
        record.msg, record.args = INVALID_UTF8_LINE, ()
        record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        record.exc_info = record.exc_text = None
        return True


def quiet_client_faults() -> None:
    """Install :class:`ClientFaultFilter` on uvicorn's logger (once; after uvicorn has set up
    its logging, which keeps a logger's filters)."""
    logger = logging.getLogger(TRANSPORT_LOGGER)
    if not any(isinstance(f, ClientFaultFilter) for f in logger.filters):
        logger.addFilter(ClientFaultFilter())
