"""MP4 encoding (PyAV, H.264 yuv420p), checked by decoding it back with PyAV."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
import torch
from av.video.reformatter import Interpolation
from omnirt.stages.diffusion.video_io import encode_mp4


def moving_gradient(frames: int, height: int, width: int) -> np.ndarray:
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    out = []
    for t in range(frames):
        r = 128 + 100 * np.sin((x + 3 * t) / 9.0)
        g = 128 + 100 * np.cos((y - 2 * t) / 7.0)
        b = np.full_like(x, 40 + 20 * t)
        out.append(np.stack([r, g, b], -1))
    return np.clip(np.stack(out), 0, 255).astype(np.uint8)


#: swscale's default YUV-to-RGB path is a fast table (off by 2-3 levels even on flat colours):
#: decode with accurate rounding and full chroma interpolation, as a careful player does.
ACCURATE = Interpolation.BICUBIC | Interpolation.ACCURATE_RND | Interpolation.FULL_CHR_H_INT


def decode(data: bytes) -> tuple[np.ndarray, av.video.stream.VideoStream, str]:
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = np.stack(
            [f.to_ndarray(format="rgb24", interpolation=ACCURATE) for f in container.decode(stream)]
        )
        return frames, stream, container.format.name


@pytest.mark.parametrize(
    ("count", "height", "width", "fps"), [(9, 32, 48, 16), (1, 16, 16, 8), (17, 64, 32, 24)]
)
def test_round_trip(count: int, height: int, width: int, fps: int) -> None:
    frames = moving_gradient(count, height, width)
    data = encode_mp4(frames, fps)
    assert data[4:8] == b"ftyp"
    assert 0 < data.find(b"moov") < data.find(b"mdat"), "faststart: the index comes before the media"
    decoded, stream, fmt = decode(data)
    assert "mp4" in fmt
    assert stream.codec_context.name == "h264" and stream.codec_context.pix_fmt == "yuv420p"
    assert (stream.width, stream.height) == (width, height)
    assert stream.average_rate == fps
    assert decoded.shape == frames.shape
    err = np.abs(decoded.astype(np.int16) - frames.astype(np.int16))
    assert err.mean() < 3.0, err.mean()  # 4:2:0 chroma and CRF 18 on a busy pattern: about 2.3


def test_torch_frames_and_the_crf_trade_off() -> None:
    frames = moving_gradient(9, 32, 32)
    fine = encode_mp4(torch.from_numpy(frames), 16, crf=10)
    coarse = encode_mp4(frames, 16, crf=40)
    assert len(coarse) < len(fine)
    err = [np.abs(decode(d)[0].astype(np.int16) - frames).mean() for d in (fine, coarse)]
    assert err[0] < err[1]


@pytest.mark.parametrize(
    ("frames", "fps", "message"),
    [
        (np.zeros((3, 31, 32, 3), np.uint8), 16, "even dimensions"),
        (np.zeros((3, 32, 32, 3), np.float32), 16, "uint8"),
        (np.zeros((32, 32, 3), np.uint8), 16, "uint8"),
        (np.zeros((0, 32, 32, 3), np.uint8), 16, "at least one frame"),
        (np.zeros((3, 32, 32, 3), np.uint8), 0, "fps must be a positive integer"),
    ],
)
def test_bad_input(frames: np.ndarray, fps: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        encode_mp4(frames, fps)
