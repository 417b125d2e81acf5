"""The speech pipeline's deadlines under the engine's scheduler, beside batch work (a diffusion
stand-in): a playing reply stays ahead of its playback while another awaits its first audio, and a
first audio is due ``first_audio_target`` after its request, batch steps running in the slack."""

from __future__ import annotations

import time
from pathlib import Path

from omnirt.stages.scheduler import Outputs, Scheduler
from omnirt.stages.speech.loader import load_speech_pipeline
from omnirt.stages.types import AudioDelta, Finished

from tests.stages.pipelines import JobPipeline, JobRequest, RealClock

from .conftest import audio_request, tone


class _Jobs(JobPipeline):
    """Batch steps of ``cost`` seconds that say they cost ``says``."""

    def __init__(self, *, cost: float, says: float) -> None:
        super().__init__(RealClock(), cost=cost)
        self.says = says
        self.stepped_at: list[float] = []

    def step_cost(self) -> float:
        return self.says

    def step(self):  # type: ignore[no-untyped-def]
        self.stepped_at.append(time.monotonic())
        return super().step()


def _enqueue(s: Scheduler, request) -> None:  # type: ignore[no-untyped-def]
    kind = s.route(request)
    assert s.enqueue(kind, request, s.pipelines[kind].prepare(request))


def _until(s: Scheduler, done, limit: float = 60.0) -> Outputs:  # type: ignore[no-untyped-def]
    """Ticks as the engine thread does (sleeping until the next tick is due) until ``done(out)``."""
    out: Outputs = []
    end = time.monotonic() + limit
    while not done(out):
        assert time.monotonic() < end, "timed out"
        due = s.next_due()
        assert due is not None, "no work left"
        time.sleep(max(0.0, due - s.clock()))
        out += s.tick()
    return out


def _heard(rid: str):  # type: ignore[no-untyped-def]
    return lambda out: any(r == rid and isinstance(o, AudioDelta) for r, o in out)


def test_batch_work_never_runs_past_a_playing_reply_while_another_awaits_its_first_audio(
    demo_dir: Path,
) -> None:
    """Batch steps too long for any deadline never run (no starvation rule here) while one reply
    plays and another waits for its first audio; both replies go on. (Before the first-audio
    deadline, a reply awaiting its first audio asked for "at once", and a batch step ran after
    every tick, past the playing reply's deadline.)"""
    speech = load_speech_pipeline(demo_dir, max_slots=4, max_audio_frames=30)
    jobs = _Jobs(cost=0.0, says=30.0)
    s = Scheduler([speech, jobs], starvation_limit=1e6)
    _enqueue(s, audio_request("a", tone(1.0), max_output_tokens=12))
    _until(s, _heard("a"))
    _enqueue(s, JobRequest("job", steps=1000))
    _enqueue(s, audio_request("b", tone(1.0, seed=1), max_output_tokens=12))
    _until(s, _heard("b"))
    assert not jobs.stepped_at
    s.cancel("job")
    out = _until(s, lambda o: sum(isinstance(x, Finished) for _, x in o) >= 2)
    assert {r for r, x in out if isinstance(x, Finished) and x.reason in ("stop", "length")} == {"a", "b"}


def test_a_first_audio_target_lets_batch_steps_run_before_the_first_audio(demo_dir: Path) -> None:
    """With a first-audio target of 1.5 s, the reply's prompt is read at once, batch steps run in
    the slack, and its first audio comes before the target (plus one batch step and a tick of
    slack). With a target of 0 no batch step runs before the first audio."""
    speech = load_speech_pipeline(demo_dir, max_slots=4, max_audio_frames=30)
    jobs = _Jobs(cost=0.01, says=0.01)
    s = Scheduler([speech, jobs], starvation_limit=1e6)
    _enqueue(s, audio_request("warm", tone(1.0), max_output_tokens=4))  # measures ticks to first audio
    _until(s, lambda o: any(r == "warm" and isinstance(x, Finished) for r, x in o))

    speech.first_audio_target = 1.5
    _enqueue(s, JobRequest("job", steps=100_000))
    _until(s, lambda o: bool(jobs.stepped_at))
    batch_before = len(jobs.stepped_at)
    _enqueue(s, audio_request("a", tone(1.0, seed=2), max_output_tokens=4))
    _until(s, lambda o: "a" in speech._active)
    asked = speech._active["a"].request.asked_at
    _until(s, _heard("a"))
    heard = time.monotonic()
    # The slack is spent before the reply is admitted or between its ticks: batch steps of 10 ms
    # in most of 1.5 s.
    assert len(jobs.stepped_at) - batch_before > 10
    assert heard - asked < 1.5 + 0.5  # from the request, waiting for admission included

    speech.first_audio_target = 0.0
    _enqueue(s, audio_request("b", tone(1.0, seed=3), max_output_tokens=4))
    _until(s, lambda o: "b" in speech._active)
    admitted = speech._active["b"].admitted
    _until(s, _heard("b"))
    assert not [t for t in jobs.stepped_at if t >= admitted]
    s.remove_all()


def test_the_servers_first_audio_target_reaches_the_speech_pipeline(demo_dir: Path) -> None:
    from omnirt.realtime.build import _configure_speech
    from omnirt.realtime.config import ServerConfig

    speech = load_speech_pipeline(demo_dir, max_slots=2, max_audio_frames=8)
    other = JobPipeline(RealClock())
    _configure_speech([speech, other], ServerConfig(first_audio_target_ms=400, prompt_ticks=False))
    assert speech.first_audio_target == 0.4 and not hasattr(other, "first_audio_target")
    assert speech.prompt_ticks is False  # the default is on


def test_a_prompt_left_for_due_frames_runs_before_any_batch_step(demo_dir: Path) -> None:
    """With prompt ticks, a tick whose frames were due leaves the new prompt for the next tick and
    says it is due now: the scheduler fits no batch step between the two (it used to say "no
    deadline", and one batch step of any length ran there)."""
    speech = load_speech_pipeline(demo_dir, max_slots=4, max_audio_frames=60)
    speech.prompt_ticks = True
    jobs = _Jobs(cost=0.0, says=0.001)
    s = Scheduler([speech, jobs], starvation_limit=1e6)
    _enqueue(s, audio_request("a", tone(1.0), max_output_tokens=16))
    _until(s, _heard("a"))
    _enqueue(s, JobRequest("job", steps=100_000))
    a = speech._active["a"]
    a.audio_started = time.monotonic() - a.audio_seconds  # a's audio runs out now
    _enqueue(s, audio_request("b", tone(1.0, seed=1), max_output_tokens=8))
    batch_before = len(jobs.stepped_at)
    out = s.tick()  # b admitted; a's frame first
    assert "b" in speech._active and not [o for r, o in out if r == "b"]
    assert len(jobs.stepped_at) == batch_before  # nothing fitted before the prompt
    assert s.next_due() is not None and s.next_due() <= s.clock()
    a.audio_started = time.monotonic() + 60.0 - a.audio_seconds  # the frames made room
    out = s.tick()
    assert any(r == "b" for r, _ in out) and speech._active["b"].prefilled
    s.remove_all()


def test_torch_gets_one_cpu_thread_when_the_models_run_on_cuda(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import types

    import torch
    from omnirt.stages.factory import configure_host_threads

    threads = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cuda = types.SimpleNamespace(denoiser=types.SimpleNamespace(device=torch.device("cuda")))
    cpu = types.SimpleNamespace(device=torch.device("cpu"))
    try:
        torch.set_num_threads(2)
        configure_host_threads([cpu])
        assert torch.get_num_threads() == 2  # the models' own work needs the pool
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        configure_host_threads([cpu, cuda])
        assert torch.get_num_threads() == 2  # the operator's word
        monkeypatch.delenv("OMP_NUM_THREADS")
        configure_host_threads([cpu, cuda])
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
