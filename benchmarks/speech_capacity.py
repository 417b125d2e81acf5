"""Speech capacity: how many sessions can speak at once in real time, driving the pipeline directly.

Builds the speech pipeline once (``--model DIR --load-format dummy`` for the real-size model with
random weights, a checkpoint folder, or the embedded demo), then for each session count N keeps
N sessions speaking at once: each session sends an audio turn (``--audio-seconds`` of a
speech-like tone, ``output_audio=True``, replies capped at ``--max-output-tokens`` thinker tokens
and ``--max-audio-frames`` talker frames) and starts its next turn as soon as one finishes, so N
turns are always in flight. Each turn is a new utterance; with ``--history K`` a session's
turns form conversations of K + 1 turns (each prompt holds the conversation so far: the earlier
utterances and the replies' text), else each turn is a conversation of its own. First turns
are staggered over ``--ramp-ticks`` ticks. Everything runs in this process through the
``Pipeline`` protocol (``add`` / ``step`` / ``has_work``): no server, no engine thread.

A tick is one round of the loop: admitting new turns, then ``pipeline.step()`` (on CUDA timed
with ``torch.cuda.synchronize()`` before reading the clock). Measuring starts once every
session has heard audio (the ramp) and lasts ``--seconds``; a level ends after
``--level-timeout`` seconds in all even if its ramp never completed. Per level:

- **frame p50/p99**: wall time of the ticks in which a talker frame was produced (all stages of
  the tick: admission, prefill, thinker, talker, code predictor, code2wav), against the 80 ms of
  audio a frame holds; a turn's ``prepare`` (tokens, audio features) runs before the tick, as
  the server runs it on its prompt threads, and counts in the turn's first audio (making the
  turn's request, the client's audio, counts in neither);
- **frames/tick**: talker frames per such tick (counted at the vocoder's ``push``, where each
  talker frame goes; audio-delta frames if the pipeline has no such vocoder);
- **RTF p50/p99 over sessions**: per session, wall time of the ticks in which it got a frame
  divided by 80 ms per frame it got (below 1: faster than real time);
- **first audio p50/p99**: from just before ``prepare`` and ``add`` to the end of the tick that returned the
  turn's first ``AudioDelta`` (turns started inside the measured window only);
- **peak GPU memory** (``torch.cuda.max_memory_allocated`` over the level);
- at the end, the largest N whose p99 frame time is under 80 ms, per mode, and the host time of
  a tick by phase of the step (the pipeline's ``phases``, when it keeps them): which phase holds
  the host, launching or waiting for the device at a sync.

Modes: when the pipeline has ``use_graphs(enabled)``, each level runs with CUDA graphs and
eagerly (``--modes graphs eager``), and ``whole``: graphs with the prompt prefix cache
off (``use_prefix_cache(False)``: every prompt read whole); otherwise it runs once in the
pipeline's own mode and the table says so. ``--profile N`` profiles ``--profile-ticks``
ticks at N sessions with ``torch.profiler`` and prints the GPU busy share of the tick wall
time (union of kernel and copy intervals / tick wall; the profiler slows the host, which lowers
it, so the GPU time a tick is also given as a share of the same level's unprofiled tick, when
the run measured that level), the GPU time of the work
each phase of the step launched (the pipeline's ``phases``, as profiler ranges), and the top
kernels.

``--host-profile N`` runs the level of N sessions once more under ``cProfile`` and prints the
functions that hold the host longest per tick (where a host-bound phase spends its time).
``--slots`` plans more slots than the largest level (spare slots keep the prompts of ended
turns for reuse, as a server's do).

On the H200, real size (``--model`` takes the published config file itself, or a folder holding
it as ``config.json``), bf16; ``--time-budget`` skips the levels that might not end within it
(each level can take up to ``--level-timeout`` seconds)::

    python benchmarks/speech_capacity.py --load-format dummy \\
        --model benchmarks/models/qwen3-omni-30b-a3b-instruct \\
        --sessions 1 8 32 64 128 256 --seconds 10 --profile 128 --time-budget 480

Checked on CPU with the demo model::

    python benchmarks/speech_capacity.py --device cpu --sessions 1 2 --seconds 5
"""

from __future__ import annotations

import argparse
import bisect
import gc
import logging
import re
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omnirt.stages.types import (
    SAMPLE_RATE,
    AudioDelta,
    AudioPart,
    ContextMessage,
    Finished,
    GenerationRequest,
    TextDelta,
    TextPart,
)

log = logging.getLogger("speech_capacity")

FRAME_SECONDS = 0.08  # audio in one talker frame (12.5 Hz)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# -- set-up ------------------------------------------------------------------------------------------


def speechlike_tone(seconds: float, seed: int) -> np.ndarray:
    """A voice-like harmonic tone with a syllable envelope and a little noise (float32, 24 kHz)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    pitch = 110 + 60 * rng.random()
    voice = sum(np.sin(2 * np.pi * pitch * k * t) / k for k in range(1, 6))
    envelope = 0.5 * (1 - np.cos(2 * np.pi * 4 * t))
    noise = 0.02 * rng.standard_normal(t.shape[0])
    return (0.25 * voice * envelope + noise).astype(np.float32)


@dataclass
class Startup:
    load_s: float
    warm_up_s: float
    weights_gib: float | None


def build(args: argparse.Namespace, max_slots: int) -> tuple[Any, Startup]:
    from omnirt.stages.speech.loader import load_speech_pipeline

    device = torch.device(args.device)
    dtype = None if args.dtype == "auto" else DTYPES[args.dtype]
    extra: dict[str, Any] = {}
    if args.model in (None, "demo"):
        from omnirt.stages.speech.demo import ensure_demo_checkpoint

        path: Path = ensure_demo_checkpoint()
        extra = {"model_id": "demo-qwen3-omni", "random_weights": True}
    else:
        path = Path(args.model).expanduser()
    start = time.perf_counter()
    pipeline = load_speech_pipeline(
        path,
        device=device,
        dtype=dtype,
        load_format=args.load_format,
        max_slots=max_slots,
        max_context=args.max_context,
        max_audio_frames=args.max_audio_frames,
        compile_workers=getattr(args, "compile_workers", None),  # None: as the server
        **extra,
    )
    _sync(device)
    load_s = time.perf_counter() - start
    weights = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None
    start = time.perf_counter()
    warm_up = getattr(pipeline, "warm_up", None)
    if callable(warm_up):
        warm_up()
    _sync(device)
    return pipeline, Startup(load_s, time.perf_counter() - start, weights)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class FrameCounter:
    """Talker frames per request in the last tick, counted where the pipeline hands each frame
    to its vocoder (``vocoder.push(request_id, frame)``, the ``Vocoder`` protocol)."""

    def __init__(self, pipeline: Any) -> None:
        self.counts: Counter[str] = Counter()
        self.ever = False  # push has counted a frame
        vocoder = getattr(pipeline, "vocoder", None)
        push = getattr(vocoder, "push", None)
        self.exact = callable(push)
        if self.exact:

            def counting_push(key: str, frame: Any, *rest: Any, **kw: Any) -> Any:
                self.counts[key] += 1
                return push(key, frame, *rest, **kw)

            vocoder.push = counting_push  # type: ignore[union-attr]

    def take(self) -> Counter[str]:
        counts, self.counts = self.counts, Counter()
        return counts


# -- one level ---------------------------------------------------------------------------------------


@dataclass
class Session:
    index: int
    start_tick: int
    request_id: str | None = None
    added_at: float = 0.0
    heard: bool = False  # this turn's first audio arrived
    ever_heard: bool = False
    in_window: bool = False  # this turn was added inside the measured window
    turns: int = 0
    history: list = field(default_factory=list)  # the conversation so far (``--history``)
    asked: Any = None  # this turn's user message
    reply: list = field(default_factory=list)  # this turn's reply text
    speak_wall: float = 0.0  # window: wall time of the ticks in which it got a frame
    frames: int = 0  # window: frames it got


@dataclass
class Level:
    mode: str
    sessions: int
    ramp_s: float | None = None  # None: the ramp did not complete
    speaking: int = 0  # sessions that had heard audio when the level ended
    window_s: float = 0.0
    tick_walls: list[float] = field(default_factory=list)  # window ticks with a talker frame
    window_walls: list[float] = field(default_factory=list)  # every window tick
    tick_frames: list[int] = field(default_factory=list)
    first_audio: list[float] = field(default_factory=list)
    rtf: list[float] = field(default_factory=list)
    turns_done: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    peak_gib: float | None = None
    phases: Counter[str] = field(default_factory=Counter)  # window: host seconds by step phase

    def p(self, values: Sequence[float], q: float, scale: float = 1.0) -> str:
        return f"{np.percentile(values, q) * scale:.1f}" if values else "-"

    def real_time(self) -> bool:
        return bool(self.tick_walls) and float(np.percentile(self.tick_walls, 99)) < FRAME_SECONDS


class Driver:
    """Keeps N sessions speaking through one pipeline and measures the ticks."""

    def __init__(self, pipeline: Any, args: argparse.Namespace) -> None:
        self.pipeline = pipeline
        self.args = args
        self.device = torch.device(args.device)
        self.counter = FrameCounter(pipeline)
        self.turn_seq = 0

    def _request(self, session: Session) -> GenerationRequest:
        self.turn_seq += 1
        # A new utterance each turn: a repeated prompt would be read once and then reused whole
        # (the prefix cache), which no conversation does.
        audio = speechlike_tone(self.args.audio_seconds, seed=session.index * 100_003 + session.turns)
        session.asked = ContextMessage("user", (AudioPart(audio), TextPart("Please answer briefly.")))
        return GenerationRequest(
            request_id=f"s{session.index}-t{session.turns}",
            messages=[*session.history, session.asked],
            output_audio=True,
            max_output_tokens=self.args.max_output_tokens,
            temperature=self.args.temperature,
            top_p=self.args.top_p,
            seed=self.turn_seq,
        )

    def _remember(self, session: Session, answered: bool) -> None:
        """Ends a turn: with ``--history``, it joins the conversation (a new one once it holds
        ``--history`` turns)."""
        # Random weights babble special tokens, which a prompt's text may not hold.
        reply, session.reply = re.sub(r"<[^<>\s]{1,40}>", "", "".join(session.reply)), []
        if not self.args.history or len(session.history) >= 2 * self.args.history:
            session.history = []
        elif answered:
            session.history += [session.asked, ContextMessage("assistant", (TextPart(reply),))]

    def run(
        self,
        mode: str,
        n: int,
        seconds: float,
        on_window: Callable[[], Any] | None = None,
        window_ticks: int | None = None,
    ) -> tuple[Level, Any]:
        """One level in three phases: the ramp (until every session has heard audio), the
        measured window (``seconds``, or ``window_ticks`` ticks inside ``on_window()``'s context,
        the profiler), and a tail that starts no turn and runs until the window's turns have
        their first audio. Returns the level and the window's context object."""
        args, pipeline = self.args, self.pipeline
        level = Level(mode, n)
        sessions = [
            Session(i, (i * args.ramp_ticks) // n)
            for i in range(n)
        ]
        owner: dict[str, Session] = {}  # request id -> its session, for the whole level
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.counter.take()
        prepare = callable(getattr(pipeline, "prepare", None))
        phases = getattr(pipeline, "phases", None)  # stages.pipeline.PhaseTimes, if it keeps one
        if phases is not None:
            phases.take()
        begin = time.perf_counter()
        phase = "ramp"
        window_start = window_end = 0.0
        window_ctx: Any = None
        tick = 0
        while True:
            t0 = time.perf_counter()
            if t0 - begin > args.level_timeout:
                break
            if phase == "window":
                ticks = len(level.window_walls)
                if (window_ticks is None and t0 - window_start >= seconds) or (
                    window_ticks is not None and ticks >= window_ticks
                ):
                    phase, window_end = "tail", t0
                    if window_ctx is not None:
                        _sync(self.device)
                        window_ctx.__exit__(None, None, None)
            if phase == "tail" and not any(s.request_id and s.in_window and not s.heard for s in sessions):
                break
            if phase != "tail":
                for s in sessions:
                    if s.request_id is None and tick >= s.start_tick and pipeline.can_add():
                        made = time.perf_counter()
                        request = self._request(s)  # the client's part: synthesising its audio
                        s.added_at = time.perf_counter()
                        # The server prepares prompts (tokens, audio features) on threads of
                        # its own (stages/engine.py): that work is in first audio, not the tick.
                        prepared = pipeline.prepare(request) if prepare else None
                        t0 += time.perf_counter() - made
                        pipeline.add(request, prepared) if prepare else pipeline.add(request)
                        s.request_id, s.heard, s.in_window = request.request_id, False, phase == "window"
                        s.turns += 1
                        owner[request.request_id] = s
            outs = pipeline.step() if pipeline.has_work() else []
            stepped = time.perf_counter()
            _sync(self.device)
            t1 = time.perf_counter()
            step_phases = phases.take() if phases is not None else Counter()
            wall = t1 - t0
            audio_frames: Counter[str] = Counter()
            for rid, out in outs:
                s = owner.get(rid)
                if s is None or s.request_id != rid:
                    continue
                if isinstance(out, AudioDelta):
                    audio_frames[rid] += out.frames
                    if not s.heard:
                        s.heard = s.ever_heard = True
                        if s.in_window:
                            level.first_audio.append(t1 - s.added_at)
                elif isinstance(out, TextDelta):
                    s.reply.append(out.text)
                elif isinstance(out, Finished):
                    if out.reason == "error":
                        level.errors[out.error or "error"] += 1
                    elif phase == "window":
                        level.turns_done += 1
                    self._remember(s, out.reason != "error")
                    s.request_id = None
            counted = self.counter.take()
            if self.counter.exact and audio_frames and not counted and not self.counter.ever:
                self.counter.exact = False  # frames no longer pass through vocoder.push
            self.counter.ever = self.counter.ever or bool(counted)
            frames = counted if self.counter.exact else audio_frames
            if phase == "window":
                level.window_walls.append(wall)
                level.phases.update(step_phases)
                level.phases["admission"] += stepped - t0 - sum(step_phases.values())
                level.phases["sync after the step"] += t1 - stepped
                total = sum(frames.values())
                if total:
                    level.tick_walls.append(wall)
                    level.tick_frames.append(total)
                for rid, count in frames.items():
                    if rid in owner:
                        owner[rid].speak_wall += wall
                        owner[rid].frames += count
            elif phase == "ramp" and all(s.ever_heard for s in sessions):
                phase, window_start = "window", t1
                level.ramp_s = t1 - begin
                if on_window is not None:
                    window_ctx = on_window()
                    window_ctx.__enter__()
            tick += 1
        if phase == "window":  # the level timed out inside the window
            window_end = time.perf_counter()
            if window_ctx is not None:
                _sync(self.device)
                window_ctx.__exit__(None, None, None)
        level.window_s = window_end - window_start if level.ramp_s is not None else 0.0
        level.speaking = sum(s.ever_heard for s in sessions)
        level.rtf = [s.speak_wall / (s.frames * FRAME_SECONDS) for s in sessions if s.frames]
        if self.device.type == "cuda":
            level.peak_gib = torch.cuda.max_memory_allocated(self.device) / 2**30
        for s in sessions:  # leave the pipeline empty for the next level
            if s.request_id is not None:
                pipeline.remove(s.request_id)
        while pipeline.has_work():
            pipeline.step()
        self.counter.take()
        return level, window_ctx


# -- reporting ---------------------------------------------------------------------------------------

HEADER = (
    "| mode | sessions | ramp (s) | frame ticks | frame p50 (ms) | frame p99 (ms) | frames/tick "
    "| RTF p50 | RTF p99 | first audio p50 (ms) | first audio p99 (ms) | turns done "
    "| peak GPU mem (GiB) | p99 < 80 ms |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def row(level: Level) -> str:
    ramp = (
        f"{level.ramp_s:.1f}"
        if level.ramp_s is not None
        else f"incomplete ({level.speaking}/{level.sessions})"
    )
    frames = f"{np.mean(level.tick_frames):.1f}" if level.tick_frames else "-"
    mem = f"{level.peak_gib:.1f}" if level.peak_gib is not None else "-"
    cells = [
        level.mode,
        str(level.sessions),
        ramp,
        f"{len(level.tick_walls)} in {level.window_s:.1f} s",
        level.p(level.tick_walls, 50, 1000),
        level.p(level.tick_walls, 99, 1000),
        frames,
        level.p(level.rtf, 50),
        level.p(level.rtf, 99),
        level.p(level.first_audio, 50, 1000) + f" (n={len(level.first_audio)})",
        level.p(level.first_audio, 99, 1000),
        str(level.turns_done),
        mem,
        "yes" if level.real_time() else "no",
    ]
    text = "| " + " | ".join(cells) + " |"
    if level.errors:
        text += "\n\n(errors: " + "; ".join(f"{k} x{v}" for k, v in level.errors.items()) + ")\n"
    return text


def phases_table(levels: Sequence[Level]) -> str:
    """Host time of a window tick by phase of the step, mean ms per tick per level."""
    names: list[str] = []
    for level in levels:
        names += [k for k in level.phases if k not in names]
    if not names:
        return ""
    lines = [
        "| mode | sessions | " + " | ".join(names) + " | tick |",
        "|---|---|" + "---|" * (len(names) + 1),
    ]
    for level in levels:
        ticks = max(1, len(level.window_walls))
        cells = [f"{level.phases[k] / ticks * 1e3:.1f}" for k in names]
        tick = sum(level.window_walls) / ticks * 1e3
        lines.append(f"| {level.mode} | {level.sessions} | " + " | ".join(cells) + f" | {tick:.1f} |")
    return "\n".join(lines)


def profile_report(
    prof: Any,
    tick_walls: list[float],
    device: torch.device,
    top: int,
    phases: Sequence[str] = (),
    unprofiled_tick: float | None = None,
) -> str:
    from torch.autograd import DeviceType

    wall_us = sum(tick_walls) * 1e6
    lines = [f"profiled {len(tick_walls)} ticks, {wall_us / 1e3:.1f} ms of tick wall time"]
    if device.type != "cuda":
        lines.append("(CPU run: no GPU time; top operators by self CPU time)")
        lines.append("| operator | calls | self CPU (ms) |\n|---|---|---|")
        averages = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        for e in averages[:top]:
            lines.append(f"| `{e.key[:90]}` | {e.count} | {e.self_cpu_time_total / 1e3:.2f} |")
        return "\n".join(lines)
    device_events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    # The step's phases (PhaseTimes' record_function ranges) come back as GPU-side spans too.
    ranges = [e for e in device_events if e.name in phases]
    kernels = [e for e in device_events if e.name not in phases]
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    merged: list[list[float]] = []  # the union of the kernel intervals
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    busy = sum(b - a for a, b in merged)
    share = busy / wall_us if wall_us else 0.0
    lines.append(
        f"GPU busy {busy / 1e3:.1f} ms of {wall_us / 1e3:.1f} ms: **{share:.0%}** of the tick wall time; "
        f"{len(kernels) / max(1, len(tick_walls)):.0f} kernels and copies per tick"
    )
    if unprofiled_tick and tick_walls:
        per_tick = busy / 1e3 / len(tick_walls)
        lines.append(
            f"GPU work {per_tick:.1f} ms a tick: **{per_tick / (unprofiled_tick * 1e3):.0%}** of the same "
            f"level's unprofiled tick ({unprofiled_tick * 1e3:.1f} ms; profiled ticks "
            f"{wall_us / 1e3 / len(tick_walls):.1f} ms)"
        )
    phases = [name for name in phases if any(r.name == name for r in ranges)]
    if phases:
        starts = [a for a, _ in merged]
        by_phase: Counter[str] = Counter()
        for r in ranges:
            lo, hi = r.time_range.start, r.time_range.end
            i = max(0, bisect.bisect_right(starts, lo) - 1)
            while i < len(merged) and merged[i][0] < hi:
                by_phase[r.name] += max(0.0, min(hi, merged[i][1]) - max(lo, merged[i][0]))
                i += 1
        ticks = max(1, len(tick_walls))
        cells = " | ".join(f"{by_phase[name] / ticks / 1e3:.1f}" for name in phases)
        lines.append("GPU busy per tick by phase of the step that launched it (ms):\n")
        lines.append("| " + " | ".join(phases) + " |\n|" + "---|" * len(phases) + "\n| " + cells + " |\n")
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        totals[e.name][0] += 1
        totals[e.name][1] += e.time_range.end - e.time_range.start
    lines.append("| kernel | calls | GPU time (ms) | share of busy |\n|---|---|---|---|")
    for name, (calls, us) in sorted(totals.items(), key=lambda kv: kv[1][1], reverse=True)[:top]:
        lines.append(f"| `{name[:90]}` | {calls} | {us / 1e3:.2f} | {us / busy if busy else 0:.1%} |")
    return "\n".join(lines)


def host_report(prof: Any, ticks: int, top: int) -> str:
    """The functions holding the host longest per tick (cProfile: inclusive and own time; the
    profiler's own overhead inflates both, the most for the functions called most)."""
    import pstats

    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    ticks = max(1, ticks)
    rows = []
    for (path, line, name), (_, calls, own, cumulative, _) in stats.items():
        where = f"{Path(path).name}:{line} {name}" if line else name
        rows.append((cumulative, own, calls, where))
    lines = [
        f"cProfile over {ticks} ticks; per tick:\n",
        "| function | calls | inclusive (ms) | own (ms) |\n|---|---|---|---|",
    ]
    for cumulative, own, calls, where in sorted(rows, reverse=True)[: 2 * top]:
        per_tick = f"{calls / ticks:.1f} | {cumulative / ticks * 1e3:.2f} | {own / ticks * 1e3:.2f}"
        lines.append(f"| `{where[:90]}` | {per_tick} |")
    lines.append("\nby own time:\n\n| function | calls | own (ms) |\n|---|---|---|")
    for _, own, calls, where in sorted(rows, key=lambda r: r[1], reverse=True)[:top]:
        lines.append(f"| `{where[:90]}` | {calls / ticks:.1f} | {own / ticks * 1e3:.2f} |")
    return "\n".join(lines)


# -- main --------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="checkpoint or config folder; default: the embedded demo"
    )
    parser.add_argument("--load-format", choices=("auto", "dummy"), default="auto")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--dtype", choices=("auto", *DTYPES), default="auto", help="auto: bf16 on CUDA, fp32 on CPU"
    )
    parser.add_argument("--max-context", type=int, default=1024, help="thinker tokens per session (KV slots)")
    parser.add_argument(
        "--compile-workers", type=int, default=None,
        help="threads making the steps' first calls before the capture (their Triton compiles side by "
        "side; default: as the server, stages.graphs.default_compile_workers(); 0: none)",
    )
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    parser.add_argument("--seconds", type=float, default=10.0, help="measured wall time per level and mode")
    parser.add_argument("--level-timeout", type=float, default=60.0, help="hard limit per level and mode (s)")
    parser.add_argument(
        "--time-budget",
        type=float,
        default=0.0,
        help="skip the levels that could end after this many seconds of levels (0: no limit)",
    )
    parser.add_argument("--ramp-ticks", type=int, default=16, help="ticks over which first turns start")
    parser.add_argument(
        "--modes", nargs="+", choices=("graphs", "eager", "whole"), default=["graphs", "eager"]
    )
    parser.add_argument("--audio-seconds", type=float, default=1.0, help="input audio per turn")
    parser.add_argument("--max-output-tokens", type=int, default=16, help="thinker tokens per reply")
    parser.add_argument(
        "--history", type=int, default=0, metavar="K",
        help="earlier turns a prompt holds (conversations of K+1 turns)",
    )
    parser.add_argument(
        "--max-audio-frames", type=int, default=64, help="talker frames per reply (80 ms each)"
    )
    parser.add_argument("--temperature", type=float, default=0.7, help="0: greedy (talker too)")
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="profile ticks at N sessions")
    parser.add_argument("--profile-ticks", type=int, default=8)
    parser.add_argument("--profile-top", type=int, default=15, help="rows of the kernel table")
    parser.add_argument(
        "--host-profile", type=int, default=0, metavar="N",
        help="profile the host (cProfile) over the measured window at N sessions, first mode",
    )
    parser.add_argument(
        "--slots", type=int, default=0,
        help="slots the pipeline plans (default: the largest level); spare slots keep prompt prefixes",
    )
    args = parser.parse_args(argv)
    if min(args.sessions) < 1 or args.profile < 0 or args.host_profile < 0 or args.max_context < 64:
        parser.error("--sessions must be >= 1, --profile and --host-profile >= 0, --max-context >= 64")
    if args.slots and args.slots < max([*args.sessions, args.profile, args.host_profile]):
        parser.error("--slots must hold the largest level")
    return args


def use_mode(pipeline: Any, mode: str) -> None:
    """Graphs off for ``eager``, the prompt prefix cache off for ``whole`` (where the pipeline can)."""
    if callable(getattr(pipeline, "use_graphs", None)):
        pipeline.use_graphs(mode != "eager")
        if hasattr(pipeline, "use_prefix_cache"):
            pipeline.use_prefix_cache(mode != "whole")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    device = torch.device(args.device)
    max_slots = args.slots or max([*args.sessions, args.profile, args.host_profile])
    pipeline, startup = build(args, max_slots)
    gc.collect()
    gc.freeze()  # as the server does after start-up: no full collections of the model's objects
    info = pipeline.info
    model = getattr(pipeline, "model", None)
    params = sum(p.numel() for p in model.parameters()) if model is not None else 0
    size = f"{params / 1e9:.2f} B" if params >= 1e8 else f"{params / 1e6:.2f} M"
    dtype = getattr(pipeline, "dtype", None)
    dtype_name = next((k for k, v in DTYPES.items() if v == dtype), str(dtype))
    can_switch = callable(getattr(pipeline, "use_graphs", None))
    modes = args.modes if can_switch else ["default"]
    print(f"# Speech capacity: {info.id}\n")
    print(
        f"- model: {info.architecture}, {size} parameters, "
        f"{'RANDOM WEIGHTS' if info.random_weights else 'checkpoint weights'} ({args.load_format}); "
        f"{device}, {dtype_name}; {max_slots} slots x {args.max_context} context tokens"
    )
    print(
        f"- start-up: load {startup.load_s:.1f} s (build/read weights, allocate slots, capture what the "
        f"pipeline captures at construction) + warm-up {startup.warm_up_s:.1f} s"
        + (f"; {startup.weights_gib:.1f} GiB allocated after load" if startup.weights_gib is not None else "")
    )
    print(
        f"- each turn: {args.audio_seconds:g} s of input audio, up to {args.max_output_tokens} "
        f"thinker tokens and {args.max_audio_frames} talker frames, temperature {args.temperature:g}; "
        f"{args.seconds:g} s measured per level after the ramp (limit {args.level_timeout:g} s per level)"
        + (f"; conversations of {args.history + 1} turns" if args.history else "")
    )
    if not can_switch:
        print(
            "- modes: this pipeline has no `use_graphs(enabled)`: each level ran once, in its own mode "
            "(today: CUDA graphs for code2wav only on CUDA; thinker, talker and code predictor eager)"
        )
    driver = Driver(pipeline, args)
    print()
    print(HEADER, flush=True)
    levels: list[Level] = []
    start = time.perf_counter()

    def over_budget() -> bool:
        return bool(args.time_budget) and time.perf_counter() - start + args.level_timeout > args.time_budget

    for n in args.sessions:
        for mode in modes:
            if over_budget():
                print(f"| {mode} | {n} | skipped: --time-budget {args.time_budget:g} s would be exceeded |")
                continue
            use_mode(pipeline, mode)
            level, _ = driver.run(mode, n, args.seconds)
            levels.append(level)
            print(row(level), flush=True)
    table = phases_table(levels)
    if table:
        print("\nHost time per tick by phase of the step (ms, mean over the measured ticks; a phase that")
        print("syncs with the device holds the wait for what was queued before it):\n")
        print(table)
    print(f"\n- talker frames counted from {'vocoder pushes' if driver.counter.exact else 'audio deltas'}")
    for mode in modes:
        fits = [lv.sessions for lv in levels if lv.mode == mode and lv.real_time()]
        print(f"- largest N with p99 frame time < 80 ms ({mode}): {max(fits) if fits else 'none'}")
    if args.profile and over_budget():
        print(f"\n(profile skipped: --time-budget {args.time_budget:g} s would be exceeded)")
    elif args.profile:
        from torch.profiler import ProfilerActivity, profile

        use_mode(pipeline, modes[0])
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        level, prof = driver.run(
            modes[0],
            args.profile,
            args.seconds,
            on_window=lambda: profile(activities=activities),
            window_ticks=args.profile_ticks,
        )
        print(f"\n## Profile: {args.profile} sessions, mode {modes[0]}\n")
        if prof is None:
            print(f"(the ramp did not complete within {args.level_timeout:g} s: nothing profiled)")
        else:
            names = list(level.phases) if level.phases else []
            same = [lv for lv in levels if lv.sessions == args.profile and lv.mode == modes[0]]
            same_walls = [w for lv in same for w in lv.window_walls]
            unprofiled = float(np.mean(same_walls)) if same_walls else None
            print(profile_report(prof, level.window_walls, device, args.profile_top, names, unprofiled))
    if args.host_profile and over_budget():
        print(f"\n(host profile skipped: --time-budget {args.time_budget:g} s would be exceeded)")
    elif args.host_profile:
        import cProfile

        use_mode(pipeline, modes[0])
        level, prof = driver.run(modes[0], args.host_profile, args.seconds, on_window=cProfile.Profile)
        print(f"\n## Host profile: {args.host_profile} sessions, mode {modes[0]}\n")
        if prof is None:
            print(f"(the ramp did not complete within {args.level_timeout:g} s: nothing profiled)")
        else:
            print(host_report(prof, len(level.window_walls), args.profile_top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
