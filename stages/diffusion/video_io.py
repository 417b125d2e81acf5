"""Frames to an H.264 MP4 with PyAV (FFmpeg's libx264), in memory.

The stream is yuv420p (what every browser and player takes), the ``moov`` atom up front
(``+faststart``: playable while it downloads), constant frame rate ``fps``.
"""

from __future__ import annotations

import logging
import os
import tempfile
from fractions import Fraction

import numpy as np
import torch

log = logging.getLogger(__name__)

#: x264's constant rate factor: 0 lossless, 23 its default; 18 is visually lossless.
DEFAULT_CRF = 18
DEFAULT_PRESET = "medium"


def encode_mp4(
    frames: np.ndarray | torch.Tensor,
    fps: int,
    *,
    crf: int = DEFAULT_CRF,
    preset: str = DEFAULT_PRESET,
) -> bytes:
    """H.264 (yuv420p) in MP4 of ``frames``: uint8 ``[frames, height, width, 3]`` RGB, at ``fps``
    frames per second. Height and width must be even (4:2:0 chroma is subsampled by 2)."""
    if isinstance(frames, torch.Tensor):
        frames = frames.detach().cpu().numpy()
    frames = np.asarray(frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(
            f"frames must be uint8 [frames, height, width, 3], got {frames.dtype} {frames.shape}"
        )
    count, height, width, _ = frames.shape
    if count < 1:
        raise ValueError("a video needs at least one frame")
    if height % 2 or width % 2:
        raise ValueError(f"H.264 yuv420p needs even dimensions, got {width}x{height}")
    if not isinstance(fps, int) or isinstance(fps, bool) or fps < 1:
        raise ValueError(f"fps must be a positive integer, got {fps!r}")
    if not 0 <= crf <= 51:
        raise ValueError(f"crf must be between 0 and 51, got {crf}")
    # +faststart rewrites the file in a second pass, which FFmpeg does by reopening it by name:
    # so the MP4 goes through a temporary file, not a BytesIO.
    with tempfile.TemporaryDirectory(prefix="omnirt-mp4-") as tmp:
        path = os.path.join(tmp, "video.mp4")
        _write(path, frames, fps, crf, preset)
        with open(path, "rb") as f:
            data = f.read()
    log.debug("encoded %d frames %dx%d at %d fps: %d bytes of MP4", count, width, height, fps, len(data))
    return data


def _write(path: str, frames: np.ndarray, fps: int, crf: int, preset: str) -> None:
    import av

    count, height, width, _ = frames.shape
    with av.open(path, mode="w", format="mp4", options={"movflags": "+faststart"}) as container:
        stream = container.add_stream("libx264", rate=Fraction(fps, 1))
        stream.width = width
        stream.height = height
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": str(crf), "preset": preset}
        for i in range(count):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(frames[i]), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))  # flush the encoder's delayed frames
