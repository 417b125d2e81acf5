"""Realtime speech beside image and video diffusion in one process, through the engine's scheduler.

Builds the speech pipeline (as ``speech_capacity.py`` does) and the image (Z-Image) and video (Wan)
diffusion pipelines, puts them under one :class:`~omnirt.stages.scheduler.Scheduler` (what the
engine thread runs: realtime steps when due, batch steps in the time before the next realtime
deadline) and drives ``Scheduler.tick()`` in a loop in this process: no server, no engine thread.
The speech pipeline's deadlines keep each playing reply ahead of its playback and bring each first
audio within its ``first_audio_target`` of the turn's admission (``--first-audio-targets``).
Prompt work (``prepare``) runs inline between ticks, outside the timed tick, as the engine's prompt
threads do it beside the engine thread.

Load: ``--sessions`` N sessions speaking in turns (each turn ``--audio-seconds`` of a speech-like
tone, audio out, replies capped as in ``speech_capacity.py``; a person listens to the reply
and then asks again: the next turn's prompt arrives once the reply has played and
``--audio-seconds`` more have passed, the next question spoken; ``--back-to-back``: as soon as the
reply is made), and a stream of image jobs (``--image-size``, ``--image-steps``, ``--image-n``) and of
video jobs (``--video-size``, ``--video-frames``, ``--video-steps``), ``--image-jobs`` and
``--video-jobs`` of each kept in flight (a new one is submitted when one finishes).

Three phases in one run, each a ramp (until every session has heard audio and every diffusion
stream has done a denoising step), a measured window of ``--seconds``, and a tail that starts no
turn until the window's turns have their first audio (diffusion load goes on through the tail):

1. **realtime alone**: the sessions only;
2. **diffusion alone**: the image and video jobs only;
3. **both** together (one such phase per ``--first-audio-targets`` value, and per further
   ``--batch-slices`` value: the scheduler's longest diffusion piece while speech is active).

Measured per phase (window only):

- **frame p50/p99**: for each speech step that produced a talker frame, the time from when it was
  due (the speech pipeline's ``next_deadline()``, or at once when it has none; not before the
  speech step before it ended) or from its start, whichever came first, to its end: the step
  itself plus any wait behind diffusion steps past its deadline. Alone, speech runs at once and
  this is the step's time; **no-prompt frame p99**: the same over the steps that read no part of a
  prompt (a step that also reads a new turn's prompt is longer by that pass, alone or not; with
  diffusion beside it, speech steps run at the playback's pace rather than at once, so fewer
  steps carry more of the prompt passes and the p99 over all steps lands among them);
- **tick p50/p99**: wall time of the scheduler ticks in which a talker frame was produced: the
  speech step and the batch steps that ran after it in the same tick, before the next deadline
  (the frame time of the runs before 2026-12-03, when one batch step followed each speech step);
- **first audio p50/p99**: from a turn's ``prepare`` to the end of the step that made its first
  ``AudioDelta`` (turns started in the window). Outputs count from the end of their own step, as
  the engine hands them out (``Scheduler.tick(deliver)``), not from the end of the tick: before
  2026-12-04 the engine held a speech step's audio until the batch steps after it in the same
  tick had run, and the benchmark timed it so;
- **audio late p99 / late deltas**: what a listener hears. Each reply plays from ``--player-delay``
  (0.2 s) after its first ``AudioDelta`` on at real time, so every later delta is due when the
  audio before it has played; its lateness is how long after that it arrived (0 when early). Late
  deltas are gaps in the playback; the goals table also counts them by their place in the reply
  (the second delta, after the vocoder's short first chunk; a later one; the last, its flush).
  With diffusion beside it the speech pipeline keeps its replies just ahead of playback (its
  ``next_deadline``) and lets diffusion steps run in the slack, so the tick time grows by design
  while the lateness must stay at 0;
- **diffusion throughput**: images finished per second, video jobs finished per second, and
  denoising steps per second of each kind (one ``Progress``: one step of one request, all its
  images; the CFG branches of a step count once), with the parts of the steps under way at the
  window's edges (``DiffusionPipeline.steps_done``: a Wan step is seconds, so whole steps alone
  would count a 15 s window's video work in thirds). The throughput goal is checked on steps/s
  (finished jobs/s are coarse in a short window);
- **step times per call**: every pipeline step timed alone (on CUDA with ``synchronize`` after it):
  the speech tick, and each diffusion call (``encode``, ``cond``, ``uncond``, ``decode``,
  ``preview``, ``settle``) by rows, against the 80 ms frame budget.

Then the ratios against the alone baselines of the same run: realtime frame p99 growth (goal:
at most +10%) and diffusion steps/s loss (goal: at most -15%). Before the phases one image and one
video job run alone: the first request of each kind pays whatever was not initialised at
start-up (the pipelines are warmed up as the server builds them, ``DiffusionPipeline.warm_up``,
included in "built in"); the report says what the first job cost against a steady one. Last, a
Z-Image transformer (DiT) step alone at ``--dit-size``
(default: the image model's default size), batch 1: its median time, FLOPs counted by
``torch.utils.flop_counter`` and the compute floor at ``--peak-tflops``, against the issue's
floor (~63 ms on the H200) and goal (70 ms).

Several runs together: ``--save FILE`` writes each phase's measures (frame latencies, first audio,
lateness, denoising steps and jobs, the engine's time), and ``--pool FILE...`` (no model loaded)
prints the goals table and the engine's time of the runs' phases merged by name: windows and step
counts summed, latencies pooled, so one p99 covers every run's frames and one steps/s every run's
windows (a 15 s window holds only a few video steps, and one run's p99 is its few slowest frames).

On the H200, real sizes with random weights (bf16; Z-Image-Turbo 1024x1024 8 steps, Wan2.1 1.3B
480p 81 frames; ``benchmarks/diffusion_gpu_run.sh`` runs this with bounded time)::

    python benchmarks/realtime_with_diffusion.py --load-format dummy \\
        --speech-model benchmarks/models/qwen3-omni-30b-a3b-instruct \\
        --image-model benchmarks/models/z-image-turbo/z-image-turbo.components.json \\
        --video-model benchmarks/models/wan2.1-t2v/wan2.1-t2v.components.json --video-variant 1.3b \\
        --sessions 8 --max-output-tokens 8 --max-audio-frames 24 --video-steps 2 --seconds 15

On CPU with the embedded models (demo speech, tiny Z-Image and Wan; about a minute)::

    python benchmarks/realtime_with_diffusion.py --device cpu --threads 1 --sessions 4 --seconds 15 \\
        --max-output-tokens 4 --max-audio-frames 16 --image-size 128x128 --image-steps 4 \\
        --video-size 64x64 --video-frames 5 --video-steps 3
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omnirt.stages.diffusion.pipeline import DiffusionPipeline
from omnirt.stages.diffusion.types import (
    GeneratedImage,
    GeneratedVideo,
    ImageRequest,
    Progress,
    VideoRequest,
)
from omnirt.stages.factory import configure_host_threads
from omnirt.stages.pipeline import Pipeline, RequestRejected
from omnirt.stages.scheduler import Scheduler
from omnirt.stages.types import (
    SAMPLE_RATE,
    AudioDelta,
    AudioPart,
    ContextMessage,
    Finished,
    GenerationRequest,
    TextPart,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speech_capacity import (  # noqa: E402  (a sibling script, not a package)
    DTYPES,
    FRAME_SECONDS,
    FrameCounter,
    Session,
    Startup,
    _sync,
    build,
    speechlike_tone,
)

log = logging.getLogger("realtime_with_diffusion")

#: Phase-name suffixes of --compare-prompt-ticks, by the speech pipeline's prompt_ticks setting.
OTHER_TICKS = {True: "prompt ticks", False: "prompts in frame ticks"}

#: Phase-name suffix of --compare-vocoder-steps.
PER_FRAME = "a vocoder step a frame"


class PerFrameVocoder:
    """Switches the speech pipeline's ``StreamingVocoder`` between its chunk steps and the vocoder
    as it was before 2026-12-05: a one-frame step for every stream with a frame at every pull
    (graphs of one-frame steps captured here on CUDA), the audio held and handed out by the same
    chunks (2 frames, then 6). Between phases only."""

    def __init__(self, speech: Any) -> None:
        vocoder = getattr(speech, "vocoder", None)
        self.streamer = getattr(vocoder, "streamer", None)
        self.applies = self.streamer is not None and hasattr(vocoder, "_held")
        if not self.applies:
            return
        self.vocoder = vocoder
        self.step_buckets = list(self.streamer.step_buckets)
        self.runners = dict(self.streamer.runners)
        self.frame_runners = dict(self.runners)
        if self.runners and 1 not in self.runners:  # graphed: the one-frame step's graphs too
            from omnirt.stages.speech.code2wav import capture_step_graphs

            self.frame_runners = {1: capture_step_graphs(self.streamer, 1)}

    def set(self, per_frame: bool) -> None:
        if not self.applies:
            return
        self.streamer.step_buckets = [1] if per_frame else self.step_buckets
        self.streamer.runners = self.frame_runners if per_frame else self.runners
        if per_frame:
            self.vocoder.pull = self._pull_every_frame
        else:
            self.vocoder.__dict__.pop("pull", None)

    def _pull_every_frame(self, finishing: Any) -> dict[str, tuple[np.ndarray, int]]:
        v = self.vocoder
        while batch := {k: q.pop(0) for k, q in v._queued.items() if q}:
            pcm = v.streamer.step({v._slot[k]: codes for k, codes in batch.items()})
            for k in batch:
                v._hold(k, pcm[v._slot[k]], 1)
        return v._hand_out(lambda k, frames: k in finishing or v.due(v._sent[k], v._sent[k] + frames))


#: Goals of issue 10.
P99_GROWTH_GOAL = 0.10
THROUGHPUT_LOSS_GOAL = 0.15
DIT_FLOOR_MS = 63.0  # the compute floor of a Z-Image step at 1024x1024 on the H200
DIT_GOAL_MS = 70.0


# -- timing every pipeline step -------------------------------------------------------------------

CallKey = tuple[str, str, int]  # (pipeline kind, call, rows)


@dataclass(frozen=True)
class Beside:
    """What else happened during one step: the garbage collector's pauses, the caching
    allocator's ``cudaMalloc`` calls and retries (a retry frees every cached block), the
    engine thread's own CPU time, and whether a PNG or MP4 was being encoded on a media thread."""

    gc_s: float = 0.0
    device_allocs: int = 0
    alloc_retries: int = 0
    cpu_s: float = 0.0
    encoding: bool = False


class Probe:
    """Counters read before and after each step (:class:`Beside`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.gc_s = 0.0
        self._gc_start: float | None = None
        self._lock = threading.Lock()
        self.encoding = 0  # encodes under way
        self.encodes = 0  # encodes started or ended so far
        gc.callbacks.append(self._gc)

    def close(self) -> None:
        gc.callbacks.remove(self._gc)

    def _gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None:
            self.gc_s += time.perf_counter() - self._gc_start
            self._gc_start = None

    def encode(self, delta: int) -> None:
        with self._lock:
            self.encoding += delta
            self.encodes += 1

    def snapshot(self) -> tuple[float, int, int, float, int, int]:
        allocs = retries = 0
        if self.device.type == "cuda":
            stats = torch.cuda.memory_stats(self.device)
            allocs, retries = stats.get("num_device_alloc", 0), stats.get("num_alloc_retries", 0)
        return self.gc_s, allocs, retries, time.thread_time(), self.encodes, self.encoding

    def since(self, before: tuple[float, int, int, float, int, int]) -> Beside:
        now = self.snapshot()
        return Beside(
            gc_s=now[0] - before[0],
            device_allocs=now[1] - before[1],
            alloc_retries=now[2] - before[2],
            cpu_s=now[3] - before[3],
            encoding=bool(before[5] or now[5] or now[4] != before[4]),
        )


class TimedPipeline:
    """A pipeline as the scheduler sees it, with each ``step`` timed (synchronised on CUDA, so a
    step's time is its own) and named by the call it runs. Everything else is the pipeline's."""

    def __init__(
        self,
        pipeline: Any,
        device: torch.device,
        record: Callable[[CallKey, float, Beside | None], None],
        probe: Probe | None = None,
    ) -> None:
        self._pipeline = pipeline
        self._device = device
        self._record = record
        self._probe = probe
        #: What happened beside the last step (with a probe).
        self.last_beside: Beside | None = None
        #: ``time.monotonic()`` at the start and end of the last step (the pipelines' clock).
        self.last_step: tuple[float, float] | None = None
        #: Whether the last step read part of a prompt (a new turn's prompt pass).
        self.last_read_prompt = False
        #: Seconds of every step so far.
        self.busy = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipeline, name)

    def step(self) -> list[tuple[str, Any]]:
        p = self._pipeline
        # Diffusion steps by call and rows; every speech step is one "tick" (all its sessions).
        call, rows = (p.next_call() or ("idle", 0)) if isinstance(p, DiffusionPipeline) else ("tick", 0)
        prompts = _prompt_passes(p)
        before = self._probe.snapshot() if self._probe is not None else None
        t0, m0 = time.perf_counter(), time.monotonic()
        out = p.step()
        _sync(self._device)
        seconds = time.perf_counter() - t0
        self.busy += seconds
        self.last_step = (m0, time.monotonic())
        if self._probe is not None and before is not None:
            self.last_beside = self._probe.since(before)
        passes = _prompt_passes(p) - prompts
        self.last_read_prompt = passes > 0
        if passes:  # a speech tick that read prompts: by the prompt passes it ran (each model's)
            call, rows = "tick with prompt passes", passes
        self._record((p.kind, call, rows), seconds, self.last_beside)
        return out


def _prompt_passes(pipeline: Any) -> int:
    """Prompt passes a speech pipeline has run (its ``*_prompt`` calls)."""
    return sum(n for (name, _), n in getattr(pipeline, "calls", {}).items() if name.endswith("_prompt"))


@dataclass
class Speaker(Session):
    """A session and the utterance it says each turn."""

    audio: np.ndarray | None = None


# -- diffusion load -----------------------------------------------------------------------------


@dataclass
class JobStream:
    """Keeps ``in_flight`` jobs of one diffusion pipeline going: a new one when one ends."""

    kind: str  # "image" or "video"
    pipeline: DiffusionPipeline
    make: Callable[[str, int], ImageRequest | VideoRequest]
    in_flight: int
    seq: int = 0
    submitted: dict[str, float] = field(default_factory=dict)  # request id -> submit time
    progressed: bool = False  # a denoising step was done in this phase

    def top_up(self, scheduler: Scheduler) -> None:
        while len(self.submitted) < self.in_flight:
            self.seq += 1
            request = self.make(f"{self.kind}-{self.seq}", self.seq)
            at = time.perf_counter()
            prepared = self.pipeline.prepare(request)
            if not scheduler.enqueue(self.pipeline.kind, request, prepared):
                raise RuntimeError(f"the {self.kind} queue is full")
            self.submitted[request.request_id] = at


def _partial_steps(phase: Phase, streams: list[JobStream], sign: int) -> None:
    """Counts the parts of the steps under way at a window's edge (``DiffusionPipeline.
    steps_done``): a step counts once its ``Progress`` arrives in the window, so the part of it run
    before the window starts comes off (``sign`` -1) and the part run before it ends goes on (+1).
    A Wan step is seconds: whole steps alone would count a 15 s window's video work to a third."""
    for stream in streams:
        for rid in stream.submitted:
            done = stream.pipeline.steps_done(rid)
            if done is not None:
                phase.steps[stream.kind] += sign * (done - math.floor(done))


def parse_size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a size is WIDTHxHEIGHT, got {text!r}") from None
    return width, height


def image_maker(args: argparse.Namespace) -> Callable[[str, int], ImageRequest]:
    width, height = args.image_size or (None, None)

    def make(rid: str, seq: int) -> ImageRequest:
        return ImageRequest(
            rid,
            "a lighthouse on a cliff at dusk, oil painting",
            n=args.image_n,
            width=width,
            height=height,
            num_inference_steps=args.image_steps,
            guidance_scale=args.image_guidance,
            seed=seq,
        )

    return make


def video_maker(args: argparse.Namespace) -> Callable[[str, int], VideoRequest]:
    width, height = args.video_size or (None, None)

    def make(rid: str, seq: int) -> VideoRequest:
        return VideoRequest(
            rid,
            "a red kite over a windy beach, slow pan",
            width=width,
            height=height,
            num_frames=args.video_frames,
            num_inference_steps=args.video_steps,
            guidance_scale=args.video_guidance,
            seed=seq,
        )

    return make


# -- one phase ------------------------------------------------------------------------------------


@dataclass
class Phase:
    name: str
    ramp_s: float | None = None  # None: the ramp did not complete
    window_s: float = 0.0
    #: Per speech step that made a talker frame: from when the step was due (its deadline, or at
    #: once) or began, whichever came first, to its end.
    frame_latency: list[float] = field(default_factory=list)
    #: The same for the steps that read no prompt (only frames of replies under way).
    frame_latency_plain: list[float] = field(default_factory=list)
    #: Wall time of the scheduler ticks that made a talker frame (the speech step and the batch
    #: steps after it in the same tick).
    frame_walls: list[float] = field(default_factory=list)
    first_audio: list[float] = field(default_factory=list)
    #: Each audio delta's lateness against its reply's real-time playback (0: in time).
    audio_late: list[float] = field(default_factory=list)
    #: Late deltas by their place in the reply: "second" (after the first chunk), "later", "last".
    late_places: Counter[str] = field(default_factory=Counter)
    turns_done: int = 0
    #: Denoising steps per kind in the window, with the parts of the steps under way at its edges.
    steps: Counter[str] = field(default_factory=Counter)
    finished: Counter[str] = field(default_factory=Counter)  # images / videos per kind
    job_s: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    calls: dict[CallKey, list[float]] = field(default_factory=lambda: defaultdict(list))
    errors: Counter[str] = field(default_factory=Counter)
    peak_gib: float | None = None
    #: Every step of the window: its call, its time and what happened beside it.
    beside: list[tuple[CallKey, float, Beside]] = field(default_factory=list)
    #: The engine loop's time in the window outside the steps: "between steps" (the host's own
    #: work in ticks that ran a step), "idle, diffusion waiting" (ticks that ran no step while
    #: image or video work waited: nothing fitted before the speech deadline), "idle" (no work).
    engine: Counter[str] = field(default_factory=Counter)

    def rate(self, counts: Counter[str], kind: str) -> float | None:
        return counts[kind] / self.window_s if self.window_s else None

    def frame_p(self, q: float) -> float | None:
        return float(np.percentile(self.frame_latency, q)) if self.frame_latency else None

    def plain_frame_p(self, q: float) -> float | None:
        plain = self.frame_latency_plain
        return float(np.percentile(plain, q)) if plain else None

    def tick_p(self, q: float) -> float | None:
        return float(np.percentile(self.frame_walls, q)) if self.frame_walls else None

    def first_audio_p(self, q: float) -> float | None:
        return float(np.percentile(self.first_audio, q)) if self.first_audio else None

    def late_p(self, q: float) -> float | None:
        return float(np.percentile(self.audio_late, q)) if self.audio_late else None

    @property
    def late_deltas(self) -> int:
        return sum(late > 0 for late in self.audio_late)


class Bench:
    def __init__(
        self,
        args: argparse.Namespace,
        speech: Any | None,
        streams: list[JobStream],
    ) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.speech = speech
        self.streams = streams
        self.phase: Phase | None = None  # the phase whose window is being measured
        #: Calls of the jobs run before the phases ("first job", "second job").
        self.warm_up: dict[str, dict[CallKey, list[float]]] = defaultdict(lambda: defaultdict(list))
        self.recording: dict[CallKey, list[float]] | None = None
        self.recording_beside: list[tuple[CallKey, float, Beside]] | None = None
        self.probe = Probe(self.device)
        pipelines: list[Pipeline[Any, Any]] = []
        self.timed_speech: TimedPipeline | None = None
        if speech is not None:
            self.counter = FrameCounter(speech)
            self.timed_speech = TimedPipeline(speech, self.device, self._record, self.probe)
            pipelines.append(self.timed_speech)  # type: ignore[arg-type]
        pipelines += [
            TimedPipeline(s.pipeline, self.device, self._record, self.probe)  # type: ignore[misc]
            for s in streams
        ]
        self.scheduler = Scheduler(pipelines)
        self.turn_seq = 0
        self._time_media_encoding()

    def _time_media_encoding(self) -> None:
        """Times the PNG and MP4 encoding of the results (on the CPU, in the runtime's encoding
        threads as the server runs them, beside the engine thread: ``MEDIA_WORKERS``): rows
        ``decode: png`` / ``decode: mp4`` of the call table, per image or video."""
        from omnirt.stages.diffusion import pipeline as runtime

        for name, kind in (("png", "image"), ("encode_mp4", "video")):
            original = getattr(runtime, name)

            def timed(*a: Any, _original: Callable[..., Any] = original, _kind: str = kind, **kw: Any) -> Any:
                t0 = time.perf_counter()
                self.probe.encode(+1)
                try:
                    result = _original(*a, **kw)
                finally:
                    self.probe.encode(-1)
                label = "decode: png" if _kind == "image" else "decode: mp4"
                self._record((_kind, label, 1), time.perf_counter() - t0)
                return result

            setattr(runtime, name, timed)

    def _record(self, key: CallKey, seconds: float, beside: Beside | None = None) -> None:
        if self.recording is not None:
            self.recording[key].append(seconds)
            if beside is not None and self.recording_beside is not None:
                self.recording_beside.append((key, seconds, beside))

    def _turn(self, session: Speaker) -> GenerationRequest:
        self.turn_seq += 1
        a = self.args
        parts = (AudioPart(session.audio), TextPart("Please answer briefly."))
        return GenerationRequest(
            request_id=f"s{session.index}-t{session.turns}",
            messages=[ContextMessage("user", parts)],
            output_audio=True,
            max_output_tokens=a.max_output_tokens,
            temperature=a.temperature,
            top_p=a.top_p,
            seed=self.turn_seq,
        )

    def first_jobs(self) -> dict[str, tuple[float, float]]:
        """Two jobs of each diffusion kind, one after the other, each alone: what the first request
        pays (lazy initialisation at request time) against the second. (first s, second s) by kind."""
        latency: dict[str, tuple[float, float]] = {}
        for stream in self.streams:
            wanted, times = stream.in_flight, []
            for label in ("first job", "second job"):
                self.recording = self.warm_up[label]
                stream.in_flight = 1
                stream.top_up(self.scheduler)
                stream.in_flight = 0
                while stream.submitted:
                    for rid, out in self.scheduler.tick():
                        if isinstance(out, Finished):
                            if out.reason == "error":
                                raise RuntimeError(f"{rid} failed: {out.error}")
                            times.append(time.perf_counter() - stream.submitted.pop(rid))
            latency[stream.kind] = (times[0], times[1])
            stream.in_flight = wanted
        self.recording = None
        return latency

    def run(self, name: str, speech: bool, diffusion: bool) -> Phase:
        args, scheduler = self.args, self.scheduler
        phase = Phase(name)
        n = args.sessions if speech and self.speech is not None else 0
        sessions = [
            Speaker(i, (i * args.ramp_ticks) // max(n, 1), audio=speechlike_tone(args.audio_seconds, seed=i))
            for i in range(n)
        ]
        owner: dict[str, Speaker] = {}
        streams = self.streams if diffusion else []
        stream_of: dict[str, JobStream] = {}
        for s in streams:
            s.progressed = False
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        if n:
            self.counter.take()
        begin = time.perf_counter()
        stage, window_start, window_end, tick = "ramp", 0.0, 0.0, 0
        playback: dict[str, tuple[float, float, int]] = {}  # reply -> (first audio at, seconds sent, deltas)
        resume: dict[int, float] = {}  # session -> when its next turn's prompt arrives
        last_late: dict[str, str] = {}  # reply -> place of its latest delta, while that one was late
        due = math.inf  # when the next speech step was first due (time.monotonic())
        timed = [p for p in self.scheduler.pipelines.values() if isinstance(p, TimedPipeline)]
        while True:
            now = time.perf_counter()
            if now - begin > args.phase_timeout:
                if stage == "window":
                    window_end = now
                    _partial_steps(phase, streams, +1)
                log.warning(
                    "%s: stopped at --phase-timeout %g s (in the %s)", name, args.phase_timeout, stage
                )
                break
            if stage == "window" and now - window_start >= args.seconds:
                stage, window_end, self.recording, self.recording_beside = "tail", now, None, None
                _partial_steps(phase, streams, +1)
            if stage == "tail" and not any(s.request_id and s.in_window and not s.heard for s in sessions):
                break
            for s in sessions:
                if stage != "tail" and s.request_id is None and tick >= s.start_tick and now >= resume.get(
                    s.index, 0.0
                ):
                    request = self._turn(s)
                    s.added_at = time.perf_counter()
                    prepared = self.speech.prepare(request)
                    if not scheduler.enqueue(self.speech.kind, request, prepared):
                        raise RuntimeError("the speech queue is full")
                    s.request_id, s.heard, s.in_window = request.request_id, False, stage == "window"
                    s.turns += 1
                    owner[request.request_id] = s
            for stream in streams:
                before = set(stream.submitted)
                stream.top_up(scheduler)
                stream_of.update(dict.fromkeys(set(stream.submitted) - before, stream))
            if n and self.speech.has_work():
                deadline = self.speech.next_deadline()
                due = min(due, time.monotonic() if deadline is None else deadline)
            stepped = self.timed_speech.last_step if n else None
            in_window, busy = stage == "window", sum(p.busy for p in timed)
            waiting = any(s.pipeline.has_work() for s in streams)
            t0 = time.perf_counter()
            outs: list[tuple[float, str, Any]] = []  # each output with when its step ended
            scheduler.tick(lambda rid, out, got=outs: got.append((time.perf_counter(), rid, out)))
            _sync(self.device)
            t1 = time.perf_counter()
            step = self.timed_speech.last_step if n else None
            latency = None
            if step is not None and step is not stepped:
                ready = stepped[1] if stepped is not None else -math.inf  # the step before it ended
                latency, due = step[1] - max(ready, min(step[0], due)), math.inf
            frames = 0
            for at, rid, out in outs:
                if (s := owner.get(rid)) is not None and s.request_id == rid:
                    if isinstance(out, AudioDelta):
                        frames += out.frames
                        start, played, index = playback.get(rid, (at, 0.0, 0))
                        late = max(0.0, at - (start + args.player_delay + played))
                        if not late:
                            last_late.pop(rid, None)
                        elif stage == "window":  # where in its reply: the second delta, a later one, the last
                            place = last_late[rid] = "second" if index == 1 else "later"
                            phase.late_places[place] += 1
                        if stage == "window":
                            phase.audio_late.append(late)
                        playback[rid] = (start, played + len(out.pcm) / SAMPLE_RATE, index + 1)
                        if not s.heard:
                            s.heard = s.ever_heard = True
                            if s.in_window:
                                phase.first_audio.append(at - s.added_at)
                    elif isinstance(out, Finished):
                        if (place := last_late.pop(rid, None)) is not None:  # its last delta was late
                            phase.late_places[place] -= 1
                            phase.late_places["last"] += 1
                        if out.reason == "error":
                            phase.errors[f"speech: {out.error}"] += 1
                        elif stage == "window":
                            phase.turns_done += 1
                        s.request_id = None
                        if not args.back_to_back:  # the reply is heard out, then the next question
                            start, played, _ = playback.get(rid, (at, 0.0, 0))
                            resume[s.index] = max(at, start + played) + args.audio_seconds
                elif (stream := stream_of.get(rid)) is not None:
                    self._diffusion_output(phase, stream, rid, out, stage == "window", at)
            if n:  # talker frames as speech_capacity counts them: at the vocoder, else audio deltas
                counted = sum(self.counter.take().values())
                if self.counter.exact and frames and not counted and not self.counter.ever:
                    self.counter.exact = False  # frames do not pass through vocoder.push
                self.counter.ever = self.counter.ever or bool(counted)
                frames = counted if self.counter.exact else frames
            if stage == "window" and frames:
                phase.frame_walls.append(t1 - t0)
                if latency is not None:
                    phase.frame_latency.append(latency)
                    if not self.timed_speech.last_read_prompt:  # type: ignore[union-attr]
                        phase.frame_latency_plain.append(latency)
            if stage == "ramp" and all(s.ever_heard for s in sessions) and all(s.progressed for s in streams):
                stage, window_start, phase.ramp_s = "window", t1, t1 - begin
                _partial_steps(phase, streams, -1)
                self.recording, self.recording_beside = phase.calls, phase.beside
            tick += 1
            if in_window:  # this iteration's time outside its steps
                stepped_s = sum(p.busy for p in timed) - busy
                gap = "between steps" if stepped_s else "idle, diffusion waiting" if waiting else "idle"
                phase.engine[gap] += time.perf_counter() - now - stepped_s
        self.recording = self.recording_beside = None
        phase.window_s = window_end - window_start if phase.ramp_s is not None else 0.0
        if self.device.type == "cuda":
            phase.peak_gib = torch.cuda.max_memory_allocated(self.device) / 2**30
        for rid in [*(s.request_id for s in sessions if s.request_id), *stream_of]:
            scheduler.cancel(rid)
        for stream in streams:
            stream.submitted.clear()
        return phase

    def _diffusion_output(
        self, phase: Phase, stream: JobStream, rid: str, out: Any, in_window: bool, now: float
    ) -> None:
        if isinstance(out, Progress):
            stream.progressed = True
            phase.steps[stream.kind] += in_window
        elif isinstance(out, GeneratedImage | GeneratedVideo):
            phase.finished[stream.kind] += in_window
        elif isinstance(out, Finished):
            submitted = stream.submitted.pop(rid, None)
            if out.reason == "error":
                phase.errors[f"{stream.kind}: {out.error}"] += 1
                if phase.errors[f"{stream.kind}: {out.error}"] > 3:
                    raise RuntimeError(f"{stream.kind} jobs keep failing: {out.error}")
            elif in_window and submitted is not None:
                phase.job_s[stream.kind].append(now - submitted)


# -- Z-Image DiT step alone ------------------------------------------------------------------------


@dataclass
class DitStep:
    width: int
    height: int
    dtype: str
    first_ms: float
    times_ms: list[float]
    gflop: float | None

    @property
    def median_ms(self) -> float:
        return float(np.median(self.times_ms))


@torch.no_grad()
def dit_step(pipeline: DiffusionPipeline, args: argparse.Namespace, device: torch.device) -> DitStep:
    """One Z-Image transformer call (branch ``cond``, batch 1) timed alone, as the runtime calls it."""
    den = pipeline.denoiser
    width, height = args.dit_size or (den.defaults.width, den.defaults.height)
    shape = den.check(ImageRequest("dit", "x", width=width, height=height))
    latents = den.init_latents(shape, [torch.Generator("cpu").manual_seed(0)])
    sampler = den.sampler(shape, den.defaults.num_inference_steps)
    cond = den.encode(["a lighthouse on a cliff at dusk, oil painting"])
    _sync(device)

    def once() -> float:
        t0 = time.perf_counter()
        den.predict(latents, 0, sampler, cond, "cond")
        _sync(device)
        return (time.perf_counter() - t0) * 1000

    first = once()
    times = [once() for _ in range(args.dit_iters)]
    gflop = None
    try:
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            den.predict(latents, 0, sampler, cond, "cond")
        gflop = counter.get_total_flops() / 1e9
    except Exception as exc:  # the count is a bonus: the timing stands without it
        log.warning("FLOP count failed: %s", exc)
    dtype = next((k for k, v in DTYPES.items() if v == den.dtype), str(den.dtype))
    return DitStep(width, height, dtype, first, times, gflop)


# -- reporting ----------------------------------------------------------------------------------


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def per_s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def change(alone: float | None, loaded: float | None) -> float | None:
    if alone is None or loaded is None or alone == 0:
        return None
    return loaded / alone - 1


def pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def phase_header(kinds: list[str]) -> str:
    cells = ["phase", "ramp (s)", "window (s)", "frame ticks", "frame p50 (ms)", "frame p99 (ms)"]
    cells += ["no-prompt frames", "no-prompt frame p99 (ms)", "tick p50 (ms)", "tick p99 (ms)"]
    cells += [
        "first audio p50 (ms)",
        "first audio p99 (ms)",
        "audio late p99 (ms)",
        "late deltas",
        "turns done",
    ]
    for kind in kinds:
        unit = "images" if kind == "image" else "video jobs"
        cells += [f"{unit}/s", f"{kind} steps/s", f"{kind} job p50 (s)"]
    cells.append("peak GPU mem (GiB)")
    return "| " + " | ".join(cells) + " |\n" + "|" + "---|" * len(cells)


def phase_row(p: Phase, kinds: list[str]) -> str:
    row = [
        p.name,
        f"{p.ramp_s:.1f}" if p.ramp_s is not None else "incomplete",
        f"{p.window_s:.1f}",
        str(len(p.frame_walls)),
        ms(p.frame_p(50)),
        ms(p.frame_p(99)),
        str(len(p.frame_latency_plain)),
        ms(p.plain_frame_p(99)),
        ms(p.tick_p(50)),
        ms(p.tick_p(99)),
        ms(p.first_audio_p(50)) + f" (n={len(p.first_audio)})",
        ms(p.first_audio_p(99)),
        ms(p.late_p(99)),
        f"{p.late_deltas} of {len(p.audio_late)}",
        str(p.turns_done),
    ]
    for kind in kinds:
        jobs = p.job_s.get(kind)
        row += [
            per_s(p.rate(p.finished, kind)),
            per_s(p.rate(p.steps, kind)),
            f"{np.median(jobs):.2f}" if jobs else "-",
        ]
    row.append(f"{p.peak_gib:.1f}" if p.peak_gib is not None else "-")
    return "| " + " | ".join(row) + " |"


def goals_table(by: dict[str, Phase], kinds: list[str]) -> tuple[str, dict[str, bool | None]]:
    alone_rt, alone_df, both = by.get("realtime alone"), by.get("diffusion alone"), by.get("both")
    lines = [
        "| measure | alone | with the other load | change | goal | met |",
        "|---|---|---|---|---|---|",
    ]
    met: dict[str, bool | None] = {}
    if alone_rt is not None and both is not None:
        for label, q, goal in (("frame p50 (ms)", 50, None), ("frame p99 (ms)", 99, P99_GROWTH_GOAL)):
            a, b = alone_rt.frame_p(q), both.frame_p(q)
            c = change(a, b)
            ok = None if goal is None or c is None else c <= goal
            if goal is not None:
                met["realtime p99"] = ok
            lines.append(
                f"| realtime {label} | {ms(a)} | {ms(b)} | {pct(c)} | "
                + (f"<= +{goal:.0%}" if goal is not None else "-")
                + f" | {'-' if ok is None else 'yes' if ok else 'no'} |"
            )
        a, b = alone_rt.plain_frame_p(99), both.plain_frame_p(99)
        lines.append(
            f"| realtime frame p99, steps reading no prompt (ms) | {ms(a)} | {ms(b)} | {pct(change(a, b))} "
            "| - | - |"
        )
        for label in (*OTHER_TICKS.values(), PER_FRAME):
            other_rt, other_both = (by.get(f"{n}, {label}") for n in ("realtime alone", "both"))
            if other_rt is not None and other_both is not None:
                a, b = other_rt.frame_p(99), other_both.frame_p(99)
                lines.append(
                    f"| realtime frame p99, {label} (ms) | {ms(a)} | {ms(b)} | {pct(change(a, b))} | - | - |"
                )
                late_a, late_b = other_rt.late_deltas, other_both.late_deltas
                lines.append(
                    f"| realtime late deltas, {label} | {late_a} of {len(other_rt.audio_late)} | "
                    f"{late_b} of {len(other_both.audio_late)} | - | - | - |"
                )
        for q in (50, 99):
            a, b = alone_rt.first_audio_p(q), both.first_audio_p(q)
            lines.append(
                f"| realtime first audio p{q} (ms) | {ms(a)} | {ms(b)} | {pct(change(a, b))} | - | - |"
            )
        a, b = alone_rt.late_p(99), both.late_p(99)
        lines.append(f"| realtime audio late p99 (ms) | {ms(a)} | {ms(b)} | - | - | - |")
        lines.append(
            f"| realtime late deltas | {alone_rt.late_deltas} of {len(alone_rt.audio_late)} | "
            f"{both.late_deltas} of {len(both.audio_late)} | - | - | - |"
        )
        lines.append(
            f"| realtime late deltas: second / later / last of a reply | {_places(alone_rt)} | "
            f"{_places(both)} | - | - | - |"
        )
    if alone_df is not None and both is not None:
        losses: list[bool] = []
        for kind in kinds:
            unit = "images" if kind == "image" else "video jobs"
            a, b = alone_df.rate(alone_df.steps, kind), both.rate(both.steps, kind)
            c = change(a, b)
            ok = None if c is None else -c <= THROUGHPUT_LOSS_GOAL
            if ok is not None:
                losses.append(ok)
            lines.append(
                f"| {kind} denoising steps/s | {per_s(a)} | {per_s(b)} | {pct(c)} | "
                f">= -{THROUGHPUT_LOSS_GOAL:.0%} | {'-' if ok is None else 'yes' if ok else 'no'} |"
            )
            a, b = alone_df.rate(alone_df.finished, kind), both.rate(both.finished, kind)
            lines.append(f"| {unit}/s | {per_s(a)} | {per_s(b)} | {pct(change(a, b))} | - | - |")
            other = by.get(f"both, {PER_FRAME}")
            if other is not None:
                a, b = alone_df.rate(alone_df.steps, kind), other.rate(other.steps, kind)
                lines.append(
                    f"| {kind} denoising steps/s, {PER_FRAME} | {per_s(a)} | {per_s(b)} | "
                    f"{pct(change(a, b))} | - | - |"
                )
        met["diffusion throughput"] = all(losses) if losses else None
    return "\n".join(lines), met


def _places(p: Phase) -> str:
    return " / ".join(str(p.late_places[k]) for k in ("second", "later", "last"))


def calls_table(phases: list[Phase], warm_up: dict[str, dict[CallKey, list[float]]]) -> str:
    lines = [
        "| phase | pipeline | call | rows (speech: prompt passes) | calls | p50 (ms) | p99 (ms) | max (ms) | "
        "p50 / 80 ms frame |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    sources = [*warm_up.items(), *((p.name, p.calls) for p in phases)]
    for name, calls in sources:
        for (kind, call, rows), times in sorted(calls.items()):
            p50 = float(np.percentile(times, 50))
            lines.append(
                f"| {name} | {kind} | {call} | {rows if kind != 'speech' or rows else '-'} | {len(times)} | "
                f"{p50 * 1000:.1f} | "
                f"{np.percentile(times, 99) * 1000:.1f} | {max(times) * 1000:.1f} | "
                f"{p50 / FRAME_SECONDS:.2f}x |"
            )
    return "\n".join(lines)


def beside_table(phases: list[Phase]) -> str:
    """The window's steps by pipeline, by kind of step (speech: with or without prompt passes;
    diffusion: every call) and by whether a PNG or MP4 was being encoded during them: their
    times, the engine thread's CPU time in them, garbage-collector pauses and ``cudaMalloc`` calls
    and allocator retries inside them."""
    lines = [
        "| phase | pipeline | steps | beside an encode | n | p50 / p99 / max (ms) | "
        "engine CPU p50 / p99 (ms) | with a GC pause: n, total / max (ms) | cudaMalloc calls | "
        "allocator retries |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in phases:
        groups: dict[tuple[str, str, bool], list[tuple[float, Beside]]] = defaultdict(list)
        for (kind, call, _), seconds, beside in p.beside:
            steps = call if kind == "speech" else "every call"
            groups[kind, steps, beside.encoding].append((seconds, beside))
        for (kind, steps, encoding), rows in sorted(groups.items()):
            t = np.array([r[0] for r in rows]) * 1000
            cpu = np.array([r[1].cpu_s for r in rows]) * 1000
            gcs = [r[1].gc_s * 1000 for r in rows if r[1].gc_s > 0]
            lines.append(
                f"| {p.name} | {kind} | {steps} | {'yes' if encoding else 'no'} | {len(rows)} | "
                f"{np.percentile(t, 50):.1f} / {np.percentile(t, 99):.1f} / {t.max():.1f} | "
                f"{np.percentile(cpu, 50):.1f} / {np.percentile(cpu, 99):.1f} | "
                f"{len(gcs)}, {sum(gcs):.1f} / {max(gcs, default=0.0):.1f} | "
                f"{sum(r[1].device_allocs for r in rows)} | {sum(r[1].alloc_retries for r in rows)} |"
            )
    return "\n".join(lines)


def diffusion_calls(phases: list[Phase]) -> dict[CallKey, list[float]]:
    """Every diffusion step's time over the measured windows, by call (the encoding sub-rows left
    out: they are part of their decode call)."""
    merged: dict[CallKey, list[float]] = defaultdict(list)
    for p in phases:
        for key, times in p.calls.items():
            if key[0] != "speech" and not _on_media_thread(key[1]):
                merged[key] += times
    return merged


def _on_media_thread(call: str) -> bool:
    """A call-table row of PNG / MP4 encoding (``decode: png``), timed on the media threads."""
    return ":" in call


#: Columns of the engine-time table: the steps' share by what they ran, then the loop's own.
ENGINE_COLUMNS = (
    "speech frame ticks",
    "speech ticks with prompt passes",
    "image steps",
    "video steps",
    "between steps",
    "idle, diffusion waiting",
    "idle",
)


def engine_table(phases: list[Phase]) -> str:
    """Where each window's time went on the engine thread: its steps by what they ran (each
    synchronised, so GPU time included), the host's work between steps in the same ticks, and
    ticks that ran no step (with image or video work waiting: no piece fitted before the speech
    deadline), in seconds and shares of the window."""
    lines = [
        "| phase | window (s) | " + " | ".join(ENGINE_COLUMNS) + " |",
        "|---|---|" + "---|" * len(ENGINE_COLUMNS),
    ]
    for p in phases:
        if not p.window_s:
            continue
        spent: Counter[str] = Counter(p.engine)
        for (kind, call, _), times in p.calls.items():
            if _on_media_thread(call):  # beside the engine
                continue
            if kind == "speech":
                column = "speech frame ticks" if call == "tick" else "speech ticks with prompt passes"
            else:
                column = f"{kind} steps"
            spent[column] += sum(times)
        cells = [f"{spent[c]:.2f} ({spent[c] / p.window_s:.0%})" if spent[c] else "-" for c in ENGINE_COLUMNS]
        lines.append(f"| {p.name} | {p.window_s:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def budget_lines(phases: list[Phase]) -> list[str]:
    merged = diffusion_calls(phases)
    if not merged:
        return []
    p50 = {key: float(np.median(times)) for key, times in merged.items()}
    (kind, call, rows), worst = max(p50.items(), key=lambda kv: kv[1])
    over = [
        f"{k} {c} x{r}" for (k, c, r), v in sorted(p50.items(), key=lambda kv: -kv[1]) if v > FRAME_SECONDS
    ]
    return [
        f"- largest diffusion call: {kind} {call} x{rows}, p50 {worst * 1000:.1f} ms "
        f"(max {max(merged[kind, call, rows]) * 1000:.1f}) = {worst / FRAME_SECONDS:.1f}x "
        "the 80 ms frame budget",
        "- calls with p50 over the budget (a realtime frame waits behind each): "
        + (", ".join(over) if over else "none"),
    ]


def warm_up_lines(bench: Bench, jobs: dict[str, tuple[float, float]], builds: dict[str, float]) -> list[str]:
    lines = []
    for stream in bench.streams:
        p, den = stream.pipeline, stream.pipeline.denoiser
        has = callable(getattr(p, "warm_up", None)) or callable(getattr(den, "warm_up", None))
        compiled = hasattr(getattr(den, "transformer", None), "_orig_mod")
        first, second = jobs[stream.kind]
        calls = {
            label: [
                t
                for (k, c, _), ts in bench.warm_up[label].items()
                if k == stream.kind and c == "cond"
                for t in ts
            ]
            for label in ("first job", "second job")
        }
        lines.append(
            f"- {stream.kind} ({p.info.id}): built in {builds[stream.kind]:.1f} s; "
            + ("warmed up at start-up; " if has else "no warm-up at start-up; ")
            + f"transformer {'under torch.compile' if compiled else 'eager (no torch.compile)'}; "
            f"first job alone (request time) {first:.2f} s, second {second:.2f} s ({first / second:.2f}x)"
            + (
                f"; first transformer call {calls['first job'][0] * 1000:.1f} ms, the second job's p50 "
                f"{np.median(calls['second job']) * 1000:.1f} ms"
                if calls["first job"] and calls["second job"]
                else ""
            )
        )
    return lines


def dit_lines(dit: DitStep, device: torch.device, peak_tflops: float) -> list[str]:
    med = dit.median_ms
    lines = [
        f"- Z-Image DiT step at {dit.width}x{dit.height}, batch 1, {dit.dtype}, {device.type}: "
        f"median {med:.1f} ms over {len(dit.times_ms)} calls (min {min(dit.times_ms):.1f}, "
        f"first of this benchmark's calls {dit.first_ms:.1f} ms)"
    ]
    if dit.gflop is not None and device.type == "cuda":
        floor = dit.gflop / peak_tflops  # GFLOP / (TFLOP/s) = ms
        lines.append(
            f"- counted {dit.gflop / 1e3:.1f} TFLOP per call (torch.utils.flop_counter): compute floor "
            f"{floor:.1f} ms at {peak_tflops:g} TFLOP/s; measured {med / floor:.2f}x that floor"
        )
    elif dit.gflop is not None:
        rate = dit.gflop / med * 1000
        lines.append(f"- counted {dit.gflop:.2f} GFLOP per call: {rate:.1f} GFLOP/s on this CPU")
    if device.type == "cuda":
        ok = med <= DIT_GOAL_MS
        lines.append(
            f"- against the issue's floor ~{DIT_FLOOR_MS:g} ms: {med / DIT_FLOOR_MS:.2f}x; "
            f"goal <= {DIT_GOAL_MS:g} ms "
            f"(1.1x the floor): {'yes' if ok else 'no'}"
            + ("" if (dit.width, dit.height) == (1024, 1024) else " (the goal is for 1024x1024)")
        )
    else:
        lines.append(f"- (the {DIT_GOAL_MS:g} ms goal is for the H200 at 1024x1024; not checked on CPU)")
    return lines


# -- main -----------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--speech-model", default=None, help="speech checkpoint or config folder; default: the embedded demo")
    add(
        "--image-model",
        default=None,
        help="Z-Image diffusers folder or components file; default: embedded; none",
    )
    add(
        "--video-model", default=None, help="Wan diffusers folder or components file; default: embedded; none"
    )
    add("--video-variant", default=None, help="transformer of a components file, e.g. 1.3b or 14b")
    add("--load-format", choices=("auto", "dummy"), default="auto")
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add(
        "--dtype",
        choices=("auto", *DTYPES),
        default="auto",
        help="speech model; auto: bf16 on CUDA, fp32 on CPU",
    )
    add("--max-context", type=int, default=1024, help="thinker tokens per session (KV slots)")
    add("--sessions", type=int, default=4, help="sessions speaking in turns (0: no realtime load)")
    add("--audio-seconds", type=float, default=1.0, help="input audio per turn")
    add("--max-output-tokens", type=int, default=16, help="thinker tokens per reply")
    add("--max-audio-frames", type=int, default=64, help="talker frames per reply (80 ms each)")
    add("--temperature", type=float, default=0.7)
    add("--top-p", type=float, default=0.9)
    add("--ramp-ticks", type=int, default=16, help="ticks over which first turns start")
    add(
        "--player-delay",
        type=float,
        default=0.2,
        help="the listener's player starts this many seconds after a reply's first audio (a jitter "
        "buffer, as benchmarks/scale.py's): audio late = after that playback needed it",
    )
    add(
        "--back-to-back",
        action="store_true",
        help="a session's next turn starts as soon as its reply is made (default: once the reply has "
        "played and the next question has been spoken, --audio-seconds)",
    )
    add(
        "--first-audio-targets",
        nargs="+",
        default=["0.25"],
        metavar="SECONDS|none",
        help="the speech pipeline's first_audio_target for the 'both' phase; more than one: a 'both' phase "
        "per target (the first one is checked against the goals). none: at once, every other tick",
    )
    add(
        "--batch-slices",
        nargs="+",
        default=["none"],
        metavar="SECONDS|none",
        help="the scheduler's batch_slice (longest diffusion piece while speech is active) for the 'both' "
        "phase; more than one: a further 'both' phase per value (with the first first-audio target). "
        "none: the pipelines' own piece size (pieces still fitted to the time before a deadline)",
    )
    add(
        "--prompt-ticks",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the speech pipeline reads prompts in ticks of their own while replies make frames "
        "(the server's default; --no-prompt-ticks: in the frame ticks, as omnirt serve --no-prompt-ticks)",
    )
    add(
        "--compare-prompt-ticks",
        action="store_true",
        help="also 'realtime alone' and 'both' with the other --prompt-ticks setting",
    )
    add(
        "--compare-vocoder-steps",
        action="store_true",
        help="also 'realtime alone' and 'both' with the vocoder as before 2026-12-05 (a one-frame step "
        "at every tick, the audio handed out by the same chunks) instead of a step once a chunk",
    )
    add("--image-size", type=parse_size, default=None, help="WxH; default: the model's")
    add("--image-steps", type=int, default=None, help="default: the model's")
    add("--image-n", type=int, default=1, help="images per image job")
    add("--image-guidance", type=float, default=None, help="default: the model's")
    add("--image-jobs", type=int, default=1, help="image jobs kept in flight")
    add("--video-size", type=parse_size, default=None, help="WxH; default: the model's")
    add("--video-frames", type=int, default=None, help="default: the model's")
    add("--video-steps", type=int, default=None, help="default: the model's")
    add("--video-guidance", type=float, default=None, help="default: the model's")
    add("--video-jobs", type=int, default=1, help="video jobs kept in flight")
    add("--max-rows", type=int, default=8, help="rows (images, videos) each diffusion pipeline admits")
    add("--seconds", type=float, default=20.0, help="measured window per phase")
    add("--phase-timeout", type=float, default=120.0, help="hard limit per phase (s)")
    add(
        "--time-budget", type=float, default=0.0, help="skip what could end after this many seconds (0: none)"
    )
    add("--dit-size", type=parse_size, default=None, help="WxH of the DiT step alone; default: the model's")
    add("--dit-iters", type=int, default=5, help="timed DiT calls (0: skip)")
    add("--threads", type=int, default=0, help="torch CPU threads (0: as the server sets them)")
    add("--peak-tflops", type=float, default=989.0, help="dense bf16 peak for the floor (H200 SXM: 989)")
    add("--save", type=Path, default=None, help="also write each phase's measures here (JSON), for --pool")
    add(
        "--pool", type=Path, nargs="+", default=None,
        help="run nothing: the goals and the engine's time of several --save files' phases together",
    )
    args = parser.parse_args(argv)
    try:
        args.first_audio_targets = [
            None if t == "none" else float(t) for t in args.first_audio_targets
        ]
    except ValueError:
        parser.error("--first-audio-targets takes seconds or none")
    try:
        args.batch_slices = [None if t == "none" else float(t) for t in args.batch_slices]
    except ValueError:
        parser.error("--batch-slices takes seconds or none")
    if any(t is not None and not t > 0 for t in args.batch_slices):
        parser.error("--batch-slices must be positive")
    if args.sessions < 0 or args.image_jobs < 0 or args.video_jobs < 0 or args.image_n < 1:
        parser.error("--sessions, --image-jobs and --video-jobs must be >= 0, --image-n >= 1")
    return args


def build_diffusion(args: argparse.Namespace) -> tuple[list[JobStream], dict[str, float]]:
    from omnirt.stages.diffusion.factory import (
        MEDIA_WORKERS,
        WAN_DEMO_ID,
        build_image_pipeline,
        diffusion_family,
    )
    from omnirt.stages.diffusion.wan_demo import ensure_wan_demo
    from omnirt.stages.diffusion.wan_loader import load_wan

    streams, builds = [], {}
    if args.image_model != "none" and args.image_jobs:
        start = time.perf_counter()
        image = build_image_pipeline(
            args.image_model, device=args.device, load_format=args.load_format, max_rows=args.max_rows
        )
        _sync(torch.device(args.device))
        builds["image"] = time.perf_counter() - start
        streams.append(JobStream("image", image, image_maker(args), args.image_jobs))
    if args.video_model != "none" and args.video_jobs:
        start = time.perf_counter()
        if args.video_model in (None, "demo"):
            denoiser = load_wan(ensure_wan_demo(), device=args.device, model_id=WAN_DEMO_ID)
        else:
            path = Path(args.video_model).expanduser()
            if diffusion_family(path) != "wan":
                raise SystemExit(f"--video-model {args.video_model}: not a Wan pipeline")
            denoiser = load_wan(
                path,
                device=args.device,
                load_format=args.load_format,
                variant=args.video_variant,
            )
        video = DiffusionPipeline(denoiser, max_rows=args.max_rows, media_workers=MEDIA_WORKERS)
        video.warm_up()  # as the server's factory does
        _sync(torch.device(args.device))
        builds["video"] = time.perf_counter() - start
        streams.append(JobStream("video", video, video_maker(args), args.video_jobs))
    for stream in streams:  # bad settings fail here, before any phase
        try:
            stream.pipeline.prepare(stream.make("check", 0))
        except RequestRejected as exc:
            raise SystemExit(f"the {stream.kind} job settings are refused: {exc}") from None
    return streams, builds


def describe_job(stream: JobStream) -> str:
    prep = stream.pipeline.prepare(stream.make("describe", 0))
    s = prep.shape
    what = f"{s.width}x{s.height}" + (
        f", {s.frames} frames" if stream.kind == "video" else f", n={prep.rows}"
    )
    return (
        f"{stream.kind} jobs ({stream.pipeline.info.id}, {stream.pipeline.denoiser.dtype}): {what}, "
        f"{prep.steps} steps, guidance {prep.guidance_scale:g} "
        f"({'cond + uncond' if prep.guided else 'cond only'}), "
        f"{stream.in_flight} in flight"
    )


def _ms(seconds: float | None) -> str:
    return "none" if seconds is None else f"{seconds * 1000:g} ms"


#: The measures a ``--save`` file keeps of a phase: lists pooled, counters and seconds summed.
_LISTS = ("frame_latency", "frame_latency_plain", "frame_walls", "first_audio", "audio_late")
_COUNTERS = ("late_places", "steps", "finished", "errors", "engine")


def save(phases: list[Phase], kinds: list[str], path: Path) -> None:
    """Each phase's measures (:data:`_LISTS`, :data:`_COUNTERS`, the window, turns and each call's
    step times), for :func:`pool`."""
    records = [
        {
            "name": p.name, "window_s": p.window_s, "turns_done": p.turns_done,
            **{key: list(getattr(p, key)) for key in _LISTS},
            **{key: dict(getattr(p, key)) for key in _COUNTERS},
            "calls": [[*key, times] for key, times in p.calls.items()],
        }
        for p in phases
        if p.ramp_s is not None
    ]  # fmt: skip
    path.write_text(json.dumps({"kinds": kinds, "phases": records}))


def pool(paths: list[Path]) -> tuple[list[Phase], list[str]]:
    """The phases of several :func:`save` files merged by name, in first-seen order, and the kinds
    of diffusion job any of them ran."""
    by: dict[str, Phase] = {}
    kinds: list[str] = []
    for path in paths:
        data = json.loads(path.read_text())
        kinds += [k for k in data["kinds"] if k not in kinds]
        for record in data["phases"]:
            p = by.setdefault(record["name"], Phase(record["name"], ramp_s=0.0))
            p.window_s += record["window_s"]
            p.turns_done += record["turns_done"]
            for key in _LISTS:
                getattr(p, key).extend(record[key])
            for key in _COUNTERS:
                getattr(p, key).update(record[key])
            for kind, call, rows, times in record["calls"]:
                p.calls[kind, call, rows].extend(times)
    return list(by.values()), kinds


def print_pooled(paths: list[Path]) -> None:
    phases, kinds = pool(paths)
    print(f"# Realtime speech with diffusion: {len(paths)} runs together\n")
    for p in phases:
        print(f"- {p.name}: {p.window_s:.1f} s of windows, {len(p.frame_latency)} frames, "
              f"{p.turns_done} turns, steps {dict(p.steps)}")
    goals, met = goals_table({p.name: p for p in phases}, kinds)
    print("\n## Against the alone baselines, pooled\n")
    print(goals)
    print()
    for label, ok in met.items():
        print(f"- goal {label}: {'-' if ok is None else 'yes' if ok else 'no'}")
    print("\n## Where the engine's time went, pooled\n")
    print(engine_table(phases))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.pool:
        print_pooled(args.pool)
        return 0
    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    started = time.perf_counter()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    speech, startup = None, None
    if args.sessions:
        speech_args = argparse.Namespace(**vars(args), model=args.speech_model)
        speech, startup = build(speech_args, max_slots=args.sessions)
    streams, builds = build_diffusion(args)
    if speech is None and not streams:
        raise SystemExit("nothing to run: no sessions and no diffusion jobs")
    if not args.threads:  # as the server sets them (one on CUDA)
        configure_host_threads([p for p in (speech, *(s.pipeline for s in streams)) if p is not None])
    gc.collect()
    gc.freeze()  # as the server does after start-up
    kinds = [s.kind for s in streams]
    bench = Bench(args, speech, streams)

    print("# Realtime speech with diffusion\n")
    if speech is not None:
        assert isinstance(startup, Startup)
        info = speech.info
        print(
            f"- speech: {info.id} ({'RANDOM WEIGHTS' if info.random_weights else 'checkpoint weights'}, "
            f"{speech.dtype}, {device}); load {startup.load_s:.1f} s + warm-up {startup.warm_up_s:.1f} s; "
            f"{args.sessions} sessions speaking in turns ({args.audio_seconds:g} s of audio in, up to "
            f"{args.max_output_tokens} thinker tokens and {args.max_audio_frames} talker frames out; "
            + (
                "the next turn as soon as the reply is made)"
                if args.back_to_back
                else f"the next turn once the reply has played and {args.audio_seconds:g} s more, the next "
                "question spoken)"
            )
        )
        targets = ", ".join(_ms(t) for t in args.first_audio_targets)
        print(f"- the speech pipeline's first-audio target (phase 'both' and after): {targets}")
        slices = ", ".join(_ms(t) for t in args.batch_slices)
        print(f"- the scheduler's batch slice (phase 'both' and after): {slices}")
        if hasattr(speech, "prompt_ticks"):
            print(
                "- prompt passes in ticks of their own while replies make frames: "
                + ("yes" if args.prompt_ticks else "no (in the frame ticks)")
            )
    for stream in streams:
        print(f"- {describe_job(stream)}")
    print(
        f"- each phase: ramp, {args.seconds:g} s measured, tail (limit {args.phase_timeout:g} s); one "
        "scheduler: the speech step when due, then the diffusion steps (image and video in turn) that fit "
        "before the speech pipeline's next deadline; "
        f"{torch.get_num_threads()} torch CPU threads"
    )
    first_jobs = bench.first_jobs()
    print("\n## Phases\n")
    print(phase_header(kinds), flush=True)
    phases: list[Phase] = []
    first_target, first_slice = args.first_audio_targets[0], args.batch_slices[0]
    ticks = args.prompt_ticks if hasattr(speech, "prompt_ticks") else None
    # (name, speech, diffusion, first-audio target, batch slice, prompt ticks, vocoder a step a frame)
    plan: list[tuple[str, bool, bool, float | None, float | None, bool | None, bool]] = [
        ("realtime alone", True, False, first_target, first_slice, ticks, False),
        ("diffusion alone", False, True, first_target, first_slice, ticks, False),
        ("both", True, True, first_target, first_slice, ticks, False),
    ]
    for target in args.first_audio_targets[1:]:
        label = f"both, first-audio target {_ms(target)}"
        plan.append((label, True, True, target, first_slice, ticks, False))
    for batch_slice in args.batch_slices[1:]:
        plan.append(
            (f"both, batch slice {_ms(batch_slice)}", True, True, first_target, batch_slice, ticks, False)
        )
    if args.compare_prompt_ticks and ticks is not None:
        for name, diffusion in (("realtime alone", False), ("both", True)):
            label = f"{name}, {OTHER_TICKS[not ticks]}"
            plan.append((label, True, diffusion, first_target, first_slice, not ticks, False))
    per_frame = PerFrameVocoder(speech) if args.compare_vocoder_steps and speech is not None else None
    if per_frame is not None and per_frame.applies:
        for name, diffusion in (("realtime alone", False), ("both", True)):
            plan.append((f"{name}, {PER_FRAME}", True, diffusion, first_target, first_slice, ticks, True))
    skipped = []
    for name, with_speech, with_diffusion, target, batch_slice, prompt_ticks, frame_steps in plan:
        if (with_speech and speech is None) or (with_diffusion and not streams):
            continue
        elapsed = time.perf_counter() - started
        if args.time_budget and elapsed + args.phase_timeout > args.time_budget:
            skipped.append(name)
            continue
        if speech is not None and hasattr(speech, "first_audio_target"):
            speech.first_audio_target = target
        if prompt_ticks is not None:
            speech.prompt_ticks = prompt_ticks
        if per_frame is not None:
            per_frame.set(frame_steps)
        bench.scheduler.batch_slice = batch_slice
        phases.append(bench.run(name, with_speech, with_diffusion))
        print(phase_row(phases[-1], kinds), flush=True)
    by = {p.name: p for p in phases}
    for name in skipped:
        print(f"\n(phase {name!r} skipped: --time-budget {args.time_budget:g} s would be exceeded)")
    for p in phases:
        for error, count in p.errors.items():
            print(f"\n(errors in {p.name}: {error} x{count})")
    if args.save:
        save(phases, kinds, args.save)
    goals, met = goals_table(by, kinds)
    print("\n## Against the alone baselines of this run\n")
    print(goals)
    print()
    for label, ok in met.items():
        print(f"- goal {label}: {'-' if ok is None else 'yes' if ok else 'no'}")

    print("\n## Step times per pipeline call\n")
    print(calls_table(phases, bench.warm_up))
    print()
    for line in budget_lines(phases):
        print(line)

    print("\n## Where the engine's time went\n")
    print(engine_table(phases))

    print("\n## What ran beside each step\n")
    print(beside_table(phases))
    bench.probe.close()

    print("\n## Start-up and request-time warm-up\n")
    for line in warm_up_lines(bench, first_jobs, builds):
        print(line)
    image = next((s.pipeline for s in streams if s.kind == "image"), None)
    if image is not None and args.dit_iters and getattr(image.denoiser, "family", "") == "z-image":
        if args.time_budget and time.perf_counter() - started > args.time_budget:
            print("\n(DiT step skipped: --time-budget exceeded)")
        else:
            print("\n## Z-Image DiT step alone\n")
            for line in dit_lines(dit_step(image, args, device), device, args.peak_tflops):
                print(line)
    print(f"\n(total {time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
