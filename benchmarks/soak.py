"""Soak: many realtime sessions for minutes, with and without hostile clients beside them.

Starts ``omnirt serve`` (the embedded default on CPU unless ``--serve-args`` says otherwise) as a
subprocess and runs one phase per ``--phases`` entry, each on a fresh server:

- ``calm``: ``--sessions`` well-behaved sessions for ``--minutes``;
- ``hostile``: the same sessions plus ``--hostile`` hostile clients beside them.

A well-behaved session connects, keeps server VAD (OpenAI's default) and caps replies at
``--reply-tokens`` thinker tokens, then loops: think ``--think`` seconds (uniform), then one turn,
picked at random:

- ``text``: ``conversation.item.create`` + ``response.create`` with text output; latency: from the
  ``response.create`` sent to the first ``response.output_text.delta``;
- ``audio``: espeak-ng speech streamed in 100 ms chunks at real time, then silence until the
  server VAD ends the turn; the reply (audio) follows on its own; latency: from
  ``input_audio_buffer.speech_stopped`` to the first ``response.output_audio.delta``;
- ``barge-in``: an audio turn whose reply is interrupted by more speech after its first audio; the
  first response must end ``cancelled`` (``turn_detected``), the second complete; latency as
  ``audio``, for the second response.

A session lives ``--lifetime`` seconds (uniform) and then closes and reconnects, so sessions are
torn down and made all along (RSS staying flat shows teardown frees them). A turn fails on an
``error`` event, a response that does not end as expected, a close, or ``--turn-timeout``.

Hostile clients, in turn one of:

- ``fuzz``: malformed and random events (bad JSON, unknown types, wrong types, deep nesting,
  huge integers, invalid base64, binary frames) at ``--fuzz-rate`` per second;
- ``slow``: asks for long replies (in band and out of band) and never reads; reconnects once closed;
- ``huge``: a text item of ``--huge-mib`` MiB every few seconds (refused: context length), six
  times, then an audio append over the frame limit (the server closes the connection).

``--phases interleaved`` runs both on one server instead: the well-behaved sessions for
``--minutes``, the hostile clients only in every other window of ``--interleave`` seconds (calm
first), each turn counted in the window it starts in, except in the first ``--settle`` seconds
after a switch (a row of its own, "settling"). The machine's speed drifts by more than the
hostile clients' cost within minutes on a shared 2-core machine; interleaved windows see the same
drift, so their ratio is the hostile clients' own cost. The server's CPU and its speech steps'
durations are split by window too. ``--save FILE`` keeps each phase's turn latencies, and
``--pool FILE...`` (no server) gives the p50 / p99 of several runs' turns together by phase: the
p99 of one run's ~850 turns is their ninth slowest, and moves between runs of the same code.

The hostile clients run in a process of their own (as they would on another machine): in the
measuring process, their 4 MiB frames and fuzz would delay the well-behaved sessions' event loop
and so their measured latencies. That loop's own lag (how late a 50 ms sleep wakes, p99) is in the
table: a latency is only as good as it. So are the CPU cores the server (with its VAD worker) and
the hostile clients' process used on average: on a 2-core machine the attackers' own CPU is
taken from the server.

The server's RSS (the serve process, and with its children: the VAD worker) is sampled every
``--rss-every`` seconds; the table gives it at the start (the server up, no session yet), at the
end of warm-up, in the middle of what follows and at the end, and the growth after warm-up. The
warm-up (``--warmup``; by default the staggered start plus one longest session lifetime, at most
half the phase) is the time the server needs to hold its steady load: until every session has
been replaced once, there are more conversations alive, and longer ones, every minute.

Goal (issue 16) on the 2-core machine: 100 sessions x 10 minutes, 0 failed turns, RSS growth
under 5% after warm-up, and with 10 hostile clients the well-behaved sessions' p99 latency grows
by less than 20%.

    python benchmarks/soak.py --sessions 100 --minutes 10 --hostile 10
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import functools
import json
import logging
import multiprocessing
import os
import random
import shlex
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
import websockets
from omnirt.codecs.audio import float_to_pcm16
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.server
from omnirt.stages.cache import default_cache_root  # noqa: E402
from turn_latency import espeak_speech, speechlike_tone  # noqa: E402

from tests.server import serve_cli_process  # noqa: E402

log = logging.getLogger("soak")

CHUNK_MS = 100
BYTES_PER_MS = 48  # PCM16 mono at 24 kHz
MAX_FRAME = 1 << 20
UTTERANCES = (
    "Hello there, how are you today?",
    "Could you tell me what the weather will be like tomorrow afternoon?",
    "Please book a table for two at seven.",
    "What time does the train to the airport leave?",
)


# -- audio --------------------------------------------------------------------------------------


def utterances() -> list[bytes]:
    """PCM16 speech (espeak-ng; a speech-like tone when it is missing) for the audio turns."""
    out = []
    for i, text in enumerate(UTTERANCES):
        pcm = espeak_speech(text)
        if pcm is None:
            pcm = speechlike_tone(1.2 + 0.3 * i)
        out.append(float_to_pcm16(np.asarray(pcm, dtype=np.float32)))
    return out


def chunks(pcm: bytes) -> Iterator[str]:
    step = CHUNK_MS * BYTES_PER_MS
    for start in range(0, len(pcm), step):
        yield base64.b64encode(pcm[start : start + step]).decode()


KINDS = ("text", "audio", "barge-in")
#: Thinker tokens of a reply that is to be interrupted (about 25 s of audio with random weights).
BARGE_REPLY_TOKENS = 64
SILENCE = base64.b64encode(bytes(CHUNK_MS * BYTES_PER_MS)).decode()


# -- results ------------------------------------------------------------------------------------


@dataclass
class Phase:
    name: str
    latencies: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in KINDS})
    turns: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    sessions_opened: int = 0
    refused_sessions: int = 0
    hostile_events: int = 0
    hostile_connections: int = 0
    loop_lag: list[float] = field(default_factory=list)  # how late each 50 ms sleep woke (s)
    server_cpu: float = 0.0  # the server's CPU seconds (with its VAD worker) per second of the phase
    hostile_cpu: float = 0.0  # the hostile clients' process's, likewise
    rss: list[tuple[float, int, int]] = field(default_factory=list)  # (t, serve, with children)
    #: The server's speech steps by duration at the phase's end (``/metrics``): upper bound
    #: (seconds) -> steps that took at most that long (cumulative), and their total seconds.
    step_buckets: dict[float, float] = field(default_factory=dict)
    step_seconds: float = 0.0
    seconds: float = 0.0  # the phase's time (interleaved: its windows')
    textless: int = 0  # text replies whose tokens made no text (see text_turn)
    server_cpu_s: float = 0.0
    hostile_cpu_s: float = 0.0

    def fail(self, kind: str, why: str) -> None:
        self.failed[kind] += 1
        if len(self.failures) < 20:
            self.failures.append(f"{kind}: {why}")


class TurnFailed(Exception):
    pass


@dataclass
class Schedule:
    """Which phase each moment of a server's run counts in: one phase throughout, or the phases
    in turn, a ``window`` of seconds each, the first ``settle`` seconds after each switch in
    ``settling``."""

    t0: float
    phases: list[Phase]
    window: float = float("inf")
    settle: float = 0.0
    settling: Phase | None = None

    def index(self, t: float) -> int:
        return 0 if self.window == float("inf") else int((t - self.t0) // self.window)

    def at(self, t: float | None = None) -> Phase:
        t = time.monotonic() if t is None else t
        k = self.index(t)
        if self.settling is not None and k > 0 and t - self.t0 - k * self.window < self.settle:
            return self.settling
        return self.phases[k % len(self.phases)]


def check_done(done: dict[str, Any], what: str) -> None:
    """A reply ended as it should: completed, or cut at the session's ``max_output_tokens``."""
    response = done["response"]
    reason = (response.get("status_details") or {}).get("reason")
    if response["status"] == "completed" or (
        response["status"] == "incomplete" and reason == "max_output_tokens"
    ):
        return
    raise TurnFailed(f"{what} ended {response['status']} ({reason})")


# -- the server ---------------------------------------------------------------------------------


@contextlib.contextmanager
def server(args: argparse.Namespace, log_path: Path) -> Iterator[tuple[str, psutil.Process]]:
    """``omnirt serve`` in a process of its own (tests.server's helper), with room for every
    session; yields its ws:// base and its process."""
    serve_args = ["--max-sessions", str(args.sessions + args.hostile + 8), "--log-level", "warning"]
    serve_args += shlex.split(args.serve_args)
    with serve_cli_process(serve_args, cache=default_cache_root(), log=log_path, start_timeout=300) as (
        base,
        proc,
    ):
        yield base.replace("http://", "ws://"), psutil.Process(proc.pid)


def cpu_seconds(proc: psutil.Process) -> float:
    """CPU seconds of ``proc`` and its children (user and system)."""
    total = 0.0
    for p in (proc, *proc.children(recursive=True)):
        with contextlib.suppress(psutil.Error):
            times = p.cpu_times()
            total += times.user + times.system
    return total


def rss(proc: psutil.Process) -> tuple[int, int]:
    own = proc.memory_info().rss
    children = sum(c.memory_info().rss for c in proc.children(recursive=True))
    return own, own + children


# -- well-behaved sessions ---------------------------------------------------------------------


class Session:
    def __init__(self, ws: Any) -> None:
        self.ws = ws

    async def send(self, event: dict[str, Any]) -> None:
        await self.ws.send(json.dumps(event))

    async def recv(self, timeout: float) -> dict[str, Any]:
        event = json.loads(await asyncio.wait_for(self.ws.recv(), timeout))
        if event["type"] == "error":
            raise TurnFailed(f"error {event['error'].get('code')}: {event['error'].get('message')}"[:300])
        return event

    async def until(self, kind: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            event = await self.recv(max(0.01, deadline - time.monotonic()))
            if event["type"] == kind:
                return event
            if event["type"] == "response.done" and kind != "response.done":
                raise TurnFailed(f"response.done ({event['response']['status']}) before {kind}")


async def stream(s: Session, pcm: bytes, silence_ms: int) -> None:
    """Speech at real time, then ``silence_ms`` of silence (the VAD needs it to end the turn)."""
    t0 = time.monotonic()
    frames = list(chunks(pcm)) + [SILENCE] * (silence_ms // CHUNK_MS)
    for i, chunk in enumerate(frames):
        await asyncio.sleep(max(0.0, t0 + i * CHUNK_MS / 1000 - time.monotonic()))
        await s.send({"type": "input_audio_buffer.append", "audio": chunk})


async def text_turn(s: Session, rng: random.Random, timeout: float, phase: Phase) -> float:
    """Latency to the first text delta; a reply whose tokens made no text at all (the embedded
    random model, capped at a few tokens, can draw only tokens that print nothing) is a valid
    reply, timed to its ``response.done`` and counted in ``phase.textless``."""
    words = " ".join(rng.choice(("tell", "me", "about", "the", "sea", "please", "now")) for _ in range(8))
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": words}]}
    await s.send({"type": "conversation.item.create", "item": item})
    await s.until("conversation.item.done", timeout)
    sent = time.monotonic()
    await s.send({"type": "response.create", "response": {"output_modalities": ["text"]}})
    deadline = sent + timeout
    while (event := await s.recv(max(0.01, deadline - time.monotonic())))["type"] not in (
        "response.output_text.delta",
        "response.done",
    ):
        pass
    latency = time.monotonic() - sent
    if event["type"] == "response.done":
        check_done(event, "text response with no text")
        phase.textless += 1
        return latency
    check_done(await s.until("response.done", timeout), "text response")
    return latency


async def audio_reply(s: Session, pcm: bytes, timeout: float) -> float:
    """Speak, then wait for the reply's first audio; returns speech_stopped -> first audio."""
    sender = asyncio.create_task(stream(s, pcm, 1000))
    try:
        await s.until("input_audio_buffer.speech_stopped", timeout)
        stopped = time.monotonic()
        await s.until("response.output_audio.delta", timeout)
        return time.monotonic() - stopped
    finally:
        await sender


async def audio_turn(s: Session, pcm: bytes, timeout: float) -> float:
    latency = await audio_reply(s, pcm, timeout)
    check_done(await s.until("response.done", timeout), "audio response")
    return latency


async def set_reply_tokens(s: Session, tokens: int, timeout: float) -> None:
    await s.send({"type": "session.update", "session": {"type": "realtime", "max_output_tokens": tokens}})
    await s.until("session.updated", timeout)


async def barge_in_turn(s: Session, pcm: bytes, timeout: float, reply_tokens: int) -> float:
    """The reply to interrupt is made long (``BARGE_REPLY_TOKENS``), so it is still playing when
    the interrupting speech is heard; the answer to that speech is capped as usual."""
    await set_reply_tokens(s, BARGE_REPLY_TOKENS, timeout)
    await audio_reply(s, pcm, timeout)
    await set_reply_tokens(s, reply_tokens, timeout)
    sender = asyncio.create_task(stream(s, pcm, 1000))  # talk over the reply
    try:
        while True:
            event = await s.recv(timeout)
            if event["type"] == "response.done":
                break
        details = event["response"].get("status_details") or {}
        if event["response"]["status"] != "cancelled" or details.get("reason") != "turn_detected":
            raise TurnFailed(f"interrupted reply ended {event['response']['status']} {details}")
        await s.until("input_audio_buffer.speech_stopped", timeout)
        stopped = time.monotonic()
        await s.until("response.output_audio.delta", timeout)
        latency = time.monotonic() - stopped
        done = await s.until("response.done", timeout)
    finally:
        await sender
    check_done(done, "reply after barge-in")
    return latency


async def well_behaved(
    index: int, url: str, args: argparse.Namespace, schedule: Schedule, speech: list[bytes], end: float
) -> None:
    """One session after another until ``end``; each turn counted in the phase it starts in."""
    rng = random.Random(args.seed * 1000 + index)
    await asyncio.sleep(rng.uniform(0, args.think[1]))  # staggered start
    while time.monotonic() < end:
        lifetime = time.monotonic() + rng.uniform(*args.lifetime)
        try:
            async with websockets.connect(url, max_size=MAX_FRAME, open_timeout=60) as ws:
                s = Session(ws)
                created = await s.recv(60)
                assert created["type"] == "session.created", created["type"]
                schedule.at().sessions_opened += 1
                await s.send({"type": "session.update", "session": {
                    "type": "realtime", "max_output_tokens": args.reply_tokens}})  # fmt: skip
                await s.until("session.updated", 30)
                while time.monotonic() < min(lifetime, end):
                    await asyncio.sleep(rng.uniform(*args.think))
                    if time.monotonic() >= end:
                        break
                    kind = rng.choices(("text", "audio", "barge-in"), weights=args.mix)[0]
                    phase = schedule.at()
                    phase.turns[kind] += 1
                    try:
                        if kind == "text":
                            latency = await text_turn(s, rng, args.turn_timeout, phase)
                        elif kind == "audio":
                            latency = await audio_turn(s, rng.choice(speech), args.turn_timeout)
                        else:
                            latency = await barge_in_turn(
                                s, rng.choice(speech), args.turn_timeout, args.reply_tokens
                            )
                    except (TurnFailed, TimeoutError) as exc:
                        phase.fail(kind, str(exc) or type(exc).__name__)
                        break  # the session's state is unknown: reconnect
                    phase.latencies[kind].append(latency)
        except websockets.InvalidStatus as exc:
            schedule.at().refused_sessions += 1
            log.warning("session refused: %s", exc)
            await asyncio.sleep(1)
        except (websockets.ConnectionClosed, OSError, TimeoutError, AssertionError) as exc:
            schedule.at().fail("connection", f"{type(exc).__name__}: {exc}"[:200])
            await asyncio.sleep(1)


# -- hostile clients ---------------------------------------------------------------------------


def junk(rng: random.Random) -> str | bytes:
    """One malformed or hostile client frame."""
    pick = rng.randrange(10)
    if pick == 0:
        return "{not json" + "x" * rng.randrange(100)
    if pick == 1:
        return json.dumps({"type": rng.choice(("nope", "session.explode", "", 7))})
    if pick == 2:
        depth = rng.choice((40, 500, 5000))
        tools = "[" * depth + "]" * depth
        return '{"type":"session.update","session":{"type":"realtime","tools":' + tools + "}}"
    if pick == 3:
        return '{"type":"session.update","session":{"max_output_tokens":' + "9" * 5000 + "}}"
    if pick == 4:
        return json.dumps({"type": "input_audio_buffer.append", "audio": "%%%not base64%%%"})
    if pick == 5:
        return bytes(rng.randrange(256) for _ in range(64))
    if pick == 6:
        return json.dumps({"type": "conversation.item.create", "item": {"type": "message", "role": 5}})
    if pick == 7:
        return '{"type":"session.update","session":{"type":"realtime","temperature":NaN}}'
    if pick == 8:
        return json.dumps({"type": "conversation.item.truncate", "item_id": "x" * 300, "audio_end_ms": -1})
    return json.dumps({"type": "response.cancel", "response_id": rng.random()})


async def fuzz_client(url: str, rng: random.Random, args: argparse.Namespace, phase: Phase) -> None:
    async with websockets.connect(url, max_size=MAX_FRAME) as ws:
        phase.hostile_connections += 1
        reader = asyncio.create_task(drain(ws))
        try:
            for _ in range(int(args.fuzz_rate * 30)):
                await ws.send(junk(rng))
                phase.hostile_events += 1
                await asyncio.sleep(1 / args.fuzz_rate)
        finally:
            reader.cancel()


async def drain(ws: Any) -> None:
    with contextlib.suppress(websockets.ConnectionClosed):
        async for _ in ws:
            pass


async def slow_client(url: str, rng: random.Random, args: argparse.Namespace, phase: Phase) -> None:
    """Asks for long replies, then reads nothing: the server must close it (1008), not grow."""
    async with websockets.connect(url, max_size=MAX_FRAME, max_queue=1) as ws:
        phase.hostile_connections += 1
        long = " ".join(f"word{i}" for i in range(400))
        await ws.send(
            json.dumps(
                {
                    "type": "conversation.item.create",
                    "item": {
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_text", "text": long}],
                    },
                }
            )
        )
        await ws.send(json.dumps({"type": "response.create"}))
        for _ in range(3):
            await ws.send(json.dumps({"type": "response.create", "response": {"conversation": "none"}}))
        phase.hostile_events += 5
        with contextlib.suppress(websockets.ConnectionClosed):
            await asyncio.sleep(60)  # not reading; closed by the server long before
            await ws.close()


@functools.cache
def huge_frames(mib: float) -> tuple[str, str]:
    """A text item of ``mib`` MiB (over any context) and an audio append over the frame limit;
    made once (the client's own CPU is not what is measured)."""
    text = "lorem ipsum " * int(mib * (1 << 20) / 12)
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    audio = base64.b64encode(bytes(16 << 20)).decode()  # over the server's 16 MiB event limit
    return (
        json.dumps({"type": "conversation.item.create", "item": item}),
        json.dumps({"type": "input_audio_buffer.append", "audio": audio}),
    )


async def huge_client(url: str, rng: random.Random, args: argparse.Namespace, phase: Phase) -> None:
    async with websockets.connect(url, max_size=MAX_FRAME, max_queue=None) as ws:
        phase.hostile_connections += 1
        reader = asyncio.create_task(drain(ws))
        item, append = huge_frames(args.huge_mib)
        try:
            for _ in range(6):  # refused (context length); the session stays usable
                await ws.send(item)
                phase.hostile_events += 1
                await asyncio.sleep(rng.uniform(3, 6))
            await ws.send(append)  # over the frame limit: the server closes the connection (1009)
            phase.hostile_events += 1
        finally:
            reader.cancel()


HOSTILE_KINDS = {"fuzz": fuzz_client, "slow": slow_client, "huge": huge_client}


async def hostile_clients(url: str, args: argparse.Namespace, end: float) -> tuple[int, int]:
    """Every hostile client until ``end`` (``time.monotonic``); (connections, events)."""
    phase = Phase("hostile clients")
    await asyncio.gather(*(hostile(i, url, args, phase, end) for i in range(args.hostile)))
    return phase.hostile_connections, phase.hostile_events


def hostile_process(url: str, args: argparse.Namespace, end: float, counts: Any) -> None:
    """The hostile clients' process (``multiprocessing``, spawned): sends back their counts and
    its CPU seconds."""
    connections, events = asyncio.run(hostile_clients(url, args, end))
    counts.send((connections, events, time.process_time()))


async def hostile(index: int, url: str, args: argparse.Namespace, phase: Phase, end: float) -> None:
    rng = random.Random(args.seed * 7919 + index)
    kinds = args.hostile_kinds.split(",")
    client = HOSTILE_KINDS[kinds[index % len(kinds)]]
    while time.monotonic() < end:
        try:
            await asyncio.wait_for(client(url, rng, args, phase), max(0.1, end - time.monotonic()))
        except (websockets.ConnectionClosed, websockets.InvalidStatus, OSError, TimeoutError):
            pass
        await asyncio.sleep(0.5)


# -- a phase ------------------------------------------------------------------------------------


async def sample_rss(
    proc: psutil.Process, samples: list[tuple[float, int, int]], every: float, t0: float, end: float
) -> None:
    while time.monotonic() < end:
        own, total = rss(proc)
        samples.append((time.monotonic() - t0, own, total))
        await asyncio.sleep(every)


async def measure_lag(schedule: Schedule, end: float, every: float = 0.05) -> None:
    while time.monotonic() < end:
        t = time.monotonic()
        await asyncio.sleep(every)
        schedule.at(t).loop_lag.append(time.monotonic() - t - every)


async def run_server(name: str, args: argparse.Namespace, speech: list[bytes]) -> list[Phase]:
    """One server: the phase ``name`` throughout, or (``interleaved``) calm and hostile windows
    in turn; returns the phases it measured."""
    interleaved = name == "interleaved"
    kinds = ("calm (interleaved)", "hostile (interleaved)") if interleaved else (name,)
    phases = [Phase(kind) for kind in kinds]
    settling = Phase("settling (interleaved)") if interleaved else None
    log_path = Path(args.log_dir) / f"soak-{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with server(args, log_path) as (base, proc):
        url = f"{base}/v1/realtime"
        metrics = base.replace("ws://", "http://")
        t0 = time.monotonic()
        end = t0 + args.minutes * 60
        window = args.interleave if interleaved else float("inf")
        schedule = Schedule(t0, phases, window, args.settle if interleaved else 0.0, settling)
        tasks = [
            asyncio.create_task(well_behaved(i, url, args, schedule, speech, end))
            for i in range(args.sessions)
        ]
        rss_samples: list[tuple[float, int, int]] = []
        sampler = asyncio.create_task(sample_rss(proc, rss_samples, args.rss_every, t0, end))
        progress = asyncio.create_task(report_progress(schedule, t0, end))
        lag = asyncio.create_task(measure_lag(schedule, end))
        await drive_windows(schedule, url, metrics, proc, args, end, tasks)
        for task in (sampler, progress, lag):
            task.cancel()
        own, total = rss(proc)
        rss_samples.append((time.monotonic() - t0, own, total))
    for phase in phases + ([settling] if settling is not None else []):
        phase.rss = rss_samples  # one server's
        phase.server_cpu = phase.server_cpu_s / phase.seconds if phase.seconds else 0.0
        phase.hostile_cpu = phase.hostile_cpu_s / phase.seconds if phase.seconds else 0.0
    tracebacks = log_path.read_text().count("Traceback")
    if tracebacks:
        phases[0].failures.append(f"server log: {tracebacks} traceback(s), see {log_path}")
    measured = phases + ([settling] if settling is not None and sum(settling.turns.values()) else [])
    return measured


async def drive_windows(
    schedule: Schedule,
    url: str,
    metrics: str,
    proc: psutil.Process,
    args: argparse.Namespace,
    end: float,
    tasks: list[asyncio.Task[None]],
) -> None:
    """Each window in turn until ``end`` (the last one until every session has ended): the
    hostile clients' process while a hostile phase's window lasts, and at the window's end its
    share of the server's CPU and of its speech steps (``/metrics``) to the window's phase."""
    k = 0
    mp = multiprocessing.get_context("spawn")
    while True:
        start = time.monotonic()
        phase = schedule.phases[k % len(schedule.phases)]
        cpu0, steps0 = cpu_seconds(proc), await read_steps(metrics)
        stop = min(end, schedule.t0 + (k + 1) * schedule.window)
        attackers, counts = None, None
        if phase.name.startswith("hostile") and args.hostile:
            counts, sent = mp.Pipe(duplex=False)
            attackers = mp.Process(target=hostile_process, args=(url, args, stop, sent), daemon=True)
            attackers.start()
        last = stop >= end
        if last:
            await asyncio.gather(*tasks)
        else:
            await asyncio.sleep(max(0.0, stop - time.monotonic()))
        if attackers is not None and counts is not None:
            await asyncio.to_thread(attackers.join, 30)
            if counts.poll():
                connections, events, cpu = counts.recv()
                phase.hostile_connections += connections
                phase.hostile_events += events
                phase.hostile_cpu_s += cpu
            else:
                ended = attackers.exitcode
                phase.failures.append(f"the hostile clients' process ended ({ended}) with no counts")
            if attackers.is_alive():
                attackers.kill()
        buckets, seconds = await read_steps(metrics)
        for bound, n in buckets.items():
            phase.step_buckets[bound] = phase.step_buckets.get(bound, 0.0) + n - steps0[0].get(bound, 0.0)
        phase.step_seconds += seconds - steps0[1]
        phase.server_cpu_s += cpu_seconds(proc) - cpu0
        phase.seconds += time.monotonic() - start
        if last:
            return
        k += 1


async def read_steps(base: str) -> tuple[dict[float, float], float]:
    """The speech pipeline's step-duration histogram from the server's ``/metrics``: upper bound
    -> steps so far that took at most that long (cumulative), and their total seconds."""
    buckets: dict[float, float] = {}
    seconds = 0.0
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"{base}/metrics", timeout=30)).text
    for family in text_string_to_metric_families(text):
        if family.name != "omnirt_pipeline_step_duration_seconds":
            continue
        for sample in family.samples:
            if sample.labels.get("kind") != "speech":
                continue
            if sample.name.endswith("_bucket"):
                buckets[float(sample.labels["le"])] = sample.value
            elif sample.name.endswith("_sum"):
                seconds = sample.value
    return buckets, seconds


async def report_progress(schedule: Schedule, t0: float, end: float) -> None:
    while True:
        await asyncio.sleep(60)
        phase = schedule.at()
        done = sum(len(v) for p in schedule.phases for v in p.latencies.values())
        failed = sum(sum(p.failed.values()) for p in schedule.phases)
        log.info("%s: %.0f s, %d turns done, %d failed", phase.name, time.monotonic() - t0, done, failed)


# -- the table ----------------------------------------------------------------------------------


def p99(values: list[float]) -> float | None:
    if len(values) < 2:
        return values[0] if values else None
    return float(np.percentile(values, 99))


def rss_at(phase: Phase, t: float, which: int) -> int:
    return min(phase.rss, key=lambda r: abs(r[0] - t))[which]


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def table(phases: list[Phase], args: argparse.Namespace) -> str:
    warm = args.warmup * 60
    total = args.minutes * 60
    lines = [
        "| phase | turns (text/audio/barge-in) | failed | sessions opened | p50 (ms) | p99 (ms) | "
        "p99 text / audio / barge-in (ms) | RSS at start (MiB) | after warm-up | middle | end | growth | "
        "with VAD worker: warm-up / end (MiB) | growth | client loop lag p99 (ms) | "
        "server CPU (cores) | hostile clients' CPU (cores) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in phases:
        every = [x for v in p.latencies.values() for x in v]
        r0, r1, r2 = (rss_at(p, t, 1) for t in (warm, (warm + total) / 2, total))
        c0, c2 = rss_at(p, warm, 2), rss_at(p, total, 2)
        lines.append(
            f"| {p.name} | {p.turns['text']}/{p.turns['audio']}/{p.turns['barge-in']} | "
            f"{sum(p.failed.values())} | {p.sessions_opened} | "
            f"{ms(statistics.median(every) if every else None)} | {ms(p99(every))} | "
            f"{' / '.join(ms(p99(p.latencies[k])) for k in ('text', 'audio', 'barge-in'))} | "
            f"{p.rss[0][1] / 2**20:.0f} | "
            f"{r0 / 2**20:.0f} | {r1 / 2**20:.0f} | {r2 / 2**20:.0f} | {(r2 - r0) / r0:+.1%} | "
            f"{c0 / 2**20:.0f} / {c2 / 2**20:.0f} | {(c2 - c0) / c0:+.1%} | {ms(p99(p.loop_lag))} | "
            + (f"{p.server_cpu:.2f} | {p.hostile_cpu:.2f} |" if p.seconds else "- | - |")  # settling: -
        )
    lines += ["", *step_table(phases)]
    by = {p.name: p for p in phases}
    for calm_name, loud_name in (("calm", "hostile"), ("calm (interleaved)", "hostile (interleaved)")):
        if calm_name not in by or loud_name not in by:
            continue
        calm = p99([x for v in by[calm_name].latencies.values() for x in v])
        loud = p99([x for v in by[loud_name].latencies.values() for x in v])
        if calm and loud:
            lines.append("")
            lines.append(
                f"Well-behaved p99 with {args.hostile} hostile clients ({loud_name}): {ms(loud)} ms vs "
                f"{ms(calm)} ms calm ({loud / calm - 1:+.1%}; goal under +20%); hostile: "
                f"{by[loud_name].hostile_connections} connections, {by[loud_name].hostile_events} events."
            )
    for p in phases:
        if p.textless:
            lines.append(f"- {p.name}: {p.textless} text repl(ies) with no text, timed to response.done")
        for failure in p.failures:
            lines.append(f"- {p.name}: {failure}")
    return "\n".join(lines)


def step_table(phases: list[Phase]) -> list[str]:
    """The server's speech steps per phase: how many, their mean, and the share that took longer
    than each of a few bounds (every session of the pipeline waits on such a step)."""
    bounds = (0.05, 0.1, 0.2, 0.5, 1.0)
    lines = [
        "| phase | speech steps | mean (ms) | "
        + " | ".join(f"over {b * 1000:.0f} ms" for b in bounds)
        + " | time in steps over 100 ms |",
        "|---|---|---|" + "---|" * len(bounds) + "---|",
    ]
    for p in phases:
        steps = p.step_buckets.get(float("inf"), 0.0)
        if not steps:
            continue
        over = [1 - p.step_buckets[b] / steps for b in bounds]
        lines.append(
            f"| {p.name} | {steps:.0f} | {p.step_seconds / steps * 1000:.1f} | "
            + " | ".join(f"{x:.1%}" for x in over)
            + f" | {long_step_share(p, 0.1):.0%} |"
        )
    return lines


def long_step_share(phase: Phase, bound: float) -> float:
    """About how much of the steps' time went to steps over ``bound`` (each counted at the middle
    of its bucket; the last bucket at twice its lower bound)."""
    edges = sorted(phase.step_buckets)
    total, over, below, lower = 0.0, 0.0, 0.0, 0.0
    for edge in edges:
        n = phase.step_buckets[edge] - below
        below = phase.step_buckets[edge]
        mid = 2 * lower if edge == float("inf") else (lower + edge) / 2
        total += n * mid
        if lower >= bound:
            over += n * mid
        lower = edge
    return over / total if total else 0.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=100)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="minutes (default: the longest think time plus the longest lifetime, at most half the phase)",
    )
    ap.add_argument("--hostile", type=int, default=10)
    ap.add_argument(
        "--phases",
        default="calm,hostile",
        help="calm and/or hostile, in order, each on a fresh server; or interleaved (both on one)",
    )
    ap.add_argument(
        "--interleave", type=float, default=120.0, help="seconds of each window of --phases interleaved"
    )
    ap.add_argument(
        "--settle", type=float, default=10.0, help="seconds after each switch counted in neither phase"
    )
    ap.add_argument("--hostile-kinds", default="fuzz,slow,huge", help="the hostile clients, in turn")
    ap.add_argument("--think", type=float, nargs=2, default=(40.0, 80.0), metavar=("MIN", "MAX"))
    ap.add_argument("--lifetime", type=float, nargs=2, default=(60.0, 180.0), metavar=("MIN", "MAX"))
    ap.add_argument("--mix", type=float, nargs=3, default=(0.4, 0.4, 0.2), metavar=("TEXT", "AUDIO", "BARGE"))
    ap.add_argument("--reply-tokens", type=int, default=8)
    ap.add_argument("--turn-timeout", type=float, default=60.0)
    ap.add_argument("--fuzz-rate", type=float, default=10.0, help="events per second per fuzzing client")
    ap.add_argument("--huge-mib", type=float, default=4.0)
    ap.add_argument("--rss-every", type=float, default=5.0)
    ap.add_argument("--serve-args", default="", help="extra arguments for omnirt serve")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--log-dir", default=os.environ.get("TMPDIR", "/tmp"))
    ap.add_argument("--save", type=Path, help="also write each phase's turn latencies here (JSON)")
    ap.add_argument(
        "--pool",
        type=Path,
        nargs="+",
        help="run nothing: the p50 / p99 of the turns of several --save files together, by phase",
    )
    args = ap.parse_args(argv)
    if args.warmup is None:
        args.warmup = min((args.think[1] + args.lifetime[1]) / 60, args.minutes / 2)
    return args


def save(phases: list[Phase], path: Path) -> None:
    """Each phase's turn latencies (seconds) by kind, for :func:`pool`."""
    path.write_text(json.dumps({p.name: p.latencies for p in phases}))


def pool(paths: list[Path]) -> str:
    """The turns of several runs together, by phase: a p99 of many runs' turns moves less than
    one run's (the ninth slowest of about 850)."""
    merged: dict[str, list[float]] = {}
    for path in paths:
        for name, kinds in json.loads(path.read_text()).items():
            merged.setdefault(name, []).extend(x for values in kinds.values() for x in values)
    lines = [
        f"Turns of {len(paths)} runs together:",
        "",
        "| phase | turns | p50 (ms) | p99 (ms) |",
        "|---|---|---|---|",
    ]
    for name, values in merged.items():
        lines.append(f"| {name} | {len(values)} | {ms(statistics.median(values))} | {ms(p99(values))} |")
    for calm_name, loud_name in (("calm", "hostile"), ("calm (interleaved)", "hostile (interleaved)")):
        if merged.get(calm_name) and merged.get(loud_name):
            calm, loud = p99(merged[calm_name]), p99(merged[loud_name])
            assert calm and loud
            lines.append("")
            lines.append(
                f"Pooled well-behaved p99 ({loud_name}): {ms(loud)} ms "
                f"vs {ms(calm)} ms calm ({loud / calm - 1:+.1%}; goal under +20%)."
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    if args.pool:
        print(pool(args.pool))
        return 0
    speech = utterances()
    phases: list[Phase] = []
    names = args.phases.split(",")
    if "interleaved" in names and names != ["interleaved"]:
        raise SystemExit("--phases interleaved runs alone (both phases on one server)")
    for name in names:
        log.info(
            "phase %s: %d sessions%s for %g min",
            name,
            args.sessions,
            f" + {args.hostile} hostile" if name != "calm" else "",
            args.minutes,
        )
        phases += asyncio.run(run_server(name, args, speech))
    print(table(phases, args))
    if args.save:
        save(phases, args.save)
    return 0 if all(not p.failed for p in phases) else 1


if __name__ == "__main__":
    sys.exit(main())
