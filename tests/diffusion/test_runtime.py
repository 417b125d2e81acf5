"""The diffusion runtime on the tiny Z-Image: one model call per step, batch groups, cancellation,
validation, progress and previews, and its scheduling beside a realtime pipeline (simulated time)."""

from __future__ import annotations

import collections
import math
from typing import Any

import numpy as np
import pytest
from omnirt.stages.diffusion.pipeline import DiffusionPipeline, preview_steps
from omnirt.stages.diffusion.types import GeneratedImage, ImagePreview, ImageRequest, Progress
from omnirt.stages.diffusion.zimage import ZImageDenoiser
from omnirt.stages.pipeline import RequestRejected
from omnirt.stages.scheduler import Scheduler
from omnirt.stages.types import Finished

from ..stages.pipelines import FakeClock, FramePipeline, FrameRequest
from .conftest import Timed, pixels, run_to_end

SIZE = 32


def _request(rid: str, **kw: Any) -> ImageRequest:
    base: dict[str, Any] = dict(
        prompt="a small house", width=SIZE, height=SIZE, num_inference_steps=3, seed=1
    )
    base.update(kw)
    return ImageRequest(rid, **base)


def _model_calls(p: DiffusionPipeline) -> int:
    return sum(p.calls.values())


def test_every_step_runs_at_most_one_model_call(denoiser: ZImageDenoiser) -> None:
    p = DiffusionPipeline(denoiser)
    for request in (_request("g", n=2, guidance_scale=3.0), _request("u", seed=9)):
        p.add(request, p.prepare(request))
    names: list[str] = []
    planned: list[tuple[str, int] | None] = []
    while p.has_work():
        planned.append(p.next_call())
        before = collections.Counter(p.calls)
        p.step()
        added = [name for (name, _), n in (p.calls - before).items() for _ in range(n)]
        assert len(added) <= 1, added
        names += added
    assert p.next_call() is None
    # next_call() names each step's call before it runs: encode over the 2 prompts and the shared
    # negative prompt (deduplicated to 2 texts in the encoder call), then cond / uncond, decode.
    assert planned == [("encode", 3)] + [("cond", 3), ("uncond", 2)] * 3 + [("decode", 3)]
    # Text encoder once, then per denoising step cond (3 rows) and uncond (the 2 guided rows),
    # then one VAE decode for all 3 images.
    assert names == ["text_encoder"] + ["transformer"] * 6 + ["vae"]
    assert p.calls["transformer", 3] == 3 and p.calls["transformer", 2] == 3


def test_progress_counts_steps_and_previews_come_spread_over_them(denoiser: ZImageDenoiser) -> None:
    assert preview_steps(6, 2) == (2, 4)
    assert preview_steps(8, 3) == (2, 4, 6)
    assert preview_steps(2, 3) == (1,)
    assert preview_steps(5, 0) == ()
    p = DiffusionPipeline(denoiser)
    out = run_to_end(p, [_request("a", n=2, num_inference_steps=6, partial_images=2)])["a"]
    kinds = [type(o).__name__ for o in out]
    assert [o.done for o in out if isinstance(o, Progress)] == [1, 2, 3, 4, 5, 6]
    assert all(o.total == 6 for o in out if isinstance(o, Progress))
    previews = [o for o in out if isinstance(o, ImagePreview)]
    assert [(o.index, o.partial_index) for o in previews] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    # Previews of step 2 come after its progress, before step 3's.
    assert kinds.index("ImagePreview") == kinds.index("Progress") + 2
    assert kinds[-3:] == ["GeneratedImage", "GeneratedImage", "Finished"]
    assert out[-1] == Finished("stop", out[-1].usage)
    assert pixels(previews[0].png).shape == (SIZE, SIZE, 3)
    assert p.calls["vae_preview", 2] == 2


def test_cancelling_mid_run_frees_its_rows_and_leaves_the_others_intact(denoiser: ZImageDenoiser) -> None:
    alone = run_to_end(DiffusionPipeline(denoiser), [_request("b", seed=4, guidance_scale=2.0)])["b"]
    p = DiffusionPipeline(denoiser, max_rows=3)
    a, b = _request("a", n=2, guidance_scale=2.0), _request("b", seed=4, guidance_scale=2.0)
    for request in (a, b):
        p.add(request, p.prepare(request))
    assert p.rows_in_use() == 3 and not p.can_add()
    outputs: dict[str, list] = {"a": [], "b": []}
    for _ in range(4):  # encode, then cond and uncond of step 1, then cond of step 2
        for rid, o in p.step():
            outputs[rid].append(o)
    assert p.calls["transformer", 3] == 3
    assert p.remove("a") is not None  # between the branches of step 2
    assert p.remove("a") is None
    assert p.rows_in_use() == 1 and p.can_add()
    while p.has_work():
        for rid, o in p.step():
            outputs[rid].append(o)
    assert not any(isinstance(o, GeneratedImage | Finished) for o in outputs["a"])
    assert p.calls["transformer", 1] >= 3  # b alone after the cancel
    ours = [o.png for o in outputs["b"] if isinstance(o, GeneratedImage)]
    theirs = [o.png for o in alone if isinstance(o, GeneratedImage)]
    np.testing.assert_allclose(pixels(ours[0]).astype(int), pixels(theirs[0]).astype(int), atol=1)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"width": 40}, "width must be a multiple of 16"),
        ({"height": 100}, "height must be a multiple of 16"),
        ({"width": 4096}, "width must be from 16 to 2048"),
        ({"num_inference_steps": 0}, "num_inference_steps must be from 1 to 100"),
        ({"num_inference_steps": 101}, "num_inference_steps must be from 1 to 100"),
        ({"n": 0}, "n must be from 1 to 8"),
        ({"n": 11}, "n must be from 1 to 8"),
        ({"prompt": ""}, "prompt must be a non-empty string"),
        ({"prompt": "   "}, "prompt must be a non-empty string"),
        ({"guidance_scale": -1.0}, "guidance_scale must be from 0 to 30"),
        ({"guidance_scale": math.nan}, "guidance_scale must be from 0 to 30"),
        ({"partial_images": 4}, "partial_images must be from 0 to 3"),
        ({"seed": -1}, "seed must be an integer"),
    ],
)
def test_bad_requests_are_rejected_clearly(denoiser: ZImageDenoiser, fields: dict, message: str) -> None:
    p = DiffusionPipeline(denoiser)
    with pytest.raises(RequestRejected, match=message):
        p.prepare(_request("x", **fields))
    assert not p.has_work()


def test_defaults_and_seeds(denoiser: ZImageDenoiser) -> None:
    p = DiffusionPipeline(denoiser)
    prepared = p.prepare(ImageRequest("d", "hello", n=3, seed=40))
    d = denoiser.defaults
    assert (prepared.shape.width, prepared.shape.height) == (d.width, d.height)
    assert (prepared.steps, prepared.guidance_scale) == (d.num_inference_steps, d.guidance_scale)
    assert prepared.seeds == (40, 41, 42)
    assert p.prepare(ImageRequest("r", "hello")).seeds[0] >= 0  # a random seed when none is given
    assert p.accepts(ImageRequest("i", "x")) and not p.accepts(FrameRequest("f"))
    assert p.kind == "image" and p.next_deadline() is None


def test_step_cost_is_the_measured_cost_of_the_next_call(denoiser: ZImageDenoiser) -> None:
    clock = FakeClock()
    p = DiffusionPipeline(Timed(denoiser, clock, predict=0.25, encode=0.1), clock=clock.now)
    p.add(_request("a", num_inference_steps=4), p.prepare(_request("a", num_inference_steps=4)))
    assert p.step_cost() == 0.0  # nothing measured yet
    p.step()  # encode
    p.step()  # step 1 (no guidance: cond alone)
    assert p.step_cost() == pytest.approx(0.25)  # the next step is step 2's cond call


def _run(s: Scheduler, clock: FakeClock) -> list:
    """Ticks as the engine thread does, sleeping (in simulated time) until work is due."""
    out: list = []
    for _ in range(10_000):
        due = s.next_due()
        if due is None:
            return out
        clock.t = max(clock.t, due)
        out.extend(s.tick())
    raise AssertionError("the scheduler never ran out of work")


@pytest.mark.parametrize("call_cost", [0.03, 0.2])
def test_a_realtime_tick_never_waits_behind_more_than_one_transformer_call(
    denoiser: ZImageDenoiser, call_cost: float
) -> None:
    clock = FakeClock()
    frames = FramePipeline(clock, period=0.08, cost=0.01)
    timed = Timed(denoiser, clock, predict=call_cost, encode=0.02, decode=0.02, preview=0.02)
    images = DiffusionPipeline(timed, clock=clock.now)  # type: ignore[arg-type]
    s = Scheduler([frames, images], clock=clock.now, starvation_limit=1.0)
    request = _request("img", num_inference_steps=6, guidance_scale=4.0, n=2)
    s.enqueue("image", request, images.prepare(request))
    s.enqueue("duplex", FrameRequest("call", frames=80), 80)
    out = _run(s, clock)
    finished = {rid: o for rid, o in out if isinstance(o, Finished)}
    assert finished["img"].reason == "stop" and finished["call"].reason == "stop"
    assert images.calls["transformer", 2] == 12  # cond and uncond of 6 steps, each its own step
    # With both CFG branches in one step a frame would wait 2 calls; it waits at most one.
    assert max(frames.lateness) <= call_cost + 1e-9
    if call_cost == 0.03:
        assert max(frames.lateness) < 1e-9  # a 30 ms call fits the 70 ms between frames
    else:
        assert max(frames.lateness) > 0.1  # a 200 ms call never fits: it runs when starved


def test_warm_up_runs_every_kind_of_call_once_and_leaves_the_pipeline_idle(denoiser: ZImageDenoiser) -> None:
    p = DiffusionPipeline(denoiser, media_workers=2)
    assert p.warm_up() > 0
    assert not p.has_work() and not p.media.busy() and p.rows_in_use() == 0
    called = {name for name, _ in p.calls}
    assert {"text_encoder", "transformer", "vae"} <= called, called
    request = _request("after", seed=3)
    p.add(request, p.prepare(request))
    with pytest.raises(RuntimeError, match="idle pipeline"):
        p.warm_up()
