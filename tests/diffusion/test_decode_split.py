"""The Wan VAE decode split into pieces (start, groups of parts: the stages of each latent frame's
decoder call, finish): bitwise the one-call decode, each decode owning its feature cache (two
decodes interleaved on one VAE), the runtime running a decode over several steps (still
WanPipeline's video), and cancellation mid-decode."""

from __future__ import annotations

import copy
import gc
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from omnirt.stages.diffusion.denoiser import Shape, split_decode
from omnirt.stages.diffusion.pipeline import DiffusionPipeline
from omnirt.stages.diffusion.types import GeneratedVideo, VideoRequest
from omnirt.stages.diffusion.wan import WanDenoiser
from omnirt.stages.diffusion.wan_demo import ensure_wan_demo
from omnirt.stages.diffusion.wan_loader import load_wan
from omnirt.stages.types import Finished

from .conftest import run_to_end
from .test_wan import gens

#: Small enough that every piece holds one part: start (with the first part), one part, or finish.
TINY = 1e-9
#: 13 frames: 4 latent frames of 4 stages (the demo decoder's up blocks): 16 parts.
SIZE = {"width": 32, "height": 32, "num_frames": 13}
SHAPE = Shape(width=32, height=32, frames=13)


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_wan_demo(tmp_path_factory.mktemp("omnirt-cache"))


@pytest.fixture(scope="module")
def wan(wan_dir: Path) -> WanDenoiser:
    return load_wan(wan_dir, device="cpu")


def _latents(den: WanDenoiser, seeds: list[int]) -> torch.Tensor:
    return den.init_latents(SHAPE, gens(seeds))


def _pieces(den: WanDenoiser, latents: torch.Tensor, grouping: list[int]) -> torch.Tensor:
    state = den.start_decode(latents)
    for n in grouping:
        state = den.decode_parts(state, n)
    return den.finish_decode(state)


@pytest.mark.parametrize(
    "grouping", [[16], [1] * 16, [2, 0, 5, 3, 7], [4, 4, 4, 4]], ids=["whole", "single", "uneven", "frames"]
)
def test_pieces_are_bitwise_the_one_call_decode(wan: WanDenoiser, grouping: list[int]) -> None:
    assert split_decode(wan) and wan.decode_parts_total(SHAPE) == 16
    latents = _latents(wan, [1, 2])
    whole = wan.decode(latents)
    assert whole.shape == (2, 13, 32, 32, 3) and whole.dtype == torch.uint8 and whole.float().std() > 5
    assert torch.equal(_pieces(wan, latents, grouping), whole)


def test_each_decode_owns_its_cache(wan: WanDenoiser) -> None:
    a, b = _latents(wan, [3]), _latents(wan, [4])
    whole_a, whole_b = wan.decode(a), wan.decode(b)
    module_cache = wan.vae._feat_map
    sa, sb = wan.start_decode(a), wan.start_decode(b)
    for _ in range(16):  # interleaved part by part through one VAE module
        wan.decode_parts(sa, 1)
        wan.decode_parts(sb, 1)
        mid = wan.decode(b)  # a one-call decode in between uses (and clears) the module's cache
        assert torch.equal(mid, whole_b)
    assert torch.equal(wan.finish_decode(sa), whole_a)
    assert torch.equal(wan.finish_decode(sb), whole_b)
    assert sa.cache is not module_cache and not sa.cache and not sa.frames  # released at the end


def test_finish_before_the_last_frame_is_an_error(wan: WanDenoiser) -> None:
    state = wan.decode_parts(wan.start_decode(_latents(wan, [1])), 15)
    with pytest.raises(ValueError, match="15 of 16"):
        wan.finish_decode(state)


def test_keep_rows_continues_the_kept_rows(wan: WanDenoiser) -> None:
    latents = _latents(wan, [5, 6, 7])
    state = wan.decode_parts(wan.start_decode(latents), 6)  # frame 1, in its stages
    kept = wan.decode_keep_rows(state, [2, 0])
    assert kept.latents.shape[0] == 2 and all(f.shape[0] == 2 for f in kept.frames)
    assert kept.hidden is not None and kept.hidden.shape[0] == 2 and kept.stage == 2
    pixels = wan.finish_decode(wan.decode_parts(kept, 10))
    expected = wan.decode(latents[[2, 0]])
    assert (pixels.int() - expected.int()).abs().max() <= 1


def test_tiling_decodes_whole(wan: WanDenoiser) -> None:
    den = copy.copy(wan)
    den.vae = copy.deepcopy(wan.vae)
    den.vae.enable_tiling()
    assert not split_decode(den)
    with pytest.raises(ValueError, match="whole"):
        den.start_decode(_latents(wan, [1]))
    p = DiffusionPipeline(den, split_calls=True, max_step_seconds=TINY)
    r = VideoRequest("t", "a cat", num_inference_steps=1, seed=1, **SIZE)
    out = run_to_end(p, [r])["t"]
    assert isinstance(out[-2], GeneratedVideo) and p.calls["vae", 1] == 1 and not p.pieces["vae", 1]


# -- the runtime --------------------------------------------------------------------------------


class _FinishSpy:
    """A denoiser that keeps the latents it decodes and the pixels of its decodes."""

    def __init__(self, inner: WanDenoiser) -> None:
        self._inner = inner
        self.latents: list[torch.Tensor] = []
        self.pixels: list[torch.Tensor] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def start_decode(self, latents: torch.Tensor) -> Any:
        self.latents.append(latents.clone())
        return self._inner.start_decode(latents)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        self.latents.append(latents.clone())
        self.pixels.append(self._inner.decode(latents))
        return self.pixels[-1]

    def finish_decode(self, state: Any) -> torch.Tensor:
        self.pixels.append(self._inner.finish_decode(state))
        return self.pixels[-1]


def _requests(prompts: list[str]) -> list[VideoRequest]:
    return [
        VideoRequest(f"v{i}", prompt, negative_prompt="blurry", num_inference_steps=2,
                     guidance_scale=5.0, seed=7 + i, **SIZE)
        for i, prompt in enumerate(prompts)
    ]  # fmt: skip


def test_runtime_decodes_in_pieces_as_wan_pipeline(wan: WanDenoiser, wan_dir: Path) -> None:
    from diffusers import WanPipeline

    prompts = ["a red cat walking", "the blue sea, at night"]
    spy = _FinishSpy(wan)
    p = DiffusionPipeline(spy, split_calls=True, max_step_seconds=TINY, max_decode_rows=2)  # type: ignore[arg-type]
    out = run_to_end(p, _requests(prompts))
    # start + part 0, parts 1..15 one by one, finish: 17 steps, one decode call.
    assert p.calls["vae", 2] == 1 and p.pieces["vae", 2] == 17
    (latents,), (pixels,) = spy.latents, spy.pixels
    assert torch.equal(pixels, wan.decode(latents))
    videos = [o for o in out["v0"] + out["v1"] if isinstance(o, GeneratedVideo)]
    assert [v.frames for v in videos] == [13, 13]

    whole = DiffusionPipeline(wan, split_calls=False, max_decode_rows=2)
    whole_out = run_to_end(whole, _requests(prompts))
    assert not whole.pieces and whole.calls["vae", 2] == 1
    assert [o.mp4 for o in whole_out["v0"] + whole_out["v1"] if isinstance(o, GeneratedVideo)] == [
        v.mp4 for v in videos
    ]

    pipe = WanPipeline.from_pretrained(str(wan_dir))
    pipe.set_progress_bar_config(disable=True)
    ref = pipe(prompt=prompts, negative_prompt="blurry", num_inference_steps=2, guidance_scale=5.0,
               generator=gens([7, 8]), output_type="np", **SIZE).frames  # fmt: skip
    assert np.abs(pixels.numpy().astype(np.int16) - np.round(ref * 255).astype(np.int16)).max() <= 1


def test_decode_pieces_group_parts_by_measured_cost(wan: WanDenoiser) -> None:
    """Each kind of part (a latent frame's decoder stage; the first latent frame's stages kinds of
    their own) is measured alone once, then the pieces group parts by their own costs to at most
    ``max_step_seconds``, ``step_cost`` saying what the next piece takes."""
    from ..stages.pipelines import FakeClock

    clock = FakeClock()
    stage_cost = [0.005, 0.01, 0.02, 0.03]  # the demo decoder's 4 stages, as at 480p: rising
    first_cost = [0.004, 0.004, 0.005, 0.008]  # the first latent frame's (one frame, not four)

    def cost(part: int) -> float:
        return (first_cost if part < 4 else stage_cost)[part % 4]
    groups: list[int] = []

    class Timed:
        def __getattr__(self, name: str) -> Any:
            return getattr(wan, name)

        def start_decode(self, latents: torch.Tensor) -> Any:
            clock.spend(0.01)
            return wan.start_decode(latents)

        def decode_parts(self, state: Any, n: int) -> Any:
            first = state.parts_done
            clock.spend(sum(cost(part) for part in range(first, first + n)))
            groups.append(n)
            return wan.decode_parts(state, n)

        def finish_decode(self, state: Any) -> torch.Tensor:
            clock.spend(0.01)
            return wan.finish_decode(state)

    den = Timed()
    assert wan.decode_part_kinds(SHAPE) == 4
    p = DiffusionPipeline(den, clock=clock.now, split_calls=True, max_step_seconds=0.05)  # type: ignore[arg-type]
    seen: list[tuple[float, float]] = []  # (step_cost before, seconds) of every decode piece
    size = {**SIZE, "num_frames": 9}  # 3 latent frames of 4 parts
    for rid in ("a", "b"):
        r = VideoRequest(rid, "a boat", num_inference_steps=1, seed=1, **size)
        p.add(r, p.prepare(r))
        while p.has_work():
            before, expected, t0 = p.pieces["vae", 1], p.step_cost(), clock.t
            p.step()
            if p.pieces["vae", 1] > before:
                seen.append((expected, clock.t - t0))
    first, later = seen[:11], seen[11:]
    # Decode 1: its start with part 0, then each kind alone once: the first frame's parts 1-3,
    # the next frame's parts 4-7; then groups by their own costs, the finish.
    assert [round(s, 3) for _, s in first] == [
        0.014, 0.004, 0.005, 0.008, 0.005, 0.01, 0.02, 0.03, 0.035, 0.03, 0.01
    ]  # fmt: skip
    # Decode 2: every kind known: each piece at most 50 ms, step_cost saying what it takes (with
    # the first frame's costs for the later frames' stages, pieces went past 50 ms).
    assert [round(s, 3) for _, s in later] == [0.046, 0.05, 0.035, 0.04]
    for expected, seconds in later:
        assert expected == pytest.approx(seconds)
    assert groups[-4:] == [5, 2, 3, 1] and sum(groups) == 2 * 12


def test_cancelling_mid_decode_frees_its_rows_then_the_decode(wan: WanDenoiser) -> None:
    prompts = ["a red cat walking", "the blue sea, at night"]
    alone = _FinishSpy(wan)
    run_to_end(DiffusionPipeline(alone, split_calls=True, max_step_seconds=TINY), _requests(prompts)[1:])  # type: ignore[arg-type]
    spy = _FinishSpy(wan)
    p = DiffusionPipeline(spy, split_calls=True, max_step_seconds=TINY, max_decode_rows=2)  # type: ignore[arg-type]
    for r in _requests(prompts):
        p.add(r, p.prepare(r))
    while not p.pieces["vae", 2] == 5:  # the decode's start (part 0), parts 1-4: into frame 1
        p.step()
    dec = p._decoding
    assert dec is not None and dec.rows == 2 and dec.state.done == 1 and dec.state.stage == 1
    held = weakref.ref(dec.state.frames[0])
    p.remove("v0")
    gc.collect()
    assert dec.rows == 1 and dec.state.latents.shape[0] == 1 and held() is None
    out: list = []
    while p.has_work():
        out.extend(p.step())
    assert [rid for rid, o in out if isinstance(o, Finished)] == ["v1"]
    assert (spy.pixels[0].int() - alone.pixels[0].int()).abs().max() <= 1

    # The last request of a decode removed in the middle of it: the decode and its state go at once.
    (r,) = _requests(prompts[:1])
    p.add(r, p.prepare(r))
    before = p.pieces["vae", 1]  # the pieces of the decode above after "v0" left it count here too
    while not p.pieces["vae", 1] > before + 3:
        p.step()
    assert p._decoding is not None
    held = weakref.ref(p._decoding.state.cache[0])
    p.remove("v0")
    gc.collect()
    assert p._decoding is None and held() is None and not p.has_work() and p.step() == []
