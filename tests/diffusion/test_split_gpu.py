"""Split transformer calls on CUDA: the pieces are bitwise the whole call in bf16, and the published
Wan2.1 1.3B configuration (random weights) at 480p runs its ~600 ms calls as pieces that each fit
one realtime frame."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from omnirt.stages.diffusion.denoiser import Shape  # noqa: E402
from omnirt.stages.diffusion.pipeline import MAX_STEP_SECONDS, DiffusionPipeline  # noqa: E402
from omnirt.stages.diffusion.types import VideoRequest  # noqa: E402
from omnirt.stages.diffusion.wan_demo import ensure_wan_demo  # noqa: E402
from omnirt.stages.diffusion.wan_loader import load_wan  # noqa: E402
from omnirt.stages.diffusion.zimage_loader import load_zimage  # noqa: E402

from .conftest import run_to_end  # noqa: E402
from .test_wan import PUBLISHED, gens  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("family", ["z-image", "wan"])
def test_pieces_are_the_whole_call_in_bf16(
    family: str, zimage_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    if family == "z-image":
        den: Any = load_zimage(zimage_dir, device="cuda")
        shape = Shape(width=64, height=48)
    else:
        den = load_wan(ensure_wan_demo(tmp_path_factory.mktemp("omnirt-cache")), device="cuda")
        shape = Shape(width=32, height=32, frames=5)
    assert den.dtype == torch.bfloat16
    latents = den.init_latents(shape, gens([1, 2]))
    sampler = den.sampler(shape, 3)
    for prompts in (["a red fox in the snow", "the sea"], ["blurry", "dark, low quality"]):
        conditions = den.encode(prompts)
        whole = den.predict(latents, 1, sampler, conditions, "cond")
        state = den.start(latents, 1, sampler, conditions, "cond")
        for block in range(den.num_blocks):
            state = den.run_blocks(state, block, block + 1)
        # Same kernels on the same shapes in the same order.
        assert torch.equal(den.finish(state), whole)


def test_published_1_3b_calls_run_in_frame_sized_pieces() -> None:
    if not PUBLISHED.is_file():
        pytest.skip("the published components file is not on this machine")
    den = load_wan(PUBLISHED, load_format="dummy", variant="1.3b", device="cuda")
    p = DiffusionPipeline(den)  # splits by default on CUDA
    assert p.split_calls and den.num_blocks == 30
    durations: list[tuple[int, float]] = []  # (pieces so far, seconds) of every piece step
    step = p.step

    def timed_step() -> list:
        before, t0 = p.pieces["transformer", 1], time.perf_counter()
        out = step()  # synchronised with the GPU at its end
        if p.pieces["transformer", 1] > before:
            durations.append((before, time.perf_counter() - t0))
        return out

    p.step = timed_step  # type: ignore[method-assign]
    request = VideoRequest("v", "a cat", num_inference_steps=2, guidance_scale=5.0, seed=0)
    run_to_end(p, [request])
    assert p.calls["transformer", 1] == 4
    pieces = p.pieces["transformer", 1]
    # The first call measures its start, one block and its finish alone; every call after it runs
    # in pieces of about MAX_STEP_SECONDS (~600 ms a call: a dozen pieces).
    later = [seconds for before, seconds in durations if before >= pieces // 2]
    print(f"1.3B 480p: {pieces} pieces for 4 calls, later pieces {min(later):.3f}-{max(later):.3f} s")
    assert pieces >= 4 * 8
    assert max(later) < 0.08  # one realtime frame
    assert sum(later) / len(later) > MAX_STEP_SECONDS / 2  # grouped, not one block each
