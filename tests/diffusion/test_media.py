"""PNG encoding of generated images (MP4: test_video_io.py)."""

from __future__ import annotations

import numpy as np
from omnirt.stages.diffusion.media import png

from .conftest import pixels


def test_png_round_trips_exactly() -> None:
    image = np.random.default_rng(0).integers(0, 256, (24, 40, 3), dtype=np.uint8)
    np.testing.assert_array_equal(pixels(png(image)), image)
