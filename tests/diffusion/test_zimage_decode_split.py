"""The Z-Image VAE decode in parts (``conv_in`` with the middle block, each up block, the head):
bitwise the one-call decode in any grouping, cancellation of rows mid-decode, tiling decoding
whole, and the runtime running an image's decode over several steps with the same PNG."""

from __future__ import annotations

import copy

import pytest
import torch
from omnirt.stages.diffusion.denoiser import Shape, split_decode
from omnirt.stages.diffusion.pipeline import DiffusionPipeline
from omnirt.stages.diffusion.types import GeneratedImage, ImageRequest
from omnirt.stages.diffusion.zimage import ZImageDenoiser

from .conftest import run_to_end

SHAPE = Shape(width=64, height=64)
#: Small enough that every piece holds one part: the start (with the first part), one part, or the
#: finish.
TINY = 1e-9


def _latents(den: ZImageDenoiser, seeds: list[int]) -> torch.Tensor:
    return den.init_latents(SHAPE, [torch.Generator().manual_seed(s) for s in seeds])


def _parts(den: ZImageDenoiser) -> int:
    return len(den.vae.decoder.up_blocks) + 2


@pytest.mark.parametrize("grouping", ["whole", "single", "uneven"])
def test_parts_are_bitwise_the_one_call_decode(denoiser: ZImageDenoiser, grouping: str) -> None:
    total = _parts(denoiser)
    assert split_decode(denoiser) and denoiser.decode_parts_total(SHAPE) == total >= 4
    assert denoiser.decode_part_kinds(SHAPE) == total
    groups = {"whole": [total], "single": [1] * total, "uneven": [2, 0, total - 3, 5]}[grouping]
    latents = _latents(denoiser, [1, 2])
    whole = denoiser.decode(latents)
    assert whole.shape == (2, 1, 64, 64, 3) and whole.dtype == torch.uint8 and whole.float().std() > 5
    state = denoiser.start_decode(latents)
    for n in groups:
        state = denoiser.decode_parts(state, n)
    assert torch.equal(denoiser.finish_decode(state), whole)


def test_finish_before_the_last_part_is_an_error(denoiser: ZImageDenoiser) -> None:
    total = _parts(denoiser)
    state = denoiser.decode_parts(denoiser.start_decode(_latents(denoiser, [1])), total - 1)
    with pytest.raises(ValueError, match=f"{total - 1} of {total}"):
        denoiser.finish_decode(state)
    with pytest.raises(ValueError, match="cannot decode -1"):
        denoiser.decode_parts(state, -1)


def test_keep_rows_continues_the_kept_rows(denoiser: ZImageDenoiser) -> None:
    latents = _latents(denoiser, [5, 6, 7])
    state = denoiser.decode_parts(denoiser.start_decode(latents), 2)
    kept = denoiser.decode_keep_rows(state, [2, 0])
    assert kept.hidden.shape[0] == 2 and kept.done == 2
    pixels = denoiser.finish_decode(denoiser.decode_parts(kept, _parts(denoiser)))
    expected = denoiser.decode(latents[[2, 0]])
    assert (pixels.int() - expected.int()).abs().max() <= 1


def test_tiling_decodes_whole(denoiser: ZImageDenoiser) -> None:
    den = copy.copy(denoiser)
    den.vae = copy.deepcopy(denoiser.vae)
    den.vae.enable_tiling()
    assert not split_decode(den)
    with pytest.raises(ValueError, match="whole"):
        den.start_decode(_latents(denoiser, [1]))


def test_runtime_decodes_an_image_in_parts(denoiser: ZImageDenoiser) -> None:
    def request() -> ImageRequest:
        return ImageRequest("i", "a red cat", width=64, height=64, num_inference_steps=2, seed=3)

    split = DiffusionPipeline(denoiser, split_calls=True, max_step_seconds=TINY)
    parts = run_to_end(split, [request()])["i"]
    # the start with part 0, the other parts one by one, the finish: one decode call
    assert split.calls["vae", 1] == 1 and split.pieces["vae", 1] == _parts(denoiser) + 1
    whole = DiffusionPipeline(denoiser, split_calls=False)
    one = run_to_end(whole, [request()])["i"]
    assert whole.calls["vae", 1] == 1 and not whole.pieces["vae", 1]
    images = [[o.png for o in out if isinstance(o, GeneratedImage)] for out in (parts, one)]
    assert images[0] == images[1] and len(images[0]) == 1
