"""The scheduler alone, on simulated time: tick order, per-pipeline queues, failure isolation."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from omnirt.stages.pipeline import RequestRejected
from omnirt.stages.scheduler import Outputs, Scheduler
from omnirt.stages.types import ContextMessage, Finished, GenerationRequest, TextDelta, TextPart, Usage

from tests.fakes import EchoPipeline

from .pipelines import FakeClock, FramePipeline, FrameRequest, JobPipeline, JobRequest


def _enqueue(s: Scheduler, request) -> bool:  # type: ignore[no-untyped-def]
    kind = s.route(request)
    return s.enqueue(kind, request, s.pipelines[kind].prepare(request))


def _run(s: Scheduler, clock: FakeClock, max_ticks: int = 10_000) -> Outputs:
    """Ticks as the engine thread does, sleeping (in simulated time) until work is due."""
    out: Outputs = []
    for _ in range(max_ticks):
        due = s.next_due()
        if due is None:
            return out
        clock.t = max(clock.t, due)
        out.extend(s.tick())
    raise AssertionError("the scheduler never ran out of work")


def _finished(out: Outputs) -> dict[str, Finished]:
    return {rid: o for rid, o in out if isinstance(o, Finished)}


@pytest.mark.parametrize("batch_cost", [0.03, 0.2])
def test_realtime_frames_never_wait_more_than_one_batch_step(batch_cost: float) -> None:
    clock = FakeClock()
    frames = FramePipeline(clock, period=0.08, cost=0.01)
    jobs = JobPipeline(clock, cost=batch_cost)
    s = Scheduler([frames, jobs], clock=clock.now, starvation_limit=1.0)
    _enqueue(s, JobRequest("job", steps=1000))
    _enqueue(s, FrameRequest("call", frames=60))
    out = _run_until_frames_done(s, clock, frames)
    assert [o.text for rid, o in out if rid == "call" and isinstance(o, TextDelta)][-1] == "duplex 60"
    assert max(frames.lateness) <= batch_cost + 1e-9
    batch_steps = sum(jobs.calls.values())
    if batch_cost == 0.03:
        # Two 30 ms steps fit in each 70 ms gap between 10 ms frames: never late at all.
        assert max(frames.lateness) < 1e-9
        assert batch_steps >= 2 * 59
    else:
        # A 200 ms step never fits an 80 ms period: it runs once starved for a second, late.
        assert max(frames.lateness) > 0.1
        assert 3 <= batch_steps <= 6


@dataclass
class _VideoRequest:
    request_id: str
    steps: int = 3


class _VideoJobs(JobPipeline):
    kind = "video"

    def __init__(self, clock: FakeClock, *, cost: float) -> None:
        super().__init__(clock, cost=cost)
        self.request_type = _VideoRequest


def _frames_beside_images_and_video(
    image_cost: float, video_cost: float, *, frames: int
) -> tuple[Scheduler, FakeClock, FramePipeline, JobPipeline, _VideoJobs]:
    """A call of ``frames`` 10 ms frames every 80 ms, queued after an endless image job and an
    endless video job whose steps cost so many seconds."""
    clock = FakeClock()
    call = FramePipeline(clock, period=0.08, cost=0.01)
    images, videos = JobPipeline(clock, cost=image_cost), _VideoJobs(clock, cost=video_cost)
    s = Scheduler([call, images, videos], clock=clock.now, starvation_limit=1.0)
    _enqueue(s, JobRequest("image", steps=10_000))
    _enqueue(s, _VideoRequest("video", steps=10_000))
    _enqueue(s, FrameRequest("call", frames=frames))
    return s, clock, call, images, videos


def test_a_gap_too_short_for_one_batch_pipeline_goes_to_another() -> None:
    """Frames every 80 ms leave 70 ms gaps: a 100 ms video step never fits one (it runs once
    starved for a second), so the image pipeline's 20 ms steps fill every gap, whoever's turn it
    is, and the video keeps its turn for the next gap."""
    s, clock, frames, images, videos = _frames_beside_images_and_video(0.02, 0.1, frames=50)  # 4 s
    ticks_before = clock.t
    _run_until_frames_done(s, clock, frames)
    image_steps, video_steps = sum(images.calls.values()), sum(videos.calls.values())
    assert image_steps >= 3 * (49 - 2 * video_steps)  # three 20 ms steps in each 70 ms gap left
    assert 3 <= video_steps <= 5  # starved once a second, never in a gap
    assert max(frames.lateness) <= 0.1 + 1e-9  # a frame waits at most one (starved) batch step
    assert clock.t - ticks_before < 4.2


def _batch_seconds(images: JobPipeline, videos: JobPipeline) -> tuple[float, float]:
    return sum(images.calls.values()) * images.cost, sum(videos.calls.values()) * videos.cost


def test_batch_pipelines_share_the_engines_time_not_its_steps() -> None:
    """With no realtime work, an image pipeline of 20 ms steps and a video pipeline of 100 ms steps
    each get about half of the time: round robin by steps gave the video five sixths of it."""
    clock = FakeClock()
    images, videos = JobPipeline(clock, cost=0.02), _VideoJobs(clock, cost=0.1)
    s = Scheduler([FramePipeline(clock), images, videos], clock=clock.now)
    _enqueue(s, JobRequest("image", steps=10_000))
    _enqueue(s, _VideoRequest("video", steps=10_000))
    for _ in range(600):
        _tick_when_due(s, clock)
    image_s, video_s = _batch_seconds(images, videos)
    assert abs(image_s - video_s) <= videos.cost + 1e-9  # never more than one step apart


def test_batch_pipelines_share_the_gaps_between_realtime_steps_by_time() -> None:
    """Frames every 80 ms leave 70 ms gaps, and both kinds' steps fit them (20 and 40 ms): each
    kind gets about half of the gaps' time. Round robin by steps gave the video two thirds."""
    s, clock, frames, images, videos = _frames_beside_images_and_video(0.02, 0.04, frames=100)  # 8 s
    _run_until_frames_done(s, clock, frames)
    image_s, video_s = _batch_seconds(images, videos)
    assert image_s + video_s > 0.8 * 100 * 0.07  # the gaps are filled
    assert abs(image_s - video_s) <= 0.1 * (image_s + video_s)
    assert max(frames.lateness) < 1e-9


def test_a_batch_pipeline_that_was_idle_is_owed_nothing() -> None:
    """A pipeline that gets work after the other has run alone for a while starts level with it:
    from then on they alternate, and the newcomer does not run alone to catch up."""
    clock = FakeClock()
    images, videos = JobPipeline(clock, cost=0.05), _VideoJobs(clock, cost=0.05)
    s = Scheduler([FramePipeline(clock), images, videos], clock=clock.now)
    _enqueue(s, _VideoRequest("video", steps=10_000))
    for _ in range(40):  # 2 s of video alone
        _tick_when_due(s, clock)
    _enqueue(s, JobRequest("image", steps=10_000))
    before = sum(videos.calls.values())
    for _ in range(21):  # the admission tick, then 20 steps
        _tick_when_due(s, clock)
    assert sum(videos.calls.values()) - before >= 9  # about half of them, not none


def _run_until_frames_done(s: Scheduler, clock: FakeClock, frames: FramePipeline) -> Outputs:
    out: Outputs = []
    for _ in range(10_000):
        if out and not frames.has_work():
            return out
        out.extend(_tick_when_due(s, clock))
    raise AssertionError("ticks that did nothing (next_due and tick disagree)")


def test_without_realtime_work_one_batch_step_runs_per_tick() -> None:
    clock = FakeClock()
    jobs = JobPipeline(clock, cost=0.5)
    s = Scheduler([FramePipeline(clock), jobs], clock=clock.now)
    _enqueue(s, JobRequest("a", steps=5))
    _enqueue(s, JobRequest("b", steps=5))
    assert s.next_due() == clock.t  # admission is due
    s.tick()
    assert jobs.calls == {("diffusion", 2): 1}  # both jobs in one batched step
    s.tick()
    assert jobs.calls == {("diffusion", 2): 2}


def test_realtime_work_without_a_deadline_alternates_with_batch_steps() -> None:
    clock = FakeClock()
    echo, jobs = EchoPipeline(), JobPipeline(clock, cost=0.5)
    s = Scheduler([echo, jobs], clock=clock.now)
    _enqueue(s, JobRequest("job", steps=10))
    _enqueue(s, GenerationRequest("talk", [ContextMessage("user", (TextPart("a b c d e f"),))]))
    for _ in range(3):
        s.tick()
    assert echo.steps == 3 and sum(jobs.calls.values()) == 3


def _tick_when_due(s: Scheduler, clock: FakeClock) -> Outputs:
    due = s.next_due()
    assert due is not None
    clock.t = max(clock.t, due)
    return s.tick()


def test_a_failing_step_fails_only_its_pipelines_active_requests() -> None:
    clock = FakeClock()
    frames, jobs = FramePipeline(clock), JobPipeline(clock, cost=0.03, slots=1)
    s = Scheduler([frames, jobs], clock=clock.now)
    for request in (FrameRequest("call", frames=5), JobRequest("j1", steps=99), JobRequest("j2", steps=2)):
        _enqueue(s, request)
    _tick_when_due(s, clock)
    done = jobs.done["j1"]
    assert done == 2  # two 30 ms steps fitted before the next frame
    jobs.explode = True
    out = _tick_when_due(s, clock)
    failed = _finished(out)
    assert list(failed) == ["j1"]
    assert failed["j1"].reason == "error" and failed["j1"].code == "internal"
    assert "diffusion boom" in (failed["j1"].error or "")
    assert failed["j1"].usage == Usage(output_text_tokens=done)  # what it had done, from remove()
    assert jobs.removed == ["j1"] and not jobs.has_work()
    assert ("call", TextDelta("duplex 2")) in out  # the realtime pipeline stepped on
    jobs.explode = False
    out = _run(s, clock)
    assert _finished(out) == {
        "call": Finished("stop", Usage(output_text_tokens=5)),
        "j2": Finished("stop", Usage(output_text_tokens=2)),  # the waiting job was admitted after
    }
    assert s.counts() == (0, 0)


def test_each_pipeline_has_its_own_waiting_queue() -> None:
    clock = FakeClock()
    frames, jobs = FramePipeline(clock), JobPipeline(clock, slots=1)
    s = Scheduler([frames, jobs], clock=clock.now, max_waiting=1)
    assert _enqueue(s, JobRequest("j1"))
    s.tick()  # j1 takes the only diffusion slot
    assert _enqueue(s, JobRequest("j2"))  # waits
    assert not _enqueue(s, JobRequest("j3"))  # the diffusion queue is full
    assert _enqueue(s, FrameRequest("call"))  # not behind the diffusion queue's head
    out = s.tick()
    assert ("call", TextDelta("duplex 1")) in out
    assert jobs.added == ["j1"] and s.counts() == (2, 1)


def test_routing_by_request_type() -> None:
    clock = FakeClock()
    s = Scheduler([EchoPipeline(), FramePipeline(clock), JobPipeline(clock)], clock=clock.now)
    assert s.route(GenerationRequest("g", [])) == "speech"
    assert s.route(FrameRequest("f")) == "duplex"
    assert s.route(JobRequest("j")) == "diffusion"
    with pytest.raises(RequestRejected, match="no loaded model serves str requests"):
        s.route("hello")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="two pipelines of kind 'duplex'"):
        Scheduler([FramePipeline(clock), FramePipeline(clock)])


def test_an_id_in_flight_is_refused() -> None:
    clock = FakeClock()
    s = Scheduler([JobPipeline(clock)], clock=clock.now)
    assert _enqueue(s, JobRequest("same"))
    with pytest.raises(RequestRejected, match="already in flight"):
        _enqueue(s, JobRequest("same"))


def test_cancel_drops_waiting_and_active_requests() -> None:
    clock = FakeClock()
    jobs = JobPipeline(clock, slots=1)
    s = Scheduler([jobs], clock=clock.now)
    _enqueue(s, JobRequest("active", steps=5))
    _enqueue(s, JobRequest("queued", steps=5))
    s.tick()
    assert s.cancel("queued") == Usage()
    assert s.cancel("active") == Usage(output_text_tokens=1)
    assert s.cancel("active") is None and s.cancel("unknown") is None
    assert jobs.removed == ["active"] and jobs.added == ["active"]
    assert s.tick() == [] and s.next_due() is None


def test_next_due_waits_for_the_next_frame() -> None:
    clock = FakeClock()
    frames = FramePipeline(clock, period=0.08)
    s = Scheduler([frames], clock=clock.now)
    assert s.next_due() is None
    _enqueue(s, FrameRequest("call", frames=3))
    s.tick()
    assert s.next_due() == pytest.approx(clock.t - frames.cost + 0.08)


def test_background_requests_are_admitted_after_every_other_waiting_request() -> None:
    """Input transcriptions (``background``) never take a slot a waiting reply could have, and
    keep their own arrival order."""
    speech = EchoPipeline(slots=1)
    s = Scheduler([speech])
    admitted: list[str] = []
    add = speech.add

    def recording_add(request: GenerationRequest, prepared: object = None) -> None:
        admitted.append(request.request_id)
        add(request, prepared)

    speech.add = recording_add  # type: ignore[method-assign]

    def request(rid: str, background: bool = False) -> GenerationRequest:
        return GenerationRequest(rid, [ContextMessage("user", (TextPart(rid),))], background=background)

    _enqueue(s, request("reply-1"))
    s.tick()  # reply-1 takes the only slot
    for rid, background in [("asr-1", True), ("reply-2", False), ("asr-2", True), ("reply-3", False)]:
        _enqueue(s, request(rid, background))
    for _ in range(100):
        if s.counts() == (0, 0):
            break
        s.tick()
    assert admitted == ["reply-1", "reply-2", "reply-3", "asr-1", "asr-2"]


class _AheadPipeline(FramePipeline):
    """Turn-based speech's shape: frames may be made ahead of their deadline (``runs_early``)."""

    runs_early = True


def test_a_pipeline_that_may_run_early_runs_at_once_without_batch_work() -> None:
    """No batch work: every step runs as soon as the last ends (work-conserving), not at the
    frame clock. Batch work waiting: it runs at its deadlines and batch steps fill the time
    between, still never making it late by more than one batch step."""
    clock = FakeClock()
    ahead = _AheadPipeline(clock, period=0.08, cost=0.01)
    s = Scheduler([ahead, JobPipeline(clock, cost=0.03)], clock=clock.now, starvation_limit=1.0)
    _enqueue(s, FrameRequest("alone", frames=10))
    start = clock.t
    _run(s, clock)
    assert clock.t - start == pytest.approx(10 * 0.01)  # ten steps back to back, no waiting

    clock2 = FakeClock()
    ahead2, jobs = _AheadPipeline(clock2, period=0.08, cost=0.01), JobPipeline(clock2, cost=0.03)
    s2 = Scheduler([ahead2, jobs], clock=clock2.now, starvation_limit=1.0)
    _enqueue(s2, JobRequest("job", steps=1000))
    _enqueue(s2, FrameRequest("beside", frames=10))
    _run_until_frames_done(s2, clock2, ahead2)
    assert max(ahead2.lateness) < 1e-9  # 30 ms steps fit in the 70 ms between its frames
    assert sum(jobs.calls.values()) >= 2 * 9  # and they did run there


def test_early_steps_fit_before_the_next_duplex_frame() -> None:
    """Turn-based speech (steps that may run early, 50 ms each) beside duplex frames (a firm 80 ms
    clock, 10 ms steps): an early speech step starts only when it ends before the next duplex
    frame is due, so no duplex frame waits for it; speech still gets the time between frames."""
    clock = FakeClock()
    duplex = FramePipeline(clock, period=0.08, cost=0.01)
    speech = _AheadPipeline(clock, period=0.08, cost=0.05)
    speech.kind = "speech"
    speech.accepts = lambda request: request.request_id.startswith("turn")  # type: ignore[method-assign]
    s = Scheduler([speech, duplex], clock=clock.now)
    _enqueue(s, FrameRequest("call", frames=40))
    _enqueue(s, FrameRequest("turn", frames=1000))
    _run_until_frames_done(s, clock, duplex)
    assert max(duplex.lateness) < 1e-9
    # one 50 ms speech step fits in each 70 ms gap: the speech pipeline is not starved
    assert len(speech.lateness) >= 39


@pytest.mark.parametrize("batch_slice", [0.0, -0.01])
def test_a_batch_slice_must_be_positive(batch_slice: float) -> None:
    clock = FakeClock()
    with pytest.raises(ValueError, match="batch_slice must be positive"):
        Scheduler([FramePipeline(clock), JobPipeline(clock)], clock=clock.now, batch_slice=batch_slice)


def test_deliver_hands_out_each_steps_outputs_before_the_next_step_runs() -> None:
    """With ``deliver`` (the engine's way), a realtime step's outputs go out as it ends, before
    the batch steps fitted after it in the same tick (they used to wait for the whole tick)."""
    clock = FakeClock()
    frames, jobs = FramePipeline(clock, period=0.08, cost=0.01), JobPipeline(clock, cost=0.02)
    s = Scheduler([frames, jobs], clock=clock.now)
    _enqueue(s, FrameRequest("talk", frames=3))
    _enqueue(s, JobRequest("job", steps=50))
    seen: list[tuple[str, float]] = []
    batch_ran_at: list[float] = []
    step = jobs.step

    def timed_step():  # type: ignore[no-untyped-def]
        batch_ran_at.append(clock.now())
        return step()

    jobs.step = timed_step  # type: ignore[method-assign]
    assert s.tick(lambda rid, out: seen.append((rid, clock.now()))) == []
    talk = [t for rid, t in seen if rid == "talk"]
    assert talk and len(batch_ran_at) >= 2  # a frame, then batch steps in the gap before the next
    assert talk[0] <= batch_ran_at[0]  # out before any batch step ran
    assert all(rid in ("talk", "job") for rid, _ in seen)
