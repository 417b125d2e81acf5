"""The diffusion runtime through the real Engine (its threads), beside a fake realtime pipeline."""

from __future__ import annotations

from omnirt.stages.diffusion.pipeline import DiffusionPipeline
from omnirt.stages.diffusion.types import GeneratedImage, ImageRequest, Progress
from omnirt.stages.diffusion.zimage import ZImageDenoiser
from omnirt.stages.engine import Engine
from omnirt.stages.types import TextDelta

from ..stages.pipelines import FramePipeline, FrameRequest, RealClock
from .conftest import run_in_engine


def test_image_requests_through_the_engine_beside_realtime_frames(denoiser: ZImageDenoiser) -> None:
    frames = FramePipeline(RealClock(), period=0.02, cost=0.001)
    images = DiffusionPipeline(denoiser, max_rows=4)
    engine = Engine([frames, images])

    def cancel_mid_run(rid: str, output: object) -> None:
        if rid == "doomed" and output == Progress(2, 50):
            engine.cancel("doomed")  # from the engine thread, mid-run

    requests = [
        ImageRequest(
            "a", "a quiet harbour", width=32, height=32, num_inference_steps=5, guidance_scale=2.0, seed=1
        ),
        ImageRequest("doomed", "a storm", n=2, width=32, height=32, num_inference_steps=50, seed=2),
        ImageRequest("bad", "a crooked frame", width=40, height=32),
        FrameRequest("call", frames=25),
    ]
    outputs = run_in_engine(engine, requests, cancel_mid_run)
    a = outputs["a"]
    assert [o.done for o in a if isinstance(o, Progress)] == [1, 2, 3, 4, 5]
    assert [o.index for o in a if isinstance(o, GeneratedImage)] == [0]
    assert a[-1].reason == "stop"
    doomed = outputs["doomed"]
    assert doomed[-1].reason == "cancelled"
    assert not any(isinstance(o, GeneratedImage) for o in doomed)
    assert max(o.done for o in doomed if isinstance(o, Progress)) < 50
    bad = outputs["bad"][-1]
    assert (bad.reason, bad.code) == ("error", "rejected") and "multiple of 16" in (bad.error or "")
    assert len(outputs["bad"]) == 1
    assert sum(isinstance(o, TextDelta) for o in outputs["call"]) == 25
    assert not images.has_work() and images.rows_in_use() == 0  # the cancelled rows were freed
    assert engine.stats.rows("image", "transformer")[1] >= 5
