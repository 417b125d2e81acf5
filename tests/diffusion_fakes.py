"""Stand-in diffusion pipelines, for testing the HTTP endpoints and the CLI plumbing fast.

Both run inside the real :class:`~omnirt.stages.engine.Engine` at ``BATCH`` priority, one
denoising step of every admitted request per engine step (``step_seconds`` long), and speak the
boundary of :mod:`omnirt.stages.diffusion.types`:

- :class:`FakeImagePipeline` (kind ``image``): ``Progress`` after every step, ``partial_images``
  previews spread over the steps, then one ``GeneratedImage`` per image and ``Finished``. Image
  ``i`` is a real PNG of one colour, :func:`image_colour` ``(seed, i)``; a preview is that colour
  scaled by the fraction of steps done. Its prepare rejects, as a model would, sizes that are not
  multiples of 16, more than :attr:`max_steps` steps and the prompt ``"reject me"``.
- :class:`FakeVideoPipeline` (kind ``video``): ``Progress`` after every step, then one
  ``GeneratedVideo``, a real H.264 MP4 (PyAV) whose frames are all :func:`image_colour`
  ``(seed, 0)``, and ``Finished``. Frame counts must be ``4k + 1`` (as Wan's); ``seconds``
  becomes ``seconds * fps + 1`` frames.

Each accepts its request type when the request names no model or its own model id.
"""

from __future__ import annotations

import collections
import io
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import av
import numpy as np
from omnirt.stages.diffusion.types import (
    GeneratedImage,
    GeneratedVideo,
    ImagePreview,
    ImageRequest,
    Progress,
    VideoRequest,
)
from omnirt.stages.pipeline import CallCounter, Priority, RequestRejected
from omnirt.stages.types import Finished, ModelInfo, Usage
from PIL import Image


def image_colour(seed: int, index: int) -> tuple[int, int, int]:
    """The colour of image ``index`` of a request with ``seed``."""
    rng = random.Random(seed * 1000 + index)
    return rng.randrange(256), rng.randrange(256), rng.randrange(256)


def png(colour: tuple[int, int, int], width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(out, format="PNG")
    return out.getvalue()


def mp4(colour: tuple[int, int, int], width: int, height: int, frames: int, fps: int) -> bytes:
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        pixels = np.full((height, width, 3), colour, dtype=np.uint8)
        for _ in range(frames):
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def _seed(seed: int | None) -> int:
    return seed if seed is not None else random.randrange(2**32)


@dataclass
class _Job:
    request: Any
    seed: int
    width: int
    height: int
    total: int
    done: int = 0
    #: Steps after which a preview is sent (images).
    previews: list[int] = field(default_factory=list)
    frames: int = 0
    fps: int = 0


class _FakeDiffusion:
    kind: str
    priority = Priority.BATCH
    request_type: type

    def __init__(
        self, model_id: str, *, step_seconds: float = 0.0, default_steps: int = 4, slots: int = 4
    ) -> None:
        self.info = ModelInfo(
            id=model_id, architecture=f"fake-{self.kind}", random_weights=True, source="tests"
        )
        self.step_seconds = step_seconds
        self.default_steps = default_steps
        self.slots = slots
        self.max_steps = 50
        self.active: dict[str, _Job] = {}
        self.calls: CallCounter = collections.Counter()
        #: Every request admitted, in order (tests read what the HTTP layer built).
        self.seen: list[Any] = []

    def accepts(self, request: object) -> bool:
        return isinstance(request, self.request_type) and request.model in (None, self.info.id)  # type: ignore[attr-defined]

    def _common(self, request: ImageRequest | VideoRequest, width: int, height: int) -> int:
        if request.prompt.strip() == "reject me":
            raise RequestRejected(f"the fake {self.kind} model rejects this prompt")
        if width % 16 or height % 16:
            raise RequestRejected(f"width and height must be multiples of 16, got {width}x{height}")
        steps = request.num_inference_steps or self.default_steps
        if steps > self.max_steps:
            raise RequestRejected(f"num_inference_steps must be at most {self.max_steps}, got {steps}")
        return steps

    def can_add(self) -> bool:
        return len(self.active) < self.slots

    def add(self, request: Any, prepared: _Job) -> None:
        self.seen.append(request)
        self.active[request.request_id] = prepared

    def has_work(self) -> bool:
        return bool(self.active)

    def next_deadline(self) -> float | None:
        return None

    def step_cost(self) -> float:
        return self.step_seconds

    def step(self) -> list[tuple[str, Any]]:
        if self.step_seconds:
            time.sleep(self.step_seconds)
        self.calls["denoise", len(self.active)] += 1
        out: list[tuple[str, Any]] = []
        for rid, job in list(self.active.items()):
            job.done += 1
            out.append((rid, Progress(job.done, job.total)))
            out += [(rid, o) for o in self._outputs(job)]
            if job.done == job.total:
                del self.active[rid]
                tokens = len(job.request.prompt.split())
                out.append((rid, Finished("stop", Usage(input_text_tokens=tokens))))
        return out

    def _outputs(self, job: _Job) -> list[Any]:
        raise NotImplementedError

    def remove(self, request_id: str) -> Usage | None:
        return Usage() if self.active.pop(request_id, None) is not None else None


class FakeImagePipeline(_FakeDiffusion):
    kind = "image"
    request_type = ImageRequest

    def __init__(self, model_id: str = "image-test", **kwargs: Any) -> None:
        super().__init__(model_id, **kwargs)
        self.default_size = (64, 48)

    def prepare(self, request: ImageRequest) -> _Job:
        width = request.width or self.default_size[0]
        height = request.height or self.default_size[1]
        steps = self._common(request, width, height)
        p = request.partial_images
        previews = [math.ceil((k + 1) * steps / (p + 1)) for k in range(p)]
        return _Job(request, _seed(request.seed), width, height, steps, previews=previews)

    def _outputs(self, job: _Job) -> list[Any]:
        request: ImageRequest = job.request
        out: list[Any] = []
        for i in range(request.n):
            colour = image_colour(job.seed, i)
            for partial_index in [k for k, at in enumerate(job.previews) if at == job.done]:
                dim = tuple(c * job.done // job.total for c in colour)
                out.append(ImagePreview(i, partial_index, png(dim, job.width, job.height)))  # type: ignore[arg-type]
        if job.done == job.total:
            for i in range(request.n):
                image = png(image_colour(job.seed, i), job.width, job.height)
                out.append(GeneratedImage(i, image, job.width, job.height))
        return out


class FakeVideoPipeline(_FakeDiffusion):
    kind = "video"
    request_type = VideoRequest

    def __init__(self, model_id: str = "video-test", **kwargs: Any) -> None:
        super().__init__(model_id, **kwargs)
        self.default_size = (32, 32)
        self.default_frames = 5
        self.default_fps = 8

    def prepare(self, request: VideoRequest) -> _Job:
        width = request.width or self.default_size[0]
        height = request.height or self.default_size[1]
        steps = self._common(request, width, height)
        fps = request.fps or self.default_fps
        frames = request.num_frames or self.default_frames
        if request.seconds is not None:
            frames = round(request.seconds * fps) + 1
        if (frames - 1) % 4:
            raise RequestRejected(f"num_frames must be 4k + 1, got {frames}")
        return _Job(request, _seed(request.seed), width, height, steps, frames=frames, fps=fps)

    def _outputs(self, job: _Job) -> list[Any]:
        if job.done < job.total:
            return []
        video = mp4(image_colour(job.seed, 0), job.width, job.height, job.frames, job.fps)
        return [GeneratedVideo(video, job.width, job.height, job.frames, job.fps)]
