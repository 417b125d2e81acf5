"""``POST /v1/images/generations``: one engine request per call, PNGs out as base64, plain or
streamed (SSE) with previews.

Plain: ``{"created", "data": [{"b64_json"}...], "background", "output_format", "size",
"usage"}`` as ``openai.types.ImagesResponse``. Streamed (``stream: true``): an
``image_generation.partial_image`` event per preview (``partial_images`` of them per image,
decoded from intermediate latents), then an ``image_generation.completed`` event per image once
the request has finished, each with the usage of the whole request, as
``openai.types.ImageGenStreamEvent``. With ``n > 1`` every event also carries ``index``, the
image it belongs to (the OpenAI events have no such field; the SDK keeps it).

As in chat completions, nothing is committed before the engine's first output (the first
denoising step's progress), so input the model refuses still gets a 400; later errors arrive as
an ``error`` event. A client that goes away cancels the request.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import struct
import time
from collections.abc import AsyncIterator
from typing import Any

from omnirt.stages.diffusion.types import GeneratedImage, ImagePreview, ImageRequest, Progress
from omnirt.stages.engine import EngineClient, RequestStream
from omnirt.stages.types import Finished
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..config import ServerConfig
from ..ids import new_id
from .access import require_api_key
from .body import json_body
from .content_type import require_json
from .disconnect import cancel_on_disconnect
from .errors import APIError, from_engine_error
from .image_params import ImageGenerateBody, check_body, image_request
from .media import ProgressLog, choose_model, image_usage, sse

log = logging.getLogger(__name__)


def png_size(data: bytes) -> str:
    """``"WxH"`` of a PNG, from its IHDR chunk."""
    width, height = struct.unpack(">II", data[16:24])
    return f"{width}x{height}"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _cancelled() -> APIError:
    return APIError(503, "The request was cancelled before it completed.", type="server_error")


class ImageGenerations:
    """The endpoint, bound to one engine client and server configuration."""

    def __init__(self, client: EngineClient, config: ServerConfig) -> None:
        self.client = client
        self.config = config

    async def create(self, request: Request) -> Response:
        require_api_key(request, self.config.api_keys)
        require_json(request)
        body = await json_body(request, ImageGenerateBody, self.config.max_http_body_bytes)
        width, height = check_body(body, self.config)
        probe = ImageRequest(request_id="", prompt="")
        model = choose_model(self.client, body.model, probe, "image generation")
        rid = new_id("img")
        stream = self.client.submit(image_request(body, rid, model, width, height))
        progress = ProgressLog(f"image {rid} ({model})", self.config.progress_log_seconds)
        watcher = asyncio.create_task(cancel_on_disconnect(request, stream))
        streaming = False
        try:
            outputs = aiter(stream)
            if body.stream:
                first = await anext(outputs)
                if isinstance(first, Finished):
                    _raise_if_failed(first, progress)
                quality = body.quality if body.quality not in (None, "standard", "hd") else "auto"
                events = _events(stream, first, outputs, progress, quality, body.n or 1)
                streaming = True  # the background task runs after the body ends, disconnect included
                return StreamingResponse(
                    events,
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache"},
                    background=BackgroundTask(stream.cancel),
                )
            images: dict[int, GeneratedImage] = {}
            async for output in outputs:
                if isinstance(output, Progress):
                    progress.step(output.done, output.total)
                elif isinstance(output, GeneratedImage):
                    images[output.index] = output
                elif isinstance(output, Finished):
                    _raise_if_failed(output, progress)
                    progress.end("done")
                    return JSONResponse(_response(images, output))
            raise RuntimeError("engine stream ended without Finished")
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            if not streaming:
                stream.cancel()  # a no-op once it has finished


def _raise_if_failed(finished: Finished, progress: ProgressLog) -> None:
    if finished.reason == "error":
        progress.end(f"failed ({finished.code}: {finished.error})")
        raise from_engine_error(finished)
    if finished.reason == "cancelled":
        progress.end("cancelled")
        raise _cancelled()


def _response(images: dict[int, GeneratedImage], finished: Finished) -> dict[str, Any]:
    ordered = [images[i] for i in sorted(images)]
    return {
        "created": int(time.time()),
        "data": [{"b64_json": _b64(image.png), "revised_prompt": None, "url": None} for image in ordered],
        "background": "opaque",
        "output_format": "png",
        "size": f"{ordered[0].width}x{ordered[0].height}" if ordered else None,
        "usage": image_usage(finished.usage),
    }


async def _events(
    stream: RequestStream,
    first: Any,
    outputs: AsyncIterator[Any],
    progress: ProgressLog,
    quality: str,
    n: int,
) -> AsyncIterator[str]:
    head = {"background": "opaque", "output_format": "png", "quality": quality}
    images: dict[int, GeneratedImage] = {}
    try:
        output: Any = first
        while output is not None:
            if isinstance(output, Progress):
                progress.step(output.done, output.total)
            elif isinstance(output, ImagePreview):
                event = {
                    "type": "image_generation.partial_image",
                    **head,
                    "b64_json": _b64(output.png),
                    "created_at": int(time.time()),
                    "partial_image_index": output.partial_index,
                    "size": png_size(output.png),
                }
                if n > 1:
                    event["index"] = output.index
                yield sse(event["type"], event)
            elif isinstance(output, GeneratedImage):
                images[output.index] = output
            elif isinstance(output, Finished):
                if output.reason in ("stop", "length"):
                    progress.end("done")
                    usage = image_usage(output.usage)
                    for index in sorted(images):
                        image = images[index]
                        event = {
                            "type": "image_generation.completed",
                            **head,
                            "b64_json": _b64(image.png),
                            "created_at": int(time.time()),
                            "size": f"{image.width}x{image.height}",
                            "usage": usage,
                        }
                        if n > 1:
                            event["index"] = index
                        yield sse(event["type"], event)
                else:
                    error = from_engine_error(output) if output.reason == "error" else _cancelled()
                    progress.end(f"failed ({output.code}: {output.error})")
                    yield sse("error", error.body())
                return
            output = await anext(outputs, None)
    finally:
        if stream.finished is None:
            log.info("image stream %s closed early; cancelling it", stream.request_id)
            stream.cancel()
