"""Replicas on Ray Serve against one process: the router's added latency per event, and the
realtime sessions served with 1 and 2 replicas (issue 17).

Every server here builds the embedded default models on CPU, as ``omnirt serve`` with no
arguments does, with ``--max-sessions`` room; the clients are raw ``websockets`` / ``httpx`` in
this process (permessage-deflate refused, as ``omnirt serve`` does, unless a row says otherwise).
Three targets, one after the other, all beside the same idle local Ray instance (``--replica-cpus``
CPU slots per replica, a ``--object-store-mib`` object store, no dashboard):

- **single process**: ``omnirt serve`` (the real CLI: ``create_app`` on uvicorn) in a process of
  its own;
- **Ray Serve, 1 replica** and **Ray Serve, 2 replicas**: ``realtime.replicas.deploy`` (what
  ``omnirt serve --replicas N`` runs) behind Ray Serve's HTTP proxy, routed by omnirt's
  ``SessionAwareRouter``; with ``--ingress haproxy`` (``omnirt serve --replicas N --ingress
  haproxy``) behind Ray Serve's HAProxy instead, each replica serving HTTP itself and routing in
  the replicas (``realtime/replicas/ingress.py``), named **Ray Serve (HAProxy), N replicas**.

Torch threads: every server process gets ``OMP_NUM_THREADS`` = ``--replica-cpus`` (at least 1),
the single process included, so it stands for one replica without the router.

**1. Router added latency**: the single process and the 1-replica fleet, both up and idle
side by side (the fleet starts before the single process stops). One realtime session (manual
turns) on each, and ``--round-trips`` sequential round trips of an event the server answers at
once without the model, after ``--warmup-round-trips`` untimed ones; the two sessions take turns,
100 round trips each, so a slower moment of the machine falls on both alike:
``input_audio_buffer.clear`` -> ``input_audio_buffer.cleared`` (77 bytes back),
``session.update`` -> ``session.updated`` (about 530 bytes) and ``conversation.item.retrieve`` ->
``conversation.item.retrieved`` of an item holding 80 ms of audio (about 5.4 KB back, the size
of an 80 ms ``response.output_audio.delta``); then a quarter as many ``GET /v1/models`` on a
kept-alive HTTP connection. The table gives each answer's size in bytes. A round trip is two
crossings of the proxy (the client's event in, the server's event out); the added latency per
one-way event is taken as half the added round trip. A third session takes its turns in the
clear round trips: through Ray with permessage-deflate negotiated (Ray's proxy offers it; the
openai SDK's websockets client accepts it by default). The CPU cores used meanwhile are
printed by group (as for the levels below; ``other`` is the rest of the machine): the hop
through Ray costs CPU time in the proxy and the replica, so on a machine with little to spare
the added latency grows with what else runs there.

**2. Sessions served**: a ramp of concurrent realtime sessions (``--levels``; the next level
runs only while the last passed, then ``--refine`` bisections between the last level that passed
and the first that failed). Each session does manual audio turns, as a person talking: it
streams ``--audio-seconds`` of espeak-ng speech (a speech-like tone when espeak-ng is missing) in
100 ms chunks at real time, sends ``input_audio_buffer.commit`` + ``response.create`` (audio out,
``--reply-tokens`` thinker tokens: random weights always run to the cap), listens to the whole
reply (it waits until the player below would finish it), thinks
0.5 to 1.5 s and speaks again. The sessions stay connected from level to level: a level adds
its new sessions spread over ``--stagger`` seconds, waits until each has done its first turn
(a warm-up, untimed), then times every turn committed in the next ``--level-seconds`` (longer
until at least ``--min-turns`` turns); a bisection below a failing level closes the newest
sessions. Per turn:

- **first audio**: from sending the commit to the first ``response.output_audio.delta``;
- **playback gap**: a player that starts ``--playout-ms`` after the first delta and plays every
  delta as it arrives: the time it waits with nothing to play. No gap = audio made at least at
  real-time rate (``audio made`` is the reply's audio seconds per second of its generation, from
  the first delta to the last, shown at its worst 1%);
- **failed**: an ``error`` event, a close, a reply that ends other than completed/cut at the token
  cap, or no ``response.done`` within ``--turn-timeout``.

Per level also the CPU cores used during the window by the server processes (the single process
or the replicas, with their VAD workers), Ray Serve's proxy, Ray's other processes (raylet, GCS,
Serve's controller, the fleet deployment), this process (the clients) and ``other``: the
machine's busy time beyond those (other programs, time stolen by the hypervisor). A run beside
other work shows it there: measure on a quiet machine.

A level **passes** when no turn failed, the p99 of first audio is at most ``--p99-bound-ms``
(1 s) and the p99 playback gap is under ``--gap-ms`` (20 ms: at most 1% of turns heard a
dropout of 20 ms or more). **Sessions served** is the largest
level that passed (percentiles are nearest-rank: with fewer than 100 turns, p99 is the maximum).

The 1.8x goal (2 replicas holding 1.8x the sessions of one) needs a core per replica slot and
one for Ray's proxy, controller and the clients: cores >= replicas x replica-cpus + 1. The script
says whether this machine has them; the ratio is measured either way.

    python benchmarks/scale.py                    # about 10 minutes on 2 cores
    python benchmarks/scale.py --quick            # about 2.5 minutes
    python benchmarks/scale.py --ingress haproxy  # the fleets behind HAProxy
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import logging
import math
import os
import platform
import random
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import websockets

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.server
from omnirt.realtime.config import ServerConfig  # noqa: E402
from omnirt.stages.cache import default_cache_root  # noqa: E402
from turn_latency import input_audio  # noqa: E402

from tests.server import free_port, serve_cli_process  # noqa: E402

log = logging.getLogger("scale")

CHUNK_S = 0.1
SAMPLE_RATE = 24_000
MANUAL_TURNS = json.dumps(
    {"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"turn_detection": None}}}}
)
CLEAR = json.dumps({"type": "input_audio_buffer.clear"})
#: 80 ms of 24 kHz PCM16 silence: an item holding it is answered, when retrieved, with as many
#: bytes as an 80 ms ``response.output_audio.delta`` carries (its base64 and the JSON around it).
AUDIO_80MS = base64.b64encode(bytes(SAMPLE_RATE * 2 * 80 // 1000)).decode()
AUDIO_ITEM = json.dumps(
    {
        "type": "conversation.item.create",
        "item": {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_audio", "audio": AUDIO_80MS}],
        },
    }
)
COMMIT = json.dumps({"type": "input_audio_buffer.commit"})
SINGLE = "single process"


def ray_target(replicas: int, ingress: str = "proxy") -> str:
    via = " (HAProxy)" if ingress == "haproxy" else ""
    return f"Ray Serve{via}, {replicas} replica{'s' if replicas > 1 else ''}"


# -- statistics (pure) ----------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile: the smallest value with at least q% of them at or
    below it (the maximum for q=99 below 100 values)."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def playback_gap(deltas: list[tuple[float, float]], playout_s: float) -> float:
    """Seconds a player waits with nothing to play: it starts ``playout_s`` after the first
    delta arrives and plays the deltas (``(arrival time, audio seconds)``, in order) back to back,
    each no earlier than it arrived."""
    if not deltas:
        return 0.0
    gap = 0.0
    end = deltas[0][0] + playout_s
    for arrived, seconds in deltas:
        if arrived > end:
            gap += arrived - end
            end = arrived
        end += seconds
    return gap


def audio_rate(deltas: list[tuple[float, float]]) -> float:
    """Audio seconds made per second, from the first delta's arrival to the last's (the audio of
    the first delta excluded: it was made before the clock started). inf for one delta."""
    if len(deltas) < 2:
        return math.inf
    span = deltas[-1][0] - deltas[0][0]
    audio = sum(seconds for _, seconds in deltas[1:])
    return audio / span if span > 0 else math.inf


@dataclass
class Turn:
    first_audio_s: float | None = None
    audio_s: float = 0.0
    gap_s: float = 0.0
    rate: float = math.inf
    error: str | None = None


@dataclass(frozen=True)
class Rule:
    """When a level passes: its p99 first audio at most ``first_audio_s``, its p99 playback gap
    under ``gap_s``."""

    first_audio_s: float
    gap_s: float


@dataclass
class Level:
    target: str
    sessions: int
    turns: list[Turn] = field(default_factory=list)
    #: Seconds the level took (new sessions' start and warm-up, timed turns, the last replies).
    seconds: float = 0.0
    #: CPU cores used during the timed window, per group of processes (see :func:`cpu_seconds`).
    cores: dict[str, float] = field(default_factory=dict)

    @property
    def failed(self) -> list[Turn]:
        return [t for t in self.turns if t.error is not None]

    @property
    def ok(self) -> list[Turn]:
        return [t for t in self.turns if t.error is None]

    def first_audio(self, q: float) -> float | None:
        values = [t.first_audio_s for t in self.ok if t.first_audio_s is not None]
        return pct(values, q) if values else None

    def gap(self, q: float) -> float | None:
        return pct([t.gap_s for t in self.ok], q) if self.ok else None

    def rate(self, q: float) -> float | None:
        return pct([t.rate for t in self.ok], q) if self.ok else None

    def passes(self, rule: Rule) -> bool:
        """No failed turn, p99 first audio and p99 playback gap within ``rule``."""
        if not self.turns or self.failed:
            return False
        p99_first, p99_gap = self.first_audio(99), self.gap(99)
        return (
            p99_first is not None
            and p99_first <= rule.first_audio_s
            and p99_gap is not None
            and p99_gap < rule.gap_s
        )


def sessions_served(levels: list[Level], rule: Rule) -> Level | None:
    """The largest level that passed and that has no failing level at or below it (a ramp
    stops at its first failure; later levels only bisect below it)."""
    ordered = sorted(levels, key=lambda lv: lv.sessions)
    best = None
    for level in ordered:
        if not level.passes(rule):
            break
        best = level
    return best


def next_level(tried: list[Level], levels: list[int], rule: Rule, refine: int) -> int | None:
    """The ramp: the next of ``levels`` while every level so far passed; after the first failure,
    up to ``refine`` bisections between the largest pass below it and it; None when done."""
    done = {lv.sessions for lv in tried}
    failing = [lv.sessions for lv in tried if not lv.passes(rule)]
    if not failing:
        rest = [n for n in levels if n not in done and n > max(done, default=0)]
        return rest[0] if rest else None
    ceiling = min(failing)
    bisections = len([lv for lv in tried if lv.sessions not in levels])
    if bisections >= refine:
        return None
    served = sessions_served(tried, rule)
    floor = served.sessions if served is not None else 0
    mid = (floor + ceiling) // 2
    return mid if mid > floor and mid not in done else None


# -- the servers ----------------------------------------------------------------------------------


@contextlib.contextmanager
def single_process(args: argparse.Namespace, log_dir: Path) -> Iterator[str]:
    """``omnirt serve`` as a user runs it (no model argument: the embedded defaults)."""
    serve_args = ["--max-sessions", str(args.max_sessions), "--log-level", "warning"]
    serve_args += shlex.split(args.serve_args)
    with serve_cli_process(
        serve_args, cache=default_cache_root(), log=log_dir / "single.log", start_timeout=300
    ) as (base, _):
        yield base


@contextlib.contextmanager
def ray_instance(args: argparse.Namespace) -> Iterator[None]:
    """A local Ray instance with CPU slots for the largest fleet; stopped (Serve too) at the end."""
    import ray
    from omnirt.realtime.replicas.launch import set_serve_env

    if args.ingress == "haproxy":
        # HAProxy's files in a folder of the run's own (Ray's default is shared by every Ray here).
        files = tempfile.mkdtemp(prefix="omnirt-hap-")
        os.environ.setdefault("RAY_SERVE_HAPROXY_CONFIG_FILE_LOC", f"{files}/haproxy.cfg")
        os.environ.setdefault("RAY_SERVE_HAPROXY_SOCKET_PATH", f"{files}/admin.sock")
        os.environ.setdefault("RAY_SERVE_HAPROXY_SERVER_STATE_BASE", files)
        os.environ.setdefault("RAY_SERVE_HAPROXY_SERVER_STATE_FILE", f"{files}/server-state")
    # Ray Serve's settings (and HAProxy's), as `omnirt serve --replicas` starts Ray.
    set_serve_env(ingress=args.ingress)
    ray.init(
        address="local",  # a fresh instance of its own, never one that `ray start` left running
        num_cpus=max(args.replicas) * args.replica_cpus,
        object_store_memory=args.object_store_mib * 2**20,
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        yield
    finally:
        from ray import serve

        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


@contextlib.contextmanager
def ray_fleet(args: argparse.Namespace, replicas: int) -> Iterator[str]:
    """``replicas`` omnirt replicas (the embedded defaults) behind Ray Serve's proxy, once all
    report to the fleet's ``/health``; removed at the end."""
    from omnirt.realtime.replicas import ReplicaOptions, deploy
    from ray import serve

    config = ServerConfig(port=free_port(), max_sessions=args.max_sessions)
    options = ReplicaOptions(
        replicas=replicas, cpus_per_replica=args.replica_cpus, drain_seconds=2.0, ingress=args.ingress
    )
    t0 = time.monotonic()
    base = deploy(config, options, device="cpu", log_level="warning")
    try:
        deadline = time.monotonic() + 300
        while True:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                if httpx.get(base + "/health", timeout=5).json()["replicas_serving"] == replicas:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{replicas} replicas did not come up in 300 s")
            time.sleep(0.5)
        log.info("%d replica(s) serving on %s after %.0f s", replicas, base, time.monotonic() - t0)
        yield base
    finally:
        with contextlib.suppress(Exception):
            serve.delete(options.app_name)
        serve.shutdown()


CPU_GROUPS = ("server", "proxy", "ray", "client", "other")


#: Process id -> its group, once known (a Ray worker starts as ``ray::IDLE`` and later names
#: the actor it became; its title changes with the method it runs).
_GROUPS: dict[tuple[int, float], str] = {}


def process_group(proc: psutil.Process) -> str:
    """Which part of the run a process is: ``server`` (the single process or a replica, with
    their VAD workers), ``proxy`` (Ray Serve's HTTP proxy), ``ray`` (Ray's other processes:
    raylet, GCS, Serve's controller, the fleet deployment), ``client`` (this process). With the
    HAProxy ingress, ``proxy`` is HAProxy (and Ray Serve's fallback proxy, idle)."""
    if proc.pid == os.getpid():
        return "client"
    try:
        key = (proc.pid, proc.create_time())  # process ids are reused
        if key in _GROUPS:
            return _GROUPS[key]
        command = " ".join(proc.cmdline())
    except psutil.Error:
        return "ray"
    if "ProxyActor" in command or "SERVE_PROXY_ACTOR" in command or "bin/haproxy" in command:
        _GROUPS[key] = "proxy"
    elif any(name in command for name in ("OmnirtReplica", "omnirt.realtime.cli", "omnirt.vad.process")):
        _GROUPS[key] = "server"
    return _GROUPS.get(key, "ray")


def cpu_seconds() -> dict[str, float]:
    """CPU seconds so far of this process and all it started (the server, Ray's processes), by
    :func:`process_group`, and ``other``: the machine's busy CPU seconds less those (whatever else
    runs here: a run beside others measures them too)."""
    out = dict.fromkeys(CPU_GROUPS, 0.0)
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            out[process_group(proc)] += times.user + times.system
    machine = psutil.cpu_times()
    busy = sum(machine) - machine.idle - getattr(machine, "iowait", 0.0)
    # Guest time is counted in user time too.
    busy -= getattr(machine, "guest", 0.0) + getattr(machine, "guest_nice", 0.0)
    out["other"] = busy - sum(out.values())
    return out


def server_threads() -> set[str]:
    """``OMP_NUM_THREADS`` as the server processes (the single process, the replicas) see it."""
    out = set()
    me = psutil.Process()
    for proc in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if process_group(proc) == "server" and "omnirt.vad.process" not in " ".join(proc.cmdline()):
                out.add(proc.environ().get("OMP_NUM_THREADS", "unset"))
    return out


def speech_model(base: str) -> str:
    models = httpx.get(base + "/v1/models", timeout=30).json()["data"]
    return next(m["id"] for m in models if m.get("kind") == "speech")


# -- 1. round trips -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Lane:
    """One client of the round trips: a target and whether it negotiates permessage-deflate."""

    name: str
    base: str
    deflate: bool = False


async def retrieve_audio_item(ws: Any) -> str:
    """Adds an item holding 80 ms of audio to the session; the event that retrieves it."""
    await ws.send(AUDIO_ITEM)
    added = await until(ws, "conversation.item.added", 60)
    return json.dumps({"type": "conversation.item.retrieve", "item_id": added["item"]["id"]})


@dataclass
class RoundTrips:
    """Seconds per round trip by lane, and the size of the last answer (bytes of its frame)."""

    seconds: dict[str, list[float]]
    answer_bytes: int = 0


async def ws_lanes(
    lanes: list[Lane],
    model: str,
    send: str | None,
    reply: str,
    n: int,
    warmup: int,
    chunk: int,
    prepare: Any = None,
) -> RoundTrips:
    """Seconds per round trip (``send`` out, until an event of type ``reply`` is back) over one
    realtime session per lane; the lanes take turns, ``chunk`` round trips each, so a slower or
    busier moment of the machine falls on all of them alike. ``prepare(ws)``, when given, sets
    each session up and returns the event to send (``send`` is then unused)."""
    async with contextlib.AsyncExitStack() as stack:
        sockets = {}
        for lane in lanes:
            url = lane.base.replace("http://", "ws://") + f"/v1/realtime?model={model}"
            ws = await stack.enter_async_context(
                websockets.connect(
                    url, max_size=None, compression="deflate" if lane.deflate else None, open_timeout=60
                )
            )
            extensions = ws.response.headers.get("sec-websocket-extensions") or ""
            if lane.deflate and "permessage-deflate" not in extensions:
                raise RuntimeError(f"{lane.name}: permessage-deflate was not negotiated")
            await until(ws, "session.created", 60)
            await ws.send(MANUAL_TURNS)
            await until(ws, "session.updated", 60)
            sockets[lane.name] = (ws, await prepare(ws) if prepare is not None else send)
        out: dict[str, list[float]] = {lane.name: [] for lane in lanes}
        answer = 0

        async def burst(lane: Lane, count: int, keep: bool) -> None:
            nonlocal answer
            ws, event = sockets[lane.name]
            for _ in range(count):
                t0 = time.perf_counter()
                await ws.send(event)
                frame = await until_frame(ws, reply, 30)
                if keep:
                    out[lane.name].append(time.perf_counter() - t0)
                answer = len(frame.encode())

        for lane in lanes:
            await burst(lane, warmup, keep=False)
        while len(out[lanes[0].name]) < n:
            count = min(chunk, n - len(out[lanes[0].name]))
            for lane in lanes:
                await burst(lane, count, keep=True)
        return RoundTrips(out, answer)


def http_lanes(lanes: list[Lane], path: str, n: int, warmup: int, chunk: int) -> RoundTrips:
    """As :func:`ws_lanes`, for ``GET path`` on one kept-alive connection per lane."""
    with contextlib.ExitStack() as stack:
        clients = {
            lane.name: stack.enter_context(httpx.Client(base_url=lane.base, timeout=30)) for lane in lanes
        }
        out: dict[str, list[float]] = {lane.name: [] for lane in lanes}
        answer = 0

        def burst(lane: Lane, count: int, keep: bool) -> None:
            nonlocal answer
            for _ in range(count):
                t0 = time.perf_counter()
                response = clients[lane.name].get(path).raise_for_status()
                if keep:
                    out[lane.name].append(time.perf_counter() - t0)
                answer = len(response.content)

        for lane in lanes:
            burst(lane, warmup, keep=False)
        while len(out[lanes[0].name]) < n:
            count = min(chunk, n - len(out[lanes[0].name]))
            for lane in lanes:
                burst(lane, count, keep=True)
        return RoundTrips(out, answer)


CLEAR_PROBE = "WS input_audio_buffer.clear -> cleared"
UPDATE_PROBE = "WS session.update -> updated"
AUDIO_PROBE = "WS conversation.item.retrieve -> retrieved (80 ms of audio)"
#: The realtime events whose added latency is held against the goal (under 1 ms per one-way event).
WS_PROBES = (CLEAR_PROBE, UPDATE_PROBE, AUDIO_PROBE)
DEFLATE_PROBE = "WS clear -> cleared, deflate negotiated through Ray (single process: without)"
#: Sessions the round trips hold on the fleet at once (plain and permessage-deflate).
ROUND_TRIP_SESSIONS = 2
#: Round trips a lane does before the others take their turn.
CHUNK = 100


@dataclass
class RoundTripRow:
    """One event: round trip seconds of the single process and through Ray, the answer's bytes."""

    single: list[float]
    ray: list[float]
    answer_bytes: int


def measure_round_trips(
    single: str, ray: str, args: argparse.Namespace
) -> tuple[dict[str, RoundTripRow], str]:
    """Per event, measured interleaved (:class:`RoundTripRow`); and the CPU cores used meanwhile,
    by group (a line to print)."""
    model = speech_model(single)
    n, warmup = args.round_trips, args.warmup_round_trips
    both = [Lane("single", single), Lane("ray", ray)]
    before, started = cpu_seconds(), time.monotonic()
    clear = asyncio.run(
        ws_lanes(
            [*both, Lane("deflate", ray, deflate=True)],
            model,
            CLEAR,
            "input_audio_buffer.cleared",
            n,
            warmup,
            CHUNK,
        )
    )
    update = asyncio.run(ws_lanes(both, model, MANUAL_TURNS, "session.updated", n, warmup, CHUNK))
    audio = asyncio.run(
        ws_lanes(
            both, model, None, "conversation.item.retrieved", n, warmup, CHUNK, prepare=retrieve_audio_item
        )
    )
    http = http_lanes(both, "/v1/models", max(1, n // 4), max(1, warmup // 4), CHUNK // 4)
    used = cpu_seconds()
    seconds = time.monotonic() - started
    cores = " / ".join(f"{(used[g] - before[g]) / seconds:.2f}" for g in CPU_GROUPS)
    rows = {
        CLEAR_PROBE: RoundTripRow(clear.seconds["single"], clear.seconds["ray"], clear.answer_bytes),
        UPDATE_PROBE: RoundTripRow(update.seconds["single"], update.seconds["ray"], update.answer_bytes),
        AUDIO_PROBE: RoundTripRow(audio.seconds["single"], audio.seconds["ray"], audio.answer_bytes),
        "HTTP GET /v1/models": RoundTripRow(http.seconds["single"], http.seconds["ray"], http.answer_bytes),
        DEFLATE_PROBE: RoundTripRow(clear.seconds["single"], clear.seconds["deflate"], clear.answer_bytes),
    }
    for name, r in rows.items():
        log.info(
            "%s: p50 %.3f ms alone, %.3f ms through Ray", name, pct(r.single, 50) * 1e3, pct(r.ray, 50) * 1e3
        )
    line = f"CPU cores used during the round trips ({', '.join(CPU_GROUPS)}): {cores}, over {seconds:.0f} s"
    log.info("%s", line)
    return rows, line


# -- 2. sessions ----------------------------------------------------------------------------------


class TurnFailed(Exception):
    pass


async def until_frame(ws: Any, kind: str, timeout: float) -> str:
    """The next frame carrying an event of type ``kind``, as sent (``TurnFailed`` on an error)."""
    async with asyncio.timeout(timeout):
        while True:
            frame = await ws.recv()
            event = json.loads(frame)
            if event["type"] == "error":
                raise TurnFailed(f"error {event['error'].get('code')}: {event['error'].get('message')}"[:200])
            if event["type"] == kind:
                return frame


async def until(ws: Any, kind: str, timeout: float) -> dict[str, Any]:
    return json.loads(await until_frame(ws, kind, timeout))


@dataclass(frozen=True)
class Workload:
    url: str
    appends: list[str]
    response_create: str
    playout_s: float
    turn_timeout_s: float


async def sleep_until(t: float) -> None:
    await asyncio.sleep(max(0.0, t - time.monotonic()))


class Person:
    """One realtime session used as a person would: speak, hear the whole reply, think, speak
    again. Its first turn on each connection is a warm-up (untimed); it reconnects after a
    failure (recorded as a failed turn)."""

    def __init__(self, w: Workload, delay: float, rng: random.Random) -> None:
        self.w = w
        self.delay = delay
        self.rng = rng
        #: (commit time, turn) of every timed turn, and failures at the time they happened.
        self.turns: list[tuple[float, Turn]] = []
        #: Its warm-up turn is done (or it failed): the level's window may start.
        self.warmed = asyncio.Event()
        #: When the timed turn in flight was committed (None between turns and in warm-up turns).
        self.committed: float | None = None
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    def timed_since(self, start: float) -> int:
        """Timed turns committed (or failures) since ``start``, the one in flight included."""
        done = sum(1 for at, _ in self.turns if at >= start)
        return done + (self.committed is not None and self.committed >= start)

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), max(0.0, seconds))

    async def run(self) -> None:
        await self._pause(self.delay)
        while not self._stop.is_set():
            try:
                async with websockets.connect(
                    self.w.url, max_size=None, compression=None, open_timeout=60
                ) as ws:
                    await until(ws, "session.created", 60)
                    await ws.send(MANUAL_TURNS)
                    await until(ws, "session.updated", 60)
                    first = True
                    while not self._stop.is_set():
                        committed, turn, heard = await self.turn(ws, timed=not first)
                        if not first:
                            self.turns.append((committed, turn))
                        first = False
                        self.warmed.set()
                        await self._pause(heard + self.rng.uniform(0.5, 1.5) - time.monotonic())
            except (TurnFailed, TimeoutError, websockets.ConnectionClosed, OSError) as exc:
                self.turns.append((time.monotonic(), Turn(error=f"{type(exc).__name__}: {exc}"[:200])))
                self.committed = None
                self.warmed.set()
                await self._pause(1.0)

    async def turn(self, ws: Any, timed: bool) -> tuple[float, Turn, float]:
        """Speak at real time, ask for the reply, receive it: the commit time, the turn, and when
        its playback ends. A timed turn in flight shows in ``committed``."""
        w = self.w
        start = time.monotonic()
        for i, append in enumerate(w.appends):
            await sleep_until(start + i * CHUNK_S)
            await ws.send(append)
        await sleep_until(start + len(w.appends) * CHUNK_S)
        t0 = time.monotonic()
        self.committed = t0 if timed else None
        await ws.send(COMMIT)
        await ws.send(w.response_create)
        deltas: list[tuple[float, float]] = []
        async with asyncio.timeout(w.turn_timeout_s):
            while True:
                event = json.loads(await ws.recv())
                kind = event["type"]
                if kind == "response.output_audio.delta":
                    audio = len(base64.b64decode(event["delta"])) / 2 / SAMPLE_RATE
                    deltas.append((time.monotonic(), audio))
                elif kind == "error":
                    error = event["error"]
                    raise TurnFailed(f"error {error.get('code')}: {error.get('message')}"[:200])
                elif kind == "response.done":
                    response = event["response"]
                    reason = (response.get("status_details") or {}).get("reason")
                    if not (
                        response["status"] == "completed"
                        or (response["status"] == "incomplete" and reason == "max_output_tokens")
                    ):
                        raise TurnFailed(f"response {response['status']} ({reason})")
                    break
        self.committed = None
        if not deltas:
            raise TurnFailed("a reply without audio")
        gap = playback_gap(deltas, w.playout_s)
        audio = sum(seconds for _, seconds in deltas)
        turn = Turn(first_audio_s=deltas[0][0] - t0, audio_s=audio, gap_s=gap, rate=audio_rate(deltas))
        return t0, turn, deltas[0][0] + w.playout_s + audio + gap


async def run_ramp(w: Workload, target: str, args: argparse.Namespace) -> list[Level]:
    """The sessions stay connected from level to level: a level adds sessions (spread over
    ``--stagger`` s), waits for their warm-up turns, then times every turn committed during
    ``--level-seconds``; a bisection below a failing level closes the newest sessions first."""
    rule = args.rule
    rng = random.Random(1)
    people: list[tuple[Person, asyncio.Task[None]]] = []
    tried: list[Level] = []
    try:
        while (n := next_level(tried, args.levels, rule, args.refine)) is not None:
            t0 = time.monotonic()
            added = n - len(people)
            for i in range(max(0, added)):
                person = Person(w, args.stagger * i / added, random.Random(rng.random()))
                people.append((person, asyncio.create_task(person.run())))
            while len(people) > n:
                person, task = people.pop()
                person.stop()
                await task
            await asyncio.wait_for(
                asyncio.gather(*(p.warmed.wait() for p, _ in people)), args.stagger + 2 * w.turn_timeout_s
            )
            start, cpu0 = time.monotonic(), cpu_seconds()
            await asyncio.sleep(args.level_seconds)
            # At least --min-turns turns (a level of few sessions waits for more of their turns).
            while sum(p.timed_since(start) for p, _ in people) < args.min_turns:
                await asyncio.sleep(0.05)
            end, cpu1 = time.monotonic(), cpu_seconds()
            # Turns committed in the window and still in flight count too: wait for them.
            deadline = end + w.turn_timeout_s + 1
            while any(p.committed is not None and p.committed < end for p, _ in people):
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
            turns = [turn for p, _ in people for at, turn in p.turns if start <= at < end]
            cores = {group: (cpu1[group] - cpu0[group]) / (end - start) for group in CPU_GROUPS}
            level = Level(target, n, turns, time.monotonic() - t0, cores)
            tried.append(level)
            log_level(level, rule)
    finally:
        for person, _ in people:
            person.stop()
        await asyncio.gather(*(task for _, task in people), return_exceptions=True)
    return tried


def log_level(level: Level, rule: Rule) -> None:
    p99, gap = level.first_audio(99), level.gap(99)
    log.info(
        "%s, %d sessions: %d turns, %d failed, first audio p99 %s ms, p99 gap %s ms (%.0f s): %s",
        level.target,
        level.sessions,
        len(level.turns),
        len(level.failed),
        ms(p99),
        ms(gap),
        level.seconds,
        "pass" if level.passes(rule) else "FAIL",
    )
    for turn in level.failed[:3]:
        log.info("  failed turn: %s", turn.error)


def ramp(base: str, target: str, args: argparse.Namespace, pcm: bytes) -> list[Level]:
    model = speech_model(base)
    step = int(CHUNK_S * SAMPLE_RATE) * 2
    appends = [
        json.dumps(
            {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm[i : i + step]).decode()}
        )
        for i in range(0, len(pcm), step)
    ]
    create = json.dumps(
        {
            "type": "response.create",
            "response": {"output_modalities": ["audio"], "max_output_tokens": args.reply_tokens},
        }
    )
    url = base.replace("http://", "ws://") + f"/v1/realtime?model={model}"
    w = Workload(url, appends, create, args.playout_ms / 1e3, args.turn_timeout)
    threads = server_threads()
    if threads != {os.environ["OMP_NUM_THREADS"]}:
        raise RuntimeError(f"{target}: the server processes have OMP_NUM_THREADS {threads}")
    return asyncio.run(run_ramp(w, target, args))


# -- report ---------------------------------------------------------------------------------------


def ms(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value * 1e3:.{digits}f}"


def row(cells: list[object]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def latency_table(rows: dict[str, RoundTripRow], ray_name: str) -> str:
    head = [
        "event",
        "answer (bytes)",
        "n",
        f"{SINGLE} p50 (ms)",
        "p99 (ms)",
        f"{ray_name} p50 (ms)",
        "p99 (ms)",
        "added per round trip p50 (ms)",
        "p99 (ms)",
        "added per one-way event p50 (ms)",
    ]
    lines = [row(head), "|" + "---|" * len(head)]
    for name, r in rows.items():
        base, own = r.single, r.ray
        d50 = pct(own, 50) - pct(base, 50)
        d99 = pct(own, 99) - pct(base, 99)
        times = [pct(base, 50), pct(base, 99), pct(own, 50), pct(own, 99), d50, d99, d50 / 2]
        lines.append(row([name, r.answer_bytes, len(own), *(ms(t, 3) for t in times)]))
    return "\n".join(lines)


def added_one_way(r: RoundTripRow) -> float:
    """Seconds an event adds through Ray, one way: half the added round trip (p50)."""
    return (pct(r.ray, 50) - pct(r.single, 50)) / 2


def ramp_table(levels: list[Level], rule: Rule) -> str:
    head = [
        "target",
        "sessions",
        "timed turns",
        "failed",
        "first audio p50 (ms)",
        "p99 (ms)",
        f"turns with a gap >= {rule.gap_s * 1e3:g} ms",
        "audio made, worst 1% (x real time)",
        "CPU cores: server / proxy / rest of Ray / client / other",
        "level",
    ]
    lines = [row(head), "|" + "---|" * len(head)]
    for lv in levels:
        rate = lv.rate(1)
        cells = [
            lv.target,
            lv.sessions,
            len(lv.turns),
            len(lv.failed),
            ms(lv.first_audio(50)),
            ms(lv.first_audio(99)),
            sum(1 for t in lv.ok if t.gap_s >= rule.gap_s),
            "-" if rate is None else f"{rate:.1f}",
            " / ".join(f"{lv.cores.get(group, 0.0):.2f}" for group in CPU_GROUPS),
            "pass" if lv.passes(rule) else "fail",
        ]
        lines.append(row(cells))
    return "\n".join(lines)


def summary_table(ramps: dict[str, list[Level]], rule: Rule, baseline: str) -> str:
    lines = [
        "| target | sessions served | first audio p99 there (ms) | vs " + baseline + " |",
        "|---|---|---|---|",
    ]
    base_level = sessions_served(ramps.get(baseline, []), rule)
    base = base_level.sessions if base_level else 0
    for target, levels in ramps.items():
        served = sessions_served(levels, rule)
        n = served.sessions if served else 0
        ratio = f"{n / base:.2f}x" if base else "-"
        lines.append(f"| {target} | {n} | {ms(served.first_audio(99) if served else None)} | {ratio} |")
    return "\n".join(lines)


def machine() -> tuple[int, str]:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    try:
        import torch

        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    except ImportError:
        gpu = "no GPU"
    return cores, f"{cores} cores ({platform.processor() or platform.machine()}), {mem:.0f} GiB, {gpu}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a short run (about 2.5 minutes): fewer round trips, levels 1 8 16 of 5 s",
    )
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2], help="fleet sizes to measure")
    ap.add_argument(
        "--replica-cpus", type=float, default=1.0, help="Ray CPU slots (and torch threads) per replica"
    )
    ap.add_argument("--object-store-mib", type=int, default=128)
    ap.add_argument(
        "--ingress",
        choices=("proxy", "haproxy"),
        default="proxy",
        help="the fleets' ingress (omnirt serve --replicas --ingress): Ray Serve's proxy or HAProxy",
    )
    ap.add_argument(
        "--round-trips", type=int, default=None, help="timed WebSocket round trips (HTTP: a quarter)"
    )
    ap.add_argument("--warmup-round-trips", type=int, default=200)
    ap.add_argument("--levels", type=int, nargs="+", default=None, help="session counts of the ramp")
    ap.add_argument("--refine", type=int, default=None, help="bisections after the first failing level")
    ap.add_argument("--level-seconds", type=float, default=None, help="timed seconds per level")
    ap.add_argument(
        "--min-turns", type=int, default=None, help="a level's window lasts until this many turns (default 3)"
    )
    ap.add_argument(
        "--stagger",
        type=float,
        default=3.0,
        help="a level's new sessions start spread over this many seconds",
    )
    ap.add_argument("--audio-seconds", type=float, default=1.0, help="speech per user turn")
    ap.add_argument("--audio", choices=("auto", "espeak", "tone"), default="auto")
    ap.add_argument(
        "--reply-tokens", type=int, default=8, help="thinker tokens per reply (8: about 4.5 s of audio)"
    )
    ap.add_argument(
        "--p99-bound-ms", type=float, default=1000.0, help="a level passes with p99 first audio under this"
    )
    ap.add_argument(
        "--gap-ms",
        type=float,
        default=20.0,
        help="a level passes with the p99 turn's playback gap under this",
    )
    ap.add_argument("--playout-ms", type=float, default=200.0, help="the player's buffer before it starts")
    ap.add_argument("--turn-timeout", type=float, default=60.0)
    ap.add_argument(
        "--max-sessions",
        type=int,
        default=None,
        help="session slots per server (default: the top level, at least 2: the round trips hold two "
        "sessions on the fleet)",
    )
    ap.add_argument("--serve-args", default="", help="more arguments for the single process's omnirt serve")
    ap.add_argument(
        "--skip-single", action="store_true", help="no single-process baseline (no router row then)"
    )
    ap.add_argument("--log-dir", default=None)
    args = ap.parse_args(argv)
    quick = args.quick
    if args.round_trips is None:
        args.round_trips = 300 if quick else 2000
    if args.levels is None:
        args.levels = [1, 8, 16] if quick else [1, 8, 12, 16, 24, 32, 48, 64]
    if args.refine is None:
        args.refine = 0 if quick else 1
    if args.min_turns is None:
        args.min_turns = 1 if quick else 3
    if args.level_seconds is None:
        args.level_seconds = 5.0 if quick else 20.0
    if quick:
        args.warmup_round_trips = min(args.warmup_round_trips, 100)
    if min(args.replicas) < 1:
        ap.error("--replicas must be at least 1")
    args.rule = Rule(args.p99_bound_ms / 1e3, args.gap_ms / 1e3)
    if args.max_sessions is None:
        args.max_sessions = max(*args.levels, ROUND_TRIP_SESSIONS)
    if args.replica_cpus <= 0:
        ap.error("--replica-cpus must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    started = time.monotonic()
    cores, hardware = machine()
    threads = max(1, math.floor(args.replica_cpus))
    # Every server process started from here on (the single process, Ray's workers) reads it.
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ.setdefault("OMNIRT_CACHE", str(default_cache_root()))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="omnirt-scale-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    pcm, what = input_audio(args.audio_seconds, args.audio)
    load_before = os.getloadavg()
    rule = args.rule

    round_trips: dict[str, RoundTripRow] = {}
    round_trip_cpu = ""
    ramps: dict[str, list[Level]] = {}
    with ray_instance(args), contextlib.ExitStack() as single_stack:
        single = None
        if not args.skip_single:
            single = single_stack.enter_context(single_process(args, log_dir))
            ramps[SINGLE] = ramp(single, SINGLE, args, pcm)
        for replicas in args.replicas:
            with ray_fleet(args, replicas) as base:
                if single is not None:
                    # Both idle, side by side: the round trips take turns between them.
                    round_trips, round_trip_cpu = measure_round_trips(single, base, args)
                    single_stack.close()
                    single = None
                target = ray_target(replicas, args.ingress)
                ramps[target] = ramp(base, target, args, pcm)

    command = "python benchmarks/scale.py " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    print()
    print(f"# {command.strip()}")
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M %Z')}; {hardware}; load average before {load_before[0]:.2f}, "
        f"after {os.getloadavg()[0]:.2f}; run took {(time.monotonic() - started) / 60:.1f} min"
    )
    print(
        f"# embedded default models on CPU, {threads} torch thread(s) per server process, "
        f"{args.replica_cpus:g} Ray CPU slot(s) per replica; turns: {args.audio_seconds:g} s of {what} "
        f"streamed at real time, replies of {args.reply_tokens} thinker tokens (audio); "
        f"a level passes with p99 first audio <= {args.p99_bound_ms:.0f} ms and p99 playback gap "
        f"< {args.gap_ms:g} ms (player buffer {args.playout_ms:.0f} ms)"
    )
    print()
    ray_one = ray_target(min(args.replicas), args.ingress)
    if round_trips:
        print("## Router added latency (idle servers, sequential round trips, taking turns)\n")
        print(latency_table(round_trips, ray_one))
        print(f"\n{round_trip_cpu}.\n")
        for name in WS_PROBES:
            added = added_one_way(round_trips[name])
            print(
                f"Added per one-way event, {name} ({round_trips[name].answer_bytes} bytes back; half the "
                f"added round trip, p50): {added * 1e3:.3f} ms; goal under 1 ms: "
                f"{'met' if added < 1e-3 else 'NOT met'}."
            )
        print()
    print(
        f"## Sessions: ramp (levels {' '.join(map(str, args.levels))}, {args.level_seconds:g} s timed each)\n"
    )
    print(ramp_table([lv for levels in ramps.values() for lv in levels], rule))
    print()
    baseline = ray_one if ray_one in ramps else next(iter(ramps))
    print(summary_table(ramps, rule, baseline))
    two, one = ray_target(2, args.ingress), ray_target(1, args.ingress)
    if two in ramps and one in ramps:
        one_served = sessions_served(ramps[one], rule)
        two_served = sessions_served(ramps[two], rule)
        ratio = (two_served.sessions if two_served else 0) / one_served.sessions if one_served else None
        needed = 2 * math.ceil(args.replica_cpus) + 1
        verdict = "met" if ratio is not None and ratio >= 1.8 else "NOT met"
        if cores < needed:
            applies = (
                f"the 1.8x goal does not apply on this machine: {cores} cores < {needed} (2 replicas x "
                f"{args.replica_cpus:g} CPUs + 1 for Ray's proxy, controller and the clients)"
            )
        else:
            applies = f"goal 1.8x: {verdict}"
        print(f"\n2 replicas / 1 replica: {'-' if ratio is None else f'{ratio:.2f}x'}; {applies}.")
    log.info("logs of the single process: %s", log_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
