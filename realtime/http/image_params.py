"""The ``POST /v1/images/generations`` body: validated, then turned into an ``ImageRequest``.

Fields follow ``openai.types.image_generate_params`` (types strict, as the OpenAI API). What
this server does with each:

- used: ``prompt``, ``model``, ``n``, ``size``, ``stream``, ``partial_images`` (streams only);
  and the extras ``seed``, ``num_inference_steps``, ``guidance_scale``, ``negative_prompt``,
  ``cache_backend`` and ``cache_config`` (the step cache; docs/http.md) (the SDK sends them with
  ``extra_body``);
- accepted and ignored, since nothing here depends on them: ``quality``, ``style``,
  ``complexity`` (the step count is the quality knob here), ``moderation`` (no moderation
  runs), ``user``, ``safety_identifier``;
- accepted when they ask for what is produced anyway: ``response_format: b64_json``,
  ``output_format: png``, ``background: opaque | auto``;
- refused with a 400: ``response_format: url`` (no files are served), other output formats,
  ``background: transparent``, ``output_compression`` (PNG is lossless), and the GIF/SVG
  parameters ``frame_count``, ``frame_duration_ms``, ``svg``.

Other unknown fields are ignored, as by the chat endpoint.
"""

from __future__ import annotations

from typing import Any, Literal

from omnirt.stages.diffusion.types import ImageRequest
from pydantic import BaseModel, ConfigDict, Field

from ..config import ServerConfig
from .media import check_prompt, check_range, check_step_cache, parse_size, unsupported

#: The OpenAI API's prompt limit (characters), also applied to ``negative_prompt``.
MAX_PROMPT_CHARS = 32_000
Quality = Literal["low", "medium", "high", "xhigh", "max", "auto", "standard", "hd"]


class ImageGenerateBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    prompt: str
    model: str | None = None
    n: int | None = None
    size: str | None = None
    response_format: Literal["url", "b64_json"] | None = None
    output_format: Literal["png", "webp", "jpeg", "gif", "svg"] | None = None
    output_compression: int | None = None
    background: Literal["transparent", "opaque", "auto"] | None = None
    quality: Quality | None = None
    style: Literal["vivid", "natural"] | None = None
    complexity: Literal["low", "medium", "high"] | None = None
    moderation: Literal["low", "auto"] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    frame_count: int | None = None
    frame_duration_ms: int | None = None
    svg: dict[str, Any] | None = None
    stream: bool | None = None
    partial_images: int | None = Field(default=None, ge=0, le=3)
    # -- extras
    seed: int | None = Field(default=None, ge=0, le=2**64 - 1)
    num_inference_steps: int | None = None
    guidance_scale: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    negative_prompt: str | None = None
    cache_backend: Literal["none", "teacache", "magcache"] | None = None
    cache_config: dict[str, Any] | None = None


def check_body(body: ImageGenerateBody, config: ServerConfig) -> tuple[int | None, int | None]:
    """Refuse what cannot be honoured (400 naming the parameter); the requested width and height."""
    if body.response_format == "url":
        raise unsupported(
            "response_format", "this server stores no files, so it cannot answer URLs; use 'b64_json'."
        )
    if body.output_format not in (None, "png"):
        raise unsupported("output_format", f"images are produced as PNG only, not {body.output_format!r}.")
    if body.output_compression is not None:
        raise unsupported("output_compression", "it applies to jpeg and webp; images here are PNG.")
    if body.background == "transparent":
        raise unsupported("background", "the models here draw opaque images; use 'opaque' or 'auto'.")
    for name in ("frame_count", "frame_duration_ms", "svg"):
        if getattr(body, name) is not None:
            raise unsupported(name, "it applies to GIF or SVG output; images here are PNG.")
    check_prompt(body.prompt, "prompt", MAX_PROMPT_CHARS, required=True)
    check_prompt(body.negative_prompt, "negative_prompt", MAX_PROMPT_CHARS, required=False)
    check_range(body.n, "n", 1, config.max_images_per_request)
    check_range(body.num_inference_steps, "num_inference_steps", 1, config.max_inference_steps)
    check_step_cache(body.cache_backend, body.cache_config)
    return parse_size(body.size, max_side=config.max_media_side)


def image_request(
    body: ImageGenerateBody, request_id: str, model: str, width: int | None, height: int | None
) -> ImageRequest:
    return ImageRequest(
        request_id=request_id,
        prompt=body.prompt,
        model=model,
        negative_prompt=body.negative_prompt,
        n=body.n or 1,
        width=width,
        height=height,
        num_inference_steps=body.num_inference_steps,
        guidance_scale=body.guidance_scale,
        seed=body.seed,
        # Previews only go to streams: a plain response would drop them.
        partial_images=(body.partial_images or 0) if body.stream else 0,
        cache_backend=body.cache_backend,
        cache_config=body.cache_config,
    )
