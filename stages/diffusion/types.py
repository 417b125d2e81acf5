"""The typed boundary between the HTTP handlers and the diffusion pipelines.

A handler builds an :class:`ImageRequest` or :class:`VideoRequest` and reads back a stream of
:class:`Progress` (after every denoising step), :class:`ImagePreview` (when previews were asked
for), the results (:class:`GeneratedImage` per image, or one :class:`GeneratedVideo`) and one final
:class:`~omnirt.stages.types.Finished`. Nothing here knows about HTTP or about model internals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ImageRequest:
    request_id: str
    prompt: str
    #: The pipeline (model id) asked for; None: the server's default image model.
    model: str | None = None
    negative_prompt: str | None = None
    n: int = 1
    width: int | None = None  # None: the model's default
    height: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = None
    #: Previews decoded from intermediate latents, sent as :class:`ImagePreview` (0 to 3).
    partial_images: int = 0
    #: Step cache: ``none``, ``teacache`` or ``magcache`` (None: the server's default), and its
    #: settings (``stages/diffusion/cache/config.py``); checked by the pipeline's ``prepare``.
    cache_backend: str | None = None
    cache_config: dict[str, Any] | None = None


@dataclass
class VideoRequest:
    request_id: str
    prompt: str
    model: str | None = None
    negative_prompt: str | None = None
    width: int | None = None
    height: int | None = None
    num_frames: int | None = None
    fps: int | None = None
    #: Clip length asked for (the videos API's ``seconds``); with ``num_frames`` None the pipeline
    #: picks the frame count its model allows nearest this length at its fps. Never both set.
    seconds: float | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = None
    cache_backend: str | None = None  # as ImageRequest's
    cache_config: dict[str, Any] | None = None


DiffusionRequest = ImageRequest | VideoRequest


@dataclass(frozen=True)
class Progress:
    """Denoising steps done of ``total`` (for the whole request; every image of it together)."""

    done: int
    total: int


@dataclass(frozen=True)
class ImagePreview:
    """A preview of image ``index`` decoded from intermediate latents, PNG-encoded;
    ``partial_index`` counts the previews of that image from 0."""

    index: int
    partial_index: int
    png: bytes


@dataclass(frozen=True)
class GeneratedImage:
    """Final image ``index`` (0 to n-1) of the request, PNG-encoded."""

    index: int
    png: bytes
    width: int
    height: int


@dataclass(frozen=True)
class GeneratedVideo:
    """The finished video: H.264 in an MP4 container."""

    mp4: bytes
    width: int
    height: int
    frames: int
    fps: int


DiffusionOutput = Progress | ImagePreview | GeneratedImage | GeneratedVideo
