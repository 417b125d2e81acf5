"""``POST /v1/chat/completions``: one engine request per call, text out, plain or streamed (SSE).

The response is only committed once the engine has answered something (usually ``Started``,
after the prompt is read): a request the engine refuses or cannot queue still gets a proper
HTTP error instead of a 200 stream that fails. From then on errors arrive as an SSE
``{"error": {...}}`` event, which the openai SDK raises as ``APIError``.

A client that goes away cancels its engine request: while waiting for the first output (and
for the whole of a non-streamed request) a task watches the connection for
``http.disconnect``; once streaming, Starlette cancels the body iterator on disconnect and
its ``finally`` cancels the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from omnirt.stages.engine import EngineClient, RequestStream
from omnirt.stages.prompt_size import prompt_chars, too_long_message
from omnirt.stages.types import Finished, Output, TextDelta, ToolCall, Usage
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..config import ServerConfig
from ..ids import ALPHABET
from .access import require_api_key
from .body import json_body
from .chat_input import check_supported, generation_request
from .chat_schema import ChatCompletionRequest
from .content_type import require_json
from .disconnect import cancel_on_disconnect
from .errors import APIError, from_engine_error, model_not_found

log = logging.getLogger(__name__)


def completion_id() -> str:
    return "chatcmpl-" + "".join(secrets.choice(ALPHABET) for _ in range(24))


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.input_tokens,
        "completion_tokens": usage.output_text_tokens,
        "total_tokens": usage.input_tokens + usage.output_text_tokens,
        "prompt_tokens_details": {
            "cached_tokens": usage.cached_tokens,
            "audio_tokens": usage.input_audio_tokens,
            "image_tokens": usage.input_image_tokens,
            "text_tokens": usage.input_text_tokens,
        },
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


class ChatCompletions:
    """The endpoint, bound to one engine client and server configuration."""

    def __init__(self, client: EngineClient, config: ServerConfig) -> None:
        self.client = client
        self.config = config

    async def create(self, request: Request) -> Response:
        require_api_key(request, self.config.api_keys)
        require_json(request)
        req = await json_body(request, ChatCompletionRequest, self.config.max_http_body_bytes)
        model_id = self.client.info.id
        if req.model != model_id:
            raise model_not_found(req.model)
        check_supported(req)
        cid = completion_id()
        gen = await run_in_threadpool(
            generation_request, req, cid, max_output_tokens=self.config.max_output_tokens
        )
        context = self.client.info.max_context_tokens
        too_long = too_long_message(prompt_chars(gen.messages, gen.tools), context)
        if too_long is not None:  # refused before the engine tokenises it
            raise APIError(400, too_long, param="messages", code="context_length_exceeded")
        stream = self.client.submit(gen)
        created = int(time.time())
        watcher = asyncio.create_task(cancel_on_disconnect(request, stream))
        streaming = False
        try:
            if req.stream:
                outputs = aiter(stream)
                first = await anext(outputs)
                if isinstance(first, Finished):
                    return _complete_or_raise(first, "", [], cid, created, model_id)
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                events = _sse(stream, first, outputs, cid, created, model_id, include_usage)
                # The background task runs after the body ends, disconnect included: a stream
                # whose iterator was left suspended at a ``yield`` is cancelled there.
                streaming = True
                return StreamingResponse(
                    events,
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache"},
                    background=BackgroundTask(stream.cancel),
                )
            text: list[str] = []
            calls: list[ToolCall] = []
            async for output in stream:
                if isinstance(output, TextDelta):
                    text.append(output.text)
                elif isinstance(output, ToolCall):
                    calls.append(output)
                elif isinstance(output, Finished):
                    return _complete_or_raise(output, "".join(text), calls, cid, created, model_id)
            raise RuntimeError("engine stream ended without Finished")
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            if not streaming:  # an error or this task's cancellation: the request must not run on
                stream.cancel()  # a no-op once it has finished


def call_id() -> str:
    return "call_" + "".join(secrets.choice(ALPHABET) for _ in range(24))


def _finish_reason(finished: Finished, calls: int) -> str:
    """``tool_calls`` when the model called and stopped; otherwise ``stop`` or ``length``."""
    return "tool_calls" if calls and finished.reason == "stop" else finished.reason


def _complete_or_raise(
    finished: Finished, text: str, calls: list[ToolCall], cid: str, created: int, model: str
) -> JSONResponse:
    if finished.reason == "error":
        raise from_engine_error(finished)
    if finished.reason == "cancelled":
        # Only the client's disconnect or a shutdown cancel a chat request.
        raise APIError(503, "The request was cancelled before it completed.", type="server_error")
    message: dict[str, Any] = {
        "role": "assistant",
        # null when the model only called (as OpenAI answers), "" when it said nothing at all
        "content": text or (None if calls else ""),
        "refusal": None,
        "annotations": [],
    }
    if calls:
        message["tool_calls"] = [
            {"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ]
    body = {
        "id": cid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": _finish_reason(finished, len(calls)),
            }
        ],
        "usage": usage_body(finished.usage),
        "service_tier": None,
        "system_fingerprint": None,
    }
    return JSONResponse(body)


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _sse(
    stream: RequestStream,
    first: Output,
    outputs: AsyncIterator[Output],
    cid: str,
    created: int,
    model: str,
    include_usage: bool,
) -> AsyncIterator[str]:
    head: dict[str, Any] = {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": None,
    }

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> str:
        body: dict[str, Any] = {
            **head,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
        }
        if include_usage:
            body["usage"] = None
        return _event(body)

    said = False  # the role goes with the first delta: content "" before text, null before a call
    calls = 0
    try:
        output: Output | None = first
        while output is not None:
            if isinstance(output, TextDelta) and output.text:
                if not said:
                    yield chunk({"role": "assistant", "content": ""})
                    said = True
                yield chunk({"content": output.text})
            elif isinstance(output, ToolCall):
                opening = {} if said else {"role": "assistant", "content": None}
                said = True
                function = {"name": output.name, "arguments": ""}
                call = {"index": calls, "id": call_id(), "type": "function", "function": function}
                yield chunk({**opening, "tool_calls": [call]})
                if output.arguments:
                    arguments = {"index": calls, "function": {"arguments": output.arguments}}
                    yield chunk({"tool_calls": [arguments]})
                calls += 1
            elif isinstance(output, Finished):
                if output.reason in ("stop", "length"):
                    if not said:
                        yield chunk({"role": "assistant", "content": ""})
                    yield chunk({}, _finish_reason(output, calls))
                    if include_usage:
                        yield _event({**head, "choices": [], "usage": usage_body(output.usage)})
                    yield "data: [DONE]\n\n"
                elif output.reason == "error":
                    yield _event(from_engine_error(output).body())
                else:
                    yield _event(APIError(503, "The request was cancelled.", type="server_error").body())
                return
            output = await anext(outputs, None)
    finally:
        if stream.finished is None:
            log.info("stream of %s closed early; cancelling it", stream.request_id)
            stream.cancel()
