"""The Wan VAE decode in pieces on CUDA, at real size: the published Wan2.1 1.3B configuration
(random weights) at 832x480 with 81 frames (21 latent frames, about 2.9 s as one call on an H200)
decodes one latent frame per piece, each piece well under the whole decode, and the pixels are
bitwise those of the one-call decode (same kernels on the same shapes in the same order)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import time  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from omnirt.stages.diffusion.pipeline import DiffusionPipeline  # noqa: E402
from omnirt.stages.diffusion.types import GeneratedVideo, VideoRequest  # noqa: E402
from omnirt.stages.diffusion.wan import WanDenoiser  # noqa: E402
from omnirt.stages.diffusion.wan_loader import load_wan  # noqa: E402

from .conftest import run_to_end  # noqa: E402
from .test_wan import PUBLISHED, gens  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

#: The most one piece of frames may take (a latent frame at 480p: about 140 ms on an H200).
MAX_PIECE_SECONDS = 0.15


@pytest.fixture(scope="module")
def wan_1_3b() -> WanDenoiser:
    if not PUBLISHED.is_file():
        pytest.skip("the published components file is not on this machine")
    return load_wan(PUBLISHED, load_format="dummy", variant="1.3b", device="cuda")


def _timed(fn, *args):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    out = fn(*args)
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def test_480p_decode_pieces_are_short_and_bitwise_the_whole_decode(wan_1_3b: WanDenoiser) -> None:
    den = wan_1_3b
    shape = den.check(VideoRequest(request_id="r", prompt="a cat"))
    assert (shape.width, shape.height, shape.frames) == (832, 480, 81)
    assert den.decode_frames_total(shape) == 21
    latents = den.init_latents(shape, gens([0]))
    den.decode(latents)  # warm-up (kernel selection, allocator)
    whole, whole_s = _timed(den.decode, latents)
    state, start_s = _timed(lambda: den.decode_frames(den.start_decode(latents), 1))
    frame_s = []
    for _ in range(20):
        state, seconds = _timed(den.decode_frames, state, 1)
        frame_s.append(seconds)
    pixels, finish_s = _timed(den.finish_decode, state)
    print(
        f"\n[gpu] Wan 1.3B VAE decode 480p x81 ({den.vae.dtype}): whole {whole_s:.2f} s; pieces: start + "
        f"frame 0 {start_s * 1e3:.0f} ms, frames {min(frame_s) * 1e3:.0f}-{max(frame_s) * 1e3:.0f} ms, "
        f"finish {finish_s * 1e3:.0f} ms"
    )
    assert pixels.shape == whole.shape == (1, 81, 480, 832, 3)
    assert torch.equal(pixels, whole)
    assert max([start_s, finish_s, *frame_s]) < MAX_PIECE_SECONDS


def test_runtime_decodes_a_480p_video_in_frame_pieces(wan_1_3b: WanDenoiser) -> None:
    p = DiffusionPipeline(wan_1_3b)  # splits by default on CUDA
    durations: list[float] = []
    step = p.step

    def timed_step() -> list:
        before, t0 = p.pieces["vae", 1], time.perf_counter()
        out = step()  # synchronised with the GPU at its end
        if p.pieces["vae", 1] > before:
            durations.append(time.perf_counter() - t0)
        return out

    p.step = timed_step  # type: ignore[method-assign]
    request = VideoRequest("v", "a cat", num_inference_steps=1, guidance_scale=1.0, seed=0)
    out = run_to_end(p, [request])["v"]
    (video,) = [o for o in out if isinstance(o, GeneratedVideo)]
    assert video.frames == 81 and p.calls["vae", 1] == 1
    # start + frame 0, 20 frames one by one (each over max_step_seconds at ~140 ms), the finish
    # (pixels to the CPU and the MP4 encoding, on the CPU: reported, not bounded here).
    assert len(durations) == p.pieces["vae", 1] >= 12
    frames = durations[:-1]
    print(
        f"\n[gpu] runtime decode 480p x81: {len(durations)} pieces, frames "
        f"{min(frames) * 1e3:.0f}-{max(frames) * 1e3:.0f} ms, finish (with MP4) {durations[-1] * 1e3:.0f} ms"
    )
    assert max(frames[1:]) < MAX_PIECE_SECONDS  # the first decode's first piece includes warm-up
