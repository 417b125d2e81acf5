"""Errors a session answers a client with. They are never fatal: the session's state is unchanged."""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    INVALID_EVENT = "invalid_event"
    UNKNOWN_PARAMETER = "unknown_parameter"
    MISSING_REQUIRED_PARAMETER = "missing_required_parameter"
    INVALID_VALUE = "invalid_value"
    INVALID_API_KEY = "invalid_api_key"
    COMMIT_EMPTY = "input_audio_buffer_commit_empty"
    ACTIVE_RESPONSE = "conversation_already_has_active_response"
    CANCEL_NOT_ACTIVE = "response_cancel_not_active"
    ITEM_NOT_FOUND = "item_not_found"
    SESSION_EXPIRED = "session_expired"
    INPUT_BACKPRESSURE = "input_backpressure"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    UNSUPPORTED = "unsupported"
    SERVER_VAD_INIT_FAILED = "server_vad_initialization_failed"
    IMAGE_LIMIT = "image_limit_exceeded"
    IDLE_TIMEOUT = "session_idle_timeout"
    SERVER_ERROR = "server_error"


class SessionError(Exception):
    """A client request the session refuses; becomes one ``error`` event."""

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        param: str | None = None,
        *,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.type = type
