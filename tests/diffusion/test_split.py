"""Transformer calls split into pieces (start, groups of blocks, finish): bitwise the whole call for
Z-Image and Wan, the runtime running a call over several steps (still diffusers' result),
cancellation in the middle of a call, and a realtime frame waiting at most one piece (simulated
time)."""

from __future__ import annotations

import copy
import gc
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from omnirt.stages.diffusion.denoiser import Shape, split_blocks
from omnirt.stages.diffusion.pipeline import DiffusionPipeline
from omnirt.stages.diffusion.types import GeneratedImage, ImageRequest, VideoRequest
from omnirt.stages.diffusion.wan import WanDenoiser
from omnirt.stages.diffusion.wan_demo import ensure_wan_demo
from omnirt.stages.diffusion.wan_loader import load_wan
from omnirt.stages.diffusion.zimage import ZImageDenoiser
from omnirt.stages.scheduler import Scheduler
from omnirt.stages.types import Finished

from ..stages.pipelines import FakeClock, FramePipeline, FrameRequest
from .conftest import Timed, pixels, run_to_end
from .test_wan import SIZE as WAN_SIZE
from .test_wan import diffusers_run
from .test_zimage_parity import STEPS, _close, _diffusers, _ours

#: Small enough that every piece holds one part: start, one block, or finish.
TINY = 1e-9


def _gens(seeds: list[int]) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(s) for s in seeds]


def _deeper_zimage(den: ZImageDenoiser, layers: int) -> ZImageDenoiser:
    """``den`` with a random transformer of ``layers`` main layers (the demo's has 2)."""
    from diffusers import ZImageTransformer2DModel
    from omnirt.stages.diffusion.zimage_demo import TRANSFORMER_CONFIG

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        transformer = ZImageTransformer2DModel(**{**TRANSFORMER_CONFIG, "n_layers": layers}).eval()
        with torch.no_grad():
            transformer.x_pad_token.normal_()
            transformer.cap_pad_token.normal_()
    out = copy.copy(den)
    out.transformer = transformer
    return out


def _deeper_wan(den: WanDenoiser, layers: int) -> WanDenoiser:
    from diffusers import WanTransformer3DModel
    from omnirt.stages.diffusion.wan_demo import TRANSFORMER_CONFIG

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(6)
        transformer = WanTransformer3DModel(**{**TRANSFORMER_CONFIG, "num_layers": layers}).eval()
    out = copy.copy(den)
    out.transformer = transformer
    return out


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_wan_demo(tmp_path_factory.mktemp("omnirt-cache"))


@pytest.fixture(scope="module")
def wan(wan_dir: Path) -> WanDenoiser:
    return load_wan(wan_dir, device="cpu")


@pytest.fixture(scope="module")
def zimage_reference(zimage_dir: Path):  # type: ignore[no-untyped-def]
    from diffusers import ZImagePipeline

    return ZImagePipeline.from_pretrained(str(zimage_dir))


@pytest.fixture(scope="module")
def wan_reference(wan_dir: Path):  # type: ignore[no-untyped-def]
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(wan_dir))
    pipe.set_progress_bar_config(disable=True)
    return pipe


# -- the pieces against the whole call ------------------------------------------------------------

GROUPINGS = [[(0, 5)], [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)], [(0, 2), (2, 2), (2, 5)]]


@pytest.mark.parametrize("family", ["z-image", "wan"])
def test_split_call_is_bitwise_the_whole_call(
    family: str, denoiser: ZImageDenoiser, wan: WanDenoiser
) -> None:
    if family == "z-image":  # prompts of different lengths: padded rows, an attention mask
        den: Any = _deeper_zimage(denoiser, 5)
        shape = Shape(width=32, height=48)
    else:
        den = _deeper_wan(wan, 5)
        shape = Shape(width=32, height=32, frames=5)
    assert split_blocks(den) == den.num_blocks == 5
    latents = den.init_latents(shape, _gens([1, 2]))
    sampler = den.sampler(shape, 3)
    branches = {
        "cond": den.encode(["a red fox in the snow", "the sea"]),
        "uncond": den.encode(["blurry", "dark, blurry, low quality, static"]),
    }
    whole = {}
    for branch, conditions in branches.items():
        whole[branch] = den.predict(latents, 1, sampler, conditions, branch)
        assert whole[branch].shape == latents.shape
        for grouping in GROUPINGS:
            state = den.start(latents, 1, sampler, conditions, branch)
            for first, stop in grouping:
                state = den.run_blocks(state, first, stop)
            assert torch.equal(den.finish(state), whole[branch]), (branch, grouping)
    assert not torch.allclose(whole["cond"], whole["uncond"])
    with pytest.raises(ValueError, match="out of 0:5"):
        den.run_blocks(den.start(latents, 1, sampler, branches["cond"], "cond"), 4, 6)


@pytest.mark.parametrize("family", ["z-image", "wan"])
def test_keep_rows_continues_the_kept_rows(family: str, denoiser: ZImageDenoiser, wan: WanDenoiser) -> None:
    den: Any = denoiser if family == "z-image" else wan
    shape = Shape(width=32, height=48) if family == "z-image" else Shape(width=32, height=32, frames=5)
    latents = den.init_latents(shape, _gens([3, 4]))
    sampler = den.sampler(shape, 3)
    conditions = den.encode(["a lighthouse at dusk on a rocky coast", "an orange"])
    state = den.run_blocks(den.start(latents, 0, sampler, conditions, "cond"), 0, 1)
    state = den.keep_rows(state, [1])
    kept = den.finish(den.run_blocks(state, 1, den.num_blocks))
    alone = den.predict(latents[1:], 0, sampler, conditions[1:], "cond")
    assert kept.shape == alone.shape == latents[1:].shape
    torch.testing.assert_close(kept, alone, rtol=1e-5, atol=1e-5)
    other = den.predict(latents[:1], 0, sampler, conditions[:1], "cond")
    assert not torch.allclose(kept, other, rtol=1e-3, atol=1e-3)


def test_a_cached_transformer_runs_whole(wan_dir: Path) -> None:
    from diffusers import FirstBlockCacheConfig

    den = load_wan(wan_dir, device="cpu")
    assert split_blocks(den) == 2
    den.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.05))
    assert split_blocks(den) == 0  # the hook wraps the whole forward: pieces would bypass it
    p = DiffusionPipeline(den, split_calls=True, max_step_seconds=TINY)
    request = VideoRequest("v", "a cat", num_inference_steps=2, guidance_scale=1.0, seed=1, **WAN_SIZE)
    run_to_end(p, [request])
    assert p.calls["transformer", 1] == 2 and not p.pieces["transformer", 1]
    assert p.pieces["vae", 1] == 9  # its VAE decode still runs in pieces (2 latent frames of 4 parts)


# -- the runtime --------------------------------------------------------------------------------


def test_runtime_pieces_match_diffusers_and_the_whole_calls(
    denoiser: ZImageDenoiser, zimage_reference
) -> None:  # type: ignore[no-untyped-def]
    def request(rid: str) -> ImageRequest:
        return ImageRequest(
            rid, "two cats", n=2, width=64, height=64, num_inference_steps=STEPS, guidance_scale=3.0, seed=11
        )

    split = DiffusionPipeline(denoiser, split_calls=True, max_step_seconds=TINY)
    ours = _ours(split, [request("n")])["n"]
    _close(ours, _diffusers(zimage_reference, "two cats", [11, 12], 3.0, n=2))
    # Each call: its start, its 2 blocks one by one, its finish (4 steps); counted once in calls.
    assert split.calls["transformer", 2] == 2 * STEPS
    assert split.pieces["transformer", 2] == 4 * 2 * STEPS
    whole = DiffusionPipeline(denoiser, split_calls=False)
    pngs = {
        name: [o.png for o in run_to_end(p, [request(name)])[name] if isinstance(o, GeneratedImage)]
        for name, p in (("split", DiffusionPipeline(denoiser, split_calls=True, max_step_seconds=TINY)),
                        ("whole", whole))
    }  # fmt: skip
    assert pngs["split"] == pngs["whole"] and len(pngs["whole"]) == 2
    assert not whole.pieces


class _DecodeSpy:
    """A denoiser that keeps the latents it decodes (the final latents of the runtime)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.decoded: list[torch.Tensor] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        self.decoded.append(latents.clone())
        return self._inner.decode(latents)

    def start_decode(self, latents: torch.Tensor) -> Any:  # the decode in pieces
        self.decoded.append(latents.clone())
        return self._inner.start_decode(latents)


def test_runtime_pieces_match_wan_pipeline(wan: WanDenoiser, wan_reference) -> None:  # type: ignore[no-untyped-def]
    spy = _DecodeSpy(wan)
    p = DiffusionPipeline(spy, split_calls=True, max_step_seconds=TINY, max_decode_rows=2)  # type: ignore[arg-type]
    prompts, negative, steps = ["a red cat walking", "the blue sea, at night"], "blurry, static", 3
    requests = [
        VideoRequest(f"v{i}", prompt, negative_prompt=negative, num_inference_steps=steps,
                     guidance_scale=5.0, seed=7 + i, **WAN_SIZE)
        for i, prompt in enumerate(prompts)
    ]  # fmt: skip
    run_to_end(p, requests)
    assert p.calls["transformer", 2] == 2 * steps and p.pieces["transformer", 2] == 4 * 2 * steps
    (latents,) = spy.decoded
    ref_latents, _ = diffusers_run(wan_reference, prompts, negative, 5.0, [7, 8], steps=steps)
    torch.testing.assert_close(latents, ref_latents, rtol=1e-5, atol=1e-5)


def test_cancelling_mid_call_frees_its_rows_then_the_call(denoiser: ZImageDenoiser) -> None:
    def request(rid: str, **kw: Any) -> ImageRequest:
        return ImageRequest(rid, "a small house", width=32, height=32, num_inference_steps=3,
                            guidance_scale=2.0, **kw)  # fmt: skip

    alone = run_to_end(DiffusionPipeline(denoiser), [request("b", seed=4)])["b"]
    p = DiffusionPipeline(denoiser, split_calls=True, max_step_seconds=TINY)
    for r in (request("a", n=2, seed=1), request("b", seed=4)):
        p.add(r, p.prepare(r))
    outputs: dict[str, list] = {"a": [], "b": []}
    for _ in range(3):  # encode, then the start and first block of step 1's cond call
        for rid, o in p.step():
            outputs[rid].append(o)
    call = p._call
    assert call is not None and call.rows == 3 and call.done == 1
    held = weakref.ref(call.state.hidden)
    p.remove("a")
    assert call.rows == 1 and call.state.hidden.shape[0] == 1 and p.rows_in_use() == 1
    gc.collect()
    assert held() is None  # a's rows of the hidden states are gone, not just hidden
    while p.has_work():
        for rid, o in p.step():
            outputs[rid].append(o)
    assert not any(isinstance(o, GeneratedImage | Finished) for o in outputs["a"])
    ours = [o.png for o in outputs["b"] if isinstance(o, GeneratedImage)]
    theirs = [o.png for o in alone if isinstance(o, GeneratedImage)]
    np.testing.assert_allclose(pixels(ours[0]).astype(int), pixels(theirs[0]).astype(int), atol=1)

    # The last request of a call removed in the middle of it: the call and its state go at once.
    p.add(request("c", seed=2), p.prepare(request("c", seed=2)))
    for _ in range(2):  # encode, the call's start
        p.step()
    assert p._call is not None
    held = weakref.ref(p._call.state.hidden)
    p.remove("c")
    gc.collect()
    assert p._call is None and held() is None and not p.has_work() and p.step() == []


# -- scheduling (simulated time) ----------------------------------------------------------------


class _TimedSplit(Timed):
    """A denoiser whose calls spend simulated time: ``costs`` per call, ``block`` per block."""

    def __init__(self, inner: Any, clock: FakeClock, block: float, **costs: float) -> None:
        super().__init__(inner, clock, **costs)
        self._block = block
        self.ranges: list[tuple[int, int]] = []

    def run_blocks(self, state: Any, start: int, stop: int) -> Any:
        self._clock.spend(self._block * (stop - start))
        self.ranges.append((start, stop))
        return self._inner.run_blocks(state, start, stop)


COSTS = dict(encode=0.02, decode=0.02, preview=0.02, predict=0.14, start=0.01, finish=0.01)


def test_step_cost_is_the_next_pieces_cost_and_pieces_group_blocks(denoiser: ZImageDenoiser) -> None:
    clock = FakeClock()
    timed = _TimedSplit(_deeper_zimage(denoiser, 6), clock, block=0.02, **COSTS)
    p = DiffusionPipeline(timed, clock=clock.now, split_calls=True, max_step_seconds=0.05)  # type: ignore[arg-type]
    r = ImageRequest("a", "a boat", width=32, height=32, num_inference_steps=4, seed=1)
    p.add(r, p.prepare(r))
    pieces: list[tuple[float, float]] = []  # (step_cost before, seconds taken) of the calls' pieces

    def calls() -> int:  # the transformer's pieces (the VAE decode runs in pieces of its own too)
        return sum(n for (kind, _), n in p.pieces.items() if kind == "transformer")

    while p.has_work():
        before, expected, t0 = calls(), p.step_cost(), clock.t
        p.step()
        if calls() > before:
            pieces.append((expected, clock.t - t0))
    # Call 1 measures its parts alone: start, one block, then pairs of blocks (0.04 s), finish.
    assert [round(s, 3) for _, s in pieces[:6]] == [0.01, 0.02, 0.04, 0.04, 0.02, 0.01]
    assert timed.ranges[:4] == [(0, 1), (1, 3), (3, 5), (5, 6)]
    # Then every call is 3 pieces (start + 2 blocks, 2 blocks, 2 blocks + finish), each at most
    # 50 ms, and step_cost says what each takes before it runs.
    later = pieces[6:]
    assert len(later) == 3 * 3 and p.calls["transformer", 1] == 4
    assert [round(s, 3) for _, s in later] == [0.05, 0.04, 0.05] * 3
    for expected, seconds in later:
        assert expected == pytest.approx(seconds)
    assert timed.ranges[-3:] == [(0, 2), (2, 4), (4, 6)]


def _run(s: Scheduler, clock: FakeClock) -> list:
    out: list = []
    for _ in range(100_000):
        due = s.next_due()
        if due is None:
            return out
        clock.t = max(clock.t, due)
        out.extend(s.tick())
    raise AssertionError("the scheduler never ran out of work")


@pytest.mark.parametrize("split", [True, False], ids=["split", "whole"])
def test_a_realtime_frame_waits_at_most_one_piece(denoiser: ZImageDenoiser, split: bool) -> None:
    clock = FakeClock()
    frames = FramePipeline(clock, period=0.08, cost=0.01)
    timed = _TimedSplit(_deeper_zimage(denoiser, 6), clock, block=0.02, **COSTS)
    images = DiffusionPipeline(  # type: ignore[arg-type]
        timed, clock=clock.now, split_calls=split, max_step_seconds=0.05
    )
    durations: list[float] = []
    step = images.step

    def timed_step() -> list:
        t0 = clock.t
        out = step()
        durations.append(clock.t - t0)
        return out

    images.step = timed_step  # type: ignore[method-assign]
    s = Scheduler([frames, images], clock=clock.now, starvation_limit=1.0, batch_slice=None)
    request = ImageRequest(
        "img", "a boat", width=32, height=32, num_inference_steps=4, guidance_scale=3.0, n=2
    )
    s.enqueue("image", request, images.prepare(request))
    s.enqueue("duplex", FrameRequest("call", frames=60), 60)
    out = _run(s, clock)
    finished = {rid: o for rid, o in out if isinstance(o, Finished)}
    assert finished["img"].reason == "stop" and finished["call"].reason == "stop"
    assert images.calls["transformer", 2] == 8
    if split:
        # Every step is at most one 50 ms piece (a whole call is 140 ms), and a frame never waits
        # longer than one step: the 70 ms between frames always has room for a piece.
        assert max(durations) == pytest.approx(0.05)
        assert sum(images.pieces.values()) > 8
        assert max(frames.lateness) <= max(durations) + 1e-9
    else:
        # The whole 140 ms call never fits between two frames: it runs when starved, a frame late.
        assert max(durations) == pytest.approx(0.14)
        assert max(frames.lateness) > 0.05


def _frames_beside_an_image(
    denoiser: ZImageDenoiser, *, fit: bool, batch_slice: float | None, frame_count: int = 200
) -> tuple[FramePipeline, list[tuple[float, float, bool]], float]:
    """``frame_count`` frames of 10 ms every 80 ms beside a guided 6-step image whose transformer
    blocks take 5 ms (12 a call), pieces of at most 50 ms. Returns the frames, each image step's
    (start, seconds, while frames were active) and the seconds until the image finished."""
    clock = FakeClock()
    begin = clock.t
    frames = FramePipeline(clock, period=0.08, cost=0.01)
    timed = _TimedSplit(_deeper_zimage(denoiser, 12), clock, block=0.005, **COSTS)
    images = DiffusionPipeline(  # type: ignore[arg-type]
        timed, clock=clock.now, split_calls=True, max_step_seconds=0.05
    )
    if not fit:
        images.fit = None  # type: ignore[assignment,method-assign]  # a pipeline that cannot fit
    steps: list[tuple[float, float, bool]] = []
    step = images.step

    def timed_step() -> list:
        t0, active = clock.t, frames.has_work()
        out = step()
        steps.append((t0, clock.t - t0, active))
        return out

    images.step = timed_step  # type: ignore[method-assign]
    s = Scheduler([frames, images], clock=clock.now, starvation_limit=1.0, batch_slice=batch_slice)
    request = ImageRequest("img", "a boat", width=32, height=32, num_inference_steps=6, guidance_scale=3.0)
    s.enqueue("image", request, images.prepare(request))
    s.enqueue("duplex", FrameRequest("call", frames=frame_count), frame_count)
    done_at = 0.0
    for _ in range(100_000):
        due = s.next_due()
        if due is None:
            break
        clock.t = max(clock.t, due)
        for rid, output in s.tick():
            if rid == "img" and isinstance(output, Finished):
                assert output.reason == "stop"
                done_at = clock.t - begin
    assert done_at and not frames.has_work()
    return frames, steps, done_at


def test_pieces_are_fitted_into_the_gaps_between_realtime_frames(denoiser: ZImageDenoiser) -> None:
    # A pipeline that cannot size its pieces runs one 50 ms piece in each 70 ms gap between
    # frames and leaves the rest idle; fitted, the next piece takes what is left of the gap.
    _, _, whole_pieces = _frames_beside_an_image(denoiser, fit=False, batch_slice=None)
    frames, steps, fitted = _frames_beside_an_image(denoiser, fit=True, batch_slice=None)
    assert fitted < 0.7 * whole_pieces, (fitted, whole_pieces)
    assert max(frames.lateness) <= 1e-9  # every piece fitted before the next frame
    assert any(seconds < 0.045 for _, seconds, active in steps if active)


def test_while_realtime_work_is_active_batch_pieces_stay_within_the_slice(
    denoiser: ZImageDenoiser,
) -> None:
    frames, steps, _ = _frames_beside_an_image(denoiser, fit=True, batch_slice=0.02, frame_count=6)
    active = [seconds for _, seconds, on in steps if on]
    after = [seconds for _, seconds, on in steps if not on]
    assert active and max(active) <= 0.02 + 1e-9
    assert max(frames.lateness) <= 1e-9
    # Once the frames are done, pieces grow back to the pipeline's own 50 ms.
    assert after and max(after) > 0.04




def test_steps_done_counts_the_step_under_way(wan: WanDenoiser) -> None:
    """``steps_done``: a guided request's steps with the part of the step under way (its ``cond``
    call run, the blocks of its split call run), rising piece by piece to the next whole step as
    its ``Progress`` comes out."""
    from omnirt.stages.diffusion.types import Progress

    p = DiffusionPipeline(wan, split_calls=True, max_step_seconds=TINY)
    request = VideoRequest("v", "a cat", negative_prompt="blurry", num_inference_steps=2,
                           guidance_scale=5.0, seed=3, **WAN_SIZE)  # fmt: skip
    assert p.steps_done("v") is None
    p.add(request, p.prepare(request))
    seen = [p.steps_done("v")]
    progress = []
    while p.has_work():
        out = p.step()
        done = p.steps_done("v")
        if done is None:  # finished and gone
            break
        progress += [o.done for _, o in out if isinstance(o, Progress)]
        if any(isinstance(o, Progress) for _, o in out):
            assert done == float(progress[-1])  # a step's Progress: a whole number
        seen.append(done)
    assert seen == sorted(seen) and seen[0] == 0.0 and progress == [1, 2]
    # each call (start, 2 blocks, finish) rises by a quarter of a step per block: 0, 1/4, 1/2 ...
    fractions = sorted({round(v - int(v), 6) for v in seen})
    assert fractions == [0.0, 0.25, 0.5, 0.75], fractions
