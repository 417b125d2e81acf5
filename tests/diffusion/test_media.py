"""PNG and MP4 encoding of generated pixels."""

from __future__ import annotations

import io

import numpy as np
from omnirt.stages.diffusion.media import mp4, png

from .conftest import pixels


def test_png_round_trips_exactly() -> None:
    image = np.random.default_rng(0).integers(0, 256, (24, 40, 3), dtype=np.uint8)
    np.testing.assert_array_equal(pixels(png(image)), image)


def test_mp4_holds_every_frame_as_h264() -> None:
    import av

    frames = np.zeros((5, 32, 48, 3), dtype=np.uint8)
    frames[:, :, :, 0] = np.arange(5, dtype=np.uint8)[:, None, None] * 50  # red ramps up
    data = mp4(frames, fps=8)
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264"
        decoded = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
    assert len(decoded) == 5 and decoded[0].shape == (32, 48, 3)
    assert decoded[4][..., 0].mean() > decoded[0][..., 0].mean() + 100
