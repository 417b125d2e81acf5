"""Wan on CUDA: bf16 parity of the runtime's loop with WanPipeline on the tiny demo, and the
published 1.3B configuration with random weights (``--load-format dummy``) at 480p."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import time  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from omnirt.stages.diffusion.types import VideoRequest  # noqa: E402
from omnirt.stages.diffusion.video_io import encode_mp4  # noqa: E402
from omnirt.stages.diffusion.wan_demo import ensure_wan_demo  # noqa: E402
from omnirt.stages.diffusion.wan_loader import load_wan  # noqa: E402

from .test_wan import PUBLISHED, SIZE, gens, run  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_bf16_parity_on_cuda(tmp_path_factory: pytest.TempPathFactory) -> None:
    from diffusers import WanPipeline

    folder = ensure_wan_demo(tmp_path_factory.mktemp("omnirt-cache"))
    den = load_wan(folder, device="cuda", dtype=torch.bfloat16, vae_dtype=torch.bfloat16)
    pipe = WanPipeline.from_pretrained(str(folder), torch_dtype=torch.bfloat16).to("cuda")
    pipe.set_progress_bar_config(disable=True)
    prompts, seeds = ["a red cat walking", "the blue sea"], [1, 2]
    latents, frames = run(den, prompts, ["blurry"] * 2, [5.0, 5.0], seeds)
    kwargs = dict(prompt=prompts, negative_prompt="blurry", num_inference_steps=3, guidance_scale=5.0, **SIZE)
    ref = pipe(generator=gens(seeds), output_type="latent", **kwargs).frames
    # Same kernels, shapes and order: equal in practice; a little room for CUDA kernel choice.
    torch.testing.assert_close(latents, ref, rtol=1e-3, atol=1e-3)
    ref_frames = pipe(generator=gens(seeds), output_type="np", **kwargs).frames
    diff = (frames.float().numpy() - (ref_frames * 255).round()).__abs__().max()
    assert diff <= 1


def test_published_1_3b_dummy_at_480p() -> None:
    if not PUBLISHED.is_file():
        pytest.skip("the published components file is not on this machine")
    start = time.perf_counter()
    den = load_wan(PUBLISHED, load_format="dummy", variant="1.3b", device="cuda")
    load_s = time.perf_counter() - start
    shape = den.check(VideoRequest(request_id="r", prompt="a cat", num_inference_steps=2))
    assert (shape.width, shape.height, shape.frames) == (832, 480, 81)
    cond, uncond = den.encode(["a cat"]), den.encode([""])
    latents = den.init_latents(shape, gens([0]))
    sampler = den.sampler(shape, 2)
    torch.cuda.synchronize()
    step_s = []
    for i in range(2):
        t0 = time.perf_counter()
        pred = den.guide(
            den.predict(latents, i, sampler, cond, "cond"),
            den.predict(latents, i, sampler, uncond, "uncond"),
            torch.tensor([5.0]),
        )
        latents = sampler.step(pred, i, latents)
        torch.cuda.synchronize()
        step_s.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    frames = den.decode(latents)
    decode_s = time.perf_counter() - t0
    assert frames.shape == (1, 81, 480, 832, 3) and frames.dtype == torch.uint8
    assert torch.isfinite(latents).all()
    mp4 = encode_mp4(frames[0], den.defaults.fps)
    print(
        f"\n[gpu] Wan 1.3B dummy: load {load_s:.1f} s, CFG step {min(step_s) * 1e3:.0f} ms "
        f"(two transformer calls), VAE decode {decode_s:.2f} s, MP4 {len(mp4) / 1e6:.1f} MB"
    )
