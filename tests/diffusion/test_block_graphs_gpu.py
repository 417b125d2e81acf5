"""Block pieces replayed from CUDA graphs (``stages/diffusion/block_graphs.py``) on the GPU: for the
tiny Z-Image (bf16, and its linear layers in fp8) and Wan, two requests' pieces interleaved, each
block captured once per shape, bitwise the eager pieces; another caption length is another shape,
dropped first when only one is kept."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from omnirt.stages.diffusion import fused  # noqa: E402
from omnirt.stages.diffusion.block_graphs import BlockGraphs  # noqa: E402
from omnirt.stages.diffusion.denoiser import Shape  # noqa: E402
from omnirt.stages.diffusion.quant import quantize_model  # noqa: E402
from omnirt.stages.diffusion.wan_demo import ensure_wan_demo  # noqa: E402
from omnirt.stages.diffusion.wan_loader import load_wan  # noqa: E402
from omnirt.stages.diffusion.zimage_loader import load_zimage  # noqa: E402

from .test_wan import gens  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _pieces(den: Any, latents, sampler, conditions, cuts: list[int]) -> Any:
    """The call's start, then the blocks between ``cuts``."""
    state = den.start(latents, 1, sampler, conditions, "cond")
    for start, stop in zip(cuts, cuts[1:], strict=False):
        state = den.run_blocks(state, start, stop)
    return state


@pytest.mark.parametrize("family", ["z-image", "z-image fp8", "wan"])
def test_replayed_pieces_are_the_eager_pieces(
    family: str, zimage_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    if family.startswith("z-image"):
        den: Any = load_zimage(zimage_dir, device="cuda")
        shape = Shape(width=64, height=48)
        if family.endswith("fp8"):
            quantize_model(den.transformer, "fp8")
            fused.install(den.transformer)
    else:
        den = load_wan(ensure_wan_demo(tmp_path_factory.mktemp("omnirt-cache")), device="cuda")
        shape = Shape(width=32, height=32, frames=5)
    n = den.num_blocks
    assert n >= 2
    cuts = [0, 1, n]
    latents = den.init_latents(shape, gens([1, 2]))
    sampler = den.sampler(shape, 3)
    long = "a red fox in the snow under a pale winter sky, " * 4  # Z-Image: another caption length
    first, second = den.encode(["a red fox in the snow", "the sea"]), den.encode([long, "a cat"])
    den.block_graphs = BlockGraphs(den.block_graphs.call, enabled=False)
    want = [den.finish(_pieces(den, latents, sampler, c, cuts)) for c in (first, second)]
    graphs = den.block_graphs = BlockGraphs(den.block_graphs.call, enabled=True)
    a = den.start(latents, 1, sampler, first, "cond")
    b = den.start(latents, 1, sampler, second, "cond")
    a = den.run_blocks(a, 0, 1)
    b = den.run_blocks(b, 0, n)  # between a's pieces
    a = den.run_blocks(a, 1, n)
    assert graphs.last_path == "graph"
    assert torch.equal(den.finish(a), want[0]) and torch.equal(den.finish(b), want[1])
    shapes = len(graphs.shapes)  # the two prompts' lengths: one shape or two
    assert graphs.captures == n * shapes
    again = den.finish(_pieces(den, latents, sampler, first, [0, n]))
    assert torch.equal(again, want[0]) and graphs.captures == n * shapes  # replayed, not captured anew
    if shapes == 2:  # one kept: the other shape is captured anew
        den.block_graphs = graphs = BlockGraphs(graphs.call, enabled=True, max_shapes=1)
        for c, w in ((first, want[0]), (second, want[1]), (first, want[0])):
            assert torch.equal(den.finish(_pieces(den, latents, sampler, c, cuts)), w)
        assert len(graphs.shapes) == 1 and graphs.captures == 3 * n
