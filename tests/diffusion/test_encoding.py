"""PNG and MP4 encoding off the engine thread (stages/diffusion/encoding.py): outputs released in
order per request, failures and cancels, and a realtime pipeline never waiting for an encoder."""

from __future__ import annotations

import threading
import time

import pytest
from omnirt.stages.diffusion import pipeline as runtime
from omnirt.stages.diffusion.encoding import MediaEncoder
from omnirt.stages.diffusion.pipeline import DiffusionPipeline
from omnirt.stages.diffusion.types import GeneratedImage, ImageRequest
from omnirt.stages.diffusion.zimage import ZImageDenoiser
from omnirt.stages.engine import Engine
from omnirt.stages.types import Finished, TextDelta, Usage

from ..stages.pipelines import FramePipeline, FrameRequest, RealClock
from .conftest import run_in_engine


def _slow(seconds: float, value: bytes) -> bytes:
    time.sleep(seconds)
    return value


def _drain_all(encoder: MediaEncoder, timeout: float = 5.0) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    deadline = time.monotonic() + timeout
    while encoder.busy():
        assert time.monotonic() < deadline, "the encoder never finished"
        out += encoder.drain()
        time.sleep(0.001)
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_outputs_leave_in_order_per_request_whatever_finishes_first(workers: int) -> None:
    woken = threading.Event()
    encoder = MediaEncoder(workers, on_ready=woken.set)
    encoder.submit("a", lambda b: ("a", b), _slow, 0.2, b"first")
    encoder.submit("a", lambda b: ("a", b), _slow, 0.0, b"second")  # done long before the first
    encoder.put("a", "done")
    encoder.submit("b", lambda b: ("b", b), _slow, 0.0, b"other")
    out = _drain_all(encoder)
    assert [o for rid, o in out if rid == "a"] == [("a", b"first"), ("a", b"second"), "done"]
    assert [o for rid, o in out if rid == "b"] == [("b", b"other")]
    if workers:
        assert woken.is_set()
        assert out.index(("b", ("b", b"other"))) < out.index(("a", ("a", b"first")))  # b did not wait for a


def test_a_failed_encoding_fails_its_request_only_and_drop_forgets_one() -> None:
    encoder = MediaEncoder(2)

    def broken(_: bytes) -> bytes:
        raise OSError("disk on fire")

    encoder.submit("bad", lambda b: b, broken, b"x")
    encoder.put("bad", Finished("stop", Usage()))  # never released: the failure ends the request
    encoder.submit("gone", lambda b: b, _slow, 0.3, b"x")
    encoder.submit("good", lambda b: b, _slow, 0.0, b"ok")
    assert encoder.drop("gone") and not encoder.drop("gone")
    out = _drain_all(encoder)
    bad = [o for rid, o in out if rid == "bad"]
    assert len(bad) == 1 and isinstance(bad[0], Finished) and bad[0].reason == "error"
    assert "disk on fire" in (bad[0].error or "")
    assert [o for rid, o in out if rid == "good"] == [b"ok"] and not [1 for rid, _ in out if rid == "gone"]


def test_a_slow_encoder_never_holds_up_realtime_frames(
    denoiser: ZImageDenoiser, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Images whose PNG encoding takes 1.5 s each, beside a 20 ms realtime frame clock: with the
    encoding on its threads no frame waits for it (inline, one would wait at least 1.5 s; the
    bound leaves room for the test process's own pauses, such as a full garbage collection), and
    the images still arrive whole."""
    monkeypatch.setattr(runtime, "png", lambda pixels: _slow(1.5, b"png"))
    frames = FramePipeline(RealClock(), period=0.02, cost=0.001)
    images = DiffusionPipeline(denoiser, max_rows=4, media_workers=2)
    engine = Engine([frames, images])
    requests = [
        ImageRequest("a", "a quiet harbour", n=2, width=32, height=32, num_inference_steps=2, seed=1),
        FrameRequest("call", frames=150),
    ]
    outputs = run_in_engine(engine, requests, timeout=30)
    a = outputs["a"]
    assert [(type(o).__name__, getattr(o, "png", None)) for o in a if not hasattr(o, "done")] == [
        ("GeneratedImage", b"png"),
        ("GeneratedImage", b"png"),
        ("Finished", None),
    ]
    assert [o.index for o in a if isinstance(o, GeneratedImage)] == [0, 1]
    assert sum(isinstance(o, TextDelta) for o in outputs["call"]) == 150
    assert max(frames.lateness) < 1.0, max(frames.lateness)  # never behind a 1.5 s encode
