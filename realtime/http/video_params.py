"""The ``POST /v1/videos`` body: multipart form (as the SDK sends it) or JSON, validated, then
turned into a ``VideoRequest``.

Form fields are all text, so values are converted as pydantic's lax mode does (``"8"`` is the
integer 8); JSON bodies are read the same way. Used: ``prompt``, ``model``, ``seconds`` (any
positive length, not only OpenAI's 4, 8, 12: the model makes the frame count it allows nearest
to it), ``size`` (``"WxH"``; omitted: the model's default) and the extras ``seed``,
``num_inference_steps``, ``guidance_scale``, ``negative_prompt``, ``num_frames``, ``fps``
(``seconds`` and ``num_frames`` are exclusive), ``cache_backend`` and ``cache_config`` (the step
cache; in a form, ``cache_config`` is a JSON object in text). ``input_reference`` (image-to-video) is refused:
the video models here are text-to-video. Other fields are ignored.
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic_core
from omnirt.stages.diffusion.types import VideoRequest
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.datastructures import UploadFile
from starlette.requests import Request

from ..config import ServerConfig
from ..protocol import json_text
from .errors import bad_request, from_validation_error
from .image_params import MAX_PROMPT_CHARS
from .media import check_prompt, check_range, check_step_cache, parse_size, unsupported


class VideoCreateBody(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    prompt: str
    model: str | None = None
    seconds: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    size: str | None = None
    input_reference: Any = None
    # -- extras
    seed: int | None = Field(default=None, ge=0, le=2**64 - 1)
    num_inference_steps: int | None = None
    guidance_scale: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    negative_prompt: str | None = None
    num_frames: int | None = None
    fps: int | None = None
    cache_backend: Literal["none", "teacache", "magcache"] | None = None
    cache_config: dict[str, Any] | None = None

    @field_validator("cache_config", mode="before")
    @classmethod
    def _json_text(cls, value: Any) -> Any:
        """A form field holds text: ``cache_config`` is a JSON object in it."""
        if isinstance(value, str):
            try:
                return json_text.loads(value)
            except json_text.InvalidJson:
                raise ValueError("cache_config must be a JSON object") from None
        return value


async def read_fields(request: Request, body: bytes) -> dict[str, Any]:
    """The body's fields: a multipart or urlencoded form, else a JSON object."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind in ("multipart/form-data", "application/x-www-form-urlencoded"):

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        async with Request(request.scope, receive).form(max_files=4, max_fields=64) as form:
            fields: dict[str, Any] = {}
            for name, value in form.multi_items():
                if isinstance(value, UploadFile):
                    if name == "input_reference":
                        raise _no_reference()
                    continue  # a file nobody asked for
                fields[name] = value
            return fields
    try:
        # pydantic's parser, as the other JSON endpoints read their bodies: it refuses what no
        # later step could handle either (lone surrogates in strings, which no UTF-8 encoder takes:
        # the model's tokenizer and the job's own JSON would fail on them).
        fields = pydantic_core.from_json(body)
    except ValueError as exc:
        raise bad_request(
            f"We could not parse the body of your request: send a multipart form or a JSON object ({exc}).",
            code="invalid_json",
        ) from None
    if not isinstance(fields, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_type")
    return fields


def _no_reference() -> Exception:
    return unsupported("input_reference", "the video models here are text-to-video only.")


def parse_body(fields: dict[str, Any], config: ServerConfig) -> VideoCreateBody:
    try:
        body = VideoCreateBody.model_validate(fields)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    if body.input_reference not in (None, ""):
        raise _no_reference()
    check_prompt(body.prompt, "prompt", MAX_PROMPT_CHARS, required=True)
    check_prompt(body.negative_prompt, "negative_prompt", MAX_PROMPT_CHARS, required=False)
    check_range(body.num_inference_steps, "num_inference_steps", 1, config.max_inference_steps)
    check_range(body.num_frames, "num_frames", 1, config.max_video_frames)
    check_range(body.fps, "fps", 1, config.max_video_fps)
    if body.seconds is not None and body.seconds > config.max_video_seconds:
        raise bad_request(
            f"Invalid value for 'seconds': at most {config.max_video_seconds:g}, got {body.seconds:g}.",
            param="seconds",
        )
    if body.seconds is not None and body.num_frames is not None:
        raise bad_request(
            "Give 'seconds' or 'num_frames', not both: each sets the clip's length.", param="num_frames"
        )
    check_step_cache(body.cache_backend, body.cache_config)
    parse_size(body.size, max_side=config.max_media_side)
    return body


def video_request(body: VideoCreateBody, request_id: str, model: str, config: ServerConfig) -> VideoRequest:
    width, height = parse_size(body.size, max_side=config.max_media_side)
    return VideoRequest(
        request_id=request_id,
        prompt=body.prompt,
        model=model,
        negative_prompt=body.negative_prompt,
        width=width,
        height=height,
        num_frames=body.num_frames,
        fps=body.fps,
        seconds=body.seconds,
        num_inference_steps=body.num_inference_steps,
        guidance_scale=body.guidance_scale,
        seed=body.seed,
        cache_backend=body.cache_backend,
        cache_config=body.cache_config,
    )
