"""What the image and video endpoints share: sizes, model choice, usage, progress logging, SSE.

The HTTP layer checks what holds for every model (the shape of ``size``, server-wide limits on
steps and counts); what one model allows (multiples of 16, frame counts, its own step limits) is
its pipeline's ``prepare`` to say, as a ``rejected`` ``Finished`` that becomes a 400.
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Any

from omnirt.stages.engine import EngineClient
from omnirt.stages.types import Usage

from .errors import APIError, bad_request

log = logging.getLogger(__name__)

_SIZE = re.compile(r"(\d{1,5})x(\d{1,5})")


def parse_size(size: str | None, *, max_side: int, param: str = "size") -> tuple[int | None, int | None]:
    """``"WxH"`` as ``(W, H)``; ``None`` or ``"auto"`` as ``(None, None)`` (the model's default)."""
    if size is None or size == "auto":
        return None, None
    match = _SIZE.fullmatch(size)
    if match is None:
        raise bad_request(
            f"Invalid value for '{param}': expected 'WIDTHxHEIGHT' (e.g. '1024x1024') or 'auto', "
            f"got {size!r}.",
            param=param,
        )
    width, height = int(match[1]), int(match[2])
    if not (1 <= width <= max_side and 1 <= height <= max_side):
        raise bad_request(
            f"Invalid value for '{param}': width and height must be between 1 and {max_side}, got {size!r}.",
            param=param,
        )
    return width, height


def check_range(value: int | None, param: str, low: int, high: int) -> None:
    if value is not None and not low <= value <= high:
        raise bad_request(
            f"Invalid value for '{param}': must be between {low} and {high}, got {value}.", param=param
        )


def check_prompt(text: str | None, param: str, max_chars: int, *, required: bool) -> None:
    if text is None:
        return
    if required and not text.strip():
        raise bad_request(f"Invalid value for '{param}': the prompt is empty.", param=param)
    if len(text) > max_chars:
        raise bad_request(
            f"Invalid value for '{param}': at most {max_chars} characters, got {len(text)}.", param=param
        )


def check_step_cache(backend: str | None, config: dict[str, Any] | None) -> None:
    """``cache_backend`` and ``cache_config`` (the step cache, :mod:`omnirt.stages.diffusion.cache.config`):
    a 400 naming what is wrong. Whether the model has a calibration is its pipeline's to say."""
    from omnirt.stages.diffusion.cache.config import parse_options

    try:
        parse_options(backend, config)
    except ValueError as exc:
        param = "cache_config" if str(exc).startswith("cache_config") else "cache_backend"
        raise bad_request(f"Invalid value for '{param}': {exc}.", param=param) from None


def unsupported(param: str, message: str) -> APIError:
    return bad_request(f"Unsupported value for '{param}': {message}", param=param, code="unsupported_value")


def choose_model(client: EngineClient, requested: str | None, probe: object, what: str) -> str:
    """The id of the model that serves ``probe``'s request type (``what``: "image generation").

    ``requested`` None: the first such model. A model that exists but does not serve the request
    type is a 400; an unknown one, or none loaded at all, a 404 ``model_not_found``.
    """
    serving = [p.info.id for p in client.engine.pipelines.values() if p.accepts(probe)]
    if requested is None:
        if not serving:
            raise APIError(
                404, f"This server has no {what} model loaded.", param="model", code="model_not_found"
            )
        return serving[0]
    if requested in serving:
        return requested
    if any(info.id == requested for info in client.infos):
        listed = ", ".join(f"`{m}`" for m in serving) or "none"
        raise bad_request(
            f"The model `{requested}` does not do {what}; models here that do: {listed}.", param="model"
        )
    raise APIError(
        404,
        f"The model `{requested}` does not exist or you do not have access to it.",
        param="model",
        code="model_not_found",
    )


def image_usage(usage: Usage) -> dict[str, Any]:
    """The images API's usage object from an engine ``Usage`` (prompt tokens in, nothing counted out)."""
    return {
        "input_tokens": usage.input_tokens,
        "input_tokens_details": {
            "image_tokens": usage.input_image_tokens,
            "text_tokens": usage.input_text_tokens,
        },
        "output_tokens": usage.output_tokens,
        "total_tokens": usage.input_tokens + usage.output_tokens,
    }


def sse(event: str, data: dict[str, Any]) -> str:
    body = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event}\ndata: {body}\n\n"


class ProgressLog:
    """Logs a generation's progress: when its first step is done, then at most every
    ``interval`` seconds, then its end (with the time it took)."""

    def __init__(self, name: str, interval: float) -> None:
        self.name = name
        self.interval = interval
        self.started = time.monotonic()
        self._last: float | None = None

    def step(self, done: int, total: int) -> None:
        now = time.monotonic()
        if self._last is None or now - self._last >= self.interval or done == total:
            self._last = now
            log.info(
                "%s: step %d/%d (%d%%), %.1f s",
                self.name,
                done,
                total,
                100 * done // max(total, 1),
                now - self.started,
            )

    def end(self, outcome: str) -> None:
        log.info("%s: %s after %.1f s", self.name, outcome, time.monotonic() - self.started)
