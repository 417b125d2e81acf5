"""Errors a session answers a client with. They are never fatal: the session's state is unchanged.

Codes are OpenAI's wherever the OpenAI Realtime API has one for the same case (clients match on
them: pipecat waits for ``item_retrieve_invalid_item_id``, many treat other codes as fatal); the
rest are documented extensions. ``docs/realtime.md`` lists every code beside OpenAI's.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    # -- the frame and its fields (OpenAI's generic validation codes) --------------------------
    INVALID_EVENT = "invalid_event"
    INVALID_JSON = "invalid_json"
    UNKNOWN_PARAMETER = "unknown_parameter"
    MISSING_REQUIRED_PARAMETER = "missing_required_parameter"
    INVALID_VALUE = "invalid_value"
    INVALID_TYPE = "invalid_type"
    INTEGER_BELOW_MIN = "integer_below_min_value"
    INTEGER_ABOVE_MAX = "integer_above_max_value"
    DECIMAL_BELOW_MIN = "decimal_below_min_value"
    DECIMAL_ABOVE_MAX = "decimal_above_max_value"
    STRING_ABOVE_MAX_LENGTH = "string_above_max_length"
    # -- connection and session --------------------------------------------------------------
    INVALID_API_KEY = "invalid_api_key"
    SESSION_EXPIRED = "session_expired"
    CANNOT_UPDATE_VOICE = "cannot_update_voice"
    # -- input audio and conversation items --------------------------------------------------
    COMMIT_EMPTY = "input_audio_buffer_commit_empty"
    ITEM_CREATE_DUPLICATE_ID = "item_create_duplicate_item_id"
    ITEM_CREATE_INVALID_PREVIOUS_ID = "item_create_invalid_previous_item_id"
    ITEM_RETRIEVE_INVALID_ID = "item_retrieve_invalid_item_id"
    ITEM_DELETE_INVALID_ID = "item_delete_invalid_item_id"
    ITEM_TRUNCATE_INVALID_ID = "item_truncate_invalid_item_id"
    UNSUPPORTED_CONTENT_TYPE = "unsupported_content_type"
    # -- responses ---------------------------------------------------------------------------
    ACTIVE_RESPONSE = "conversation_already_has_active_response"
    CANCEL_NOT_ACTIVE = "response_cancel_not_active"
    SERVER_ERROR = "server_error"
    # -- extensions: cases the OpenAI API has no code for --------------------------------------
    INPUT_BACKPRESSURE = "input_backpressure"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    UNSUPPORTED = "unsupported"
    SERVER_VAD_INIT_FAILED = "server_vad_initialization_failed"
    IMAGE_LIMIT = "image_limit_exceeded"
    CONVERSATION_LIMIT = "conversation_limit_exceeded"
    #: OpenAI's Chat Completions code for a prompt over the model's context.
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    IDLE_TIMEOUT = "session_idle_timeout"


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
