"""Server VAD capacity: how many sessions streaming real-time audio one server keeps up with.

Starts the server in this process (uvicorn on loopback, the real Engine) with a pipeline that
does not generate here: every session sets ``turn_detection`` server_vad with
``create_response: false``, so no response ever runs and the model is idle; what is measured is
the WebSocket + session + VAD path alone. (The pipeline is ``tests.fakes.EchoPipeline``; it only
runs in the barge-in part.)

For each level N (default 1, 50, 100, 200) a client *process* (so its JSON and base64 work does
not share the server's GIL) opens N sessions, then each streams 24 kHz PCM16 in ``--chunk-ms``
chunks paced by the clock for ``--seconds``: real speech (espeak-ng, a sentence between 1 s
silences) looped, each session starting at its own offset, sends spread evenly over a chunk
interval. Reported per level:

- **VAD decision latency p50 / p99**: server-side, per 32 ms window, from the moment the append
  that completed the window reached the session (after the frame was parsed and decoded) to
  the moment the endpointer decided on it on the event loop (the trip to the VAD process, its
  wait for the next pass, the model call and the trip back included). Goal: p99 < 20 ms at 200
  sessions.
- **windows/s** scored and the real-time need (N * 31.25), **mean batch**: windows per model
  call, **VAD busy**: share of wall time the VAD process spent scoring (both over the time the
  client took to send its audio: longer than ``--seconds`` when it fell behind).
- **server / VAD / client CPU**: CPU time of the server process (every thread: event loop,
  engine), of the VAD process and of the client process, in cores, over the same time.
- **send lag p99**: how late the client got its chunks out against the clock (a client or
  loop that cannot keep up shows here), **speech turns**: ``speech_stopped`` events received
  (sanity: the VAD found the speech), **errors**: error events (``input_backpressure`` when
  the VAD falls behind).

Then the **barge-in delay**: one session with server VAD gets a long streaming reply
(EchoPipeline, one 80 ms word per 30 ms step) and speech is streamed in real time in 20 ms
chunks; the delay runs from sending the chunk that holds the true speech onset to receiving
``response.done`` (cancelled, ``turn_detected``). Repeated ``--barge-ins`` times, idle server.

    python benchmarks/vad_capacity.py --sessions 1 50 100 200 --seconds 10

The server refuses permessage-deflate, as ``omnirt serve`` does, unless ``--server-deflate``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import gc
import json
import logging
import math
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from omnirt.realtime.config import ServerConfig  # noqa: E402

from tests.vad.speech import RATE, SENTENCES, place, spoken  # noqa: E402
from tests.vad.speech import to_pcm16 as pcm16  # noqa: E402

#: Every session: server VAD on, no response (the model stays idle).
VAD_UPDATE = json.dumps(
    {
        "type": "session.update",
        "session": {
            "type": "realtime",
            "audio": {"input": {"turn_detection": {"type": "server_vad", "create_response": False}}},
        },
    }
)


# -- audio --------------------------------------------------------------------------------------
def speech_loop() -> tuple[np.ndarray, float]:
    """1 s silence + speech + 1 s silence (float32, 24 kHz, white noise at -50 dB over it), and
    the true onset (ms)."""
    if shutil.which("espeak-ng") is None or shutil.which("sox") is None:
        raise SystemExit("needs espeak-ng and sox (apt-get install -y espeak-ng sox)")
    placed = place(spoken(SENTENCES[0]), lead_ms=1000, tail_ms=1000, noise_db=20 * math.log10(0.003))
    return placed.audio, placed.start_ms


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def niceness(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


# -- the client process -------------------------------------------------------------------------
async def _capacity_client(
    url: str, n: int, seconds: float, chunk_ms: int, audio: bytes, deflate: bool, out: Any
) -> None:
    import websockets

    step = RATE * 2 * chunk_ms // 1000
    chunks = [
        json.dumps(
            {"type": "input_audio_buffer.append", "audio": base64.b64encode(audio[i : i + step]).decode()}
        )
        for i in range(0, len(audio) - step + 1, step)
    ]
    counts: dict[str, int] = {}
    lags: list[float] = []
    conns = []
    for _ in range(n):
        ws = await websockets.connect(
            url, max_size=2**24, ping_interval=None, compression="deflate" if deflate else None
        )
        await ws.recv()
        await ws.send(VAD_UPDATE)
        while json.loads(await ws.recv())["type"] != "session.updated":
            pass
        conns.append(ws)

    async def reader(ws: Any) -> None:
        try:
            async for frame in ws:
                kind = json.loads(frame)["type"]
                counts[kind] = counts.get(kind, 0) + 1
        except websockets.ConnectionClosed:
            pass

    readers = [asyncio.create_task(reader(ws)) for ws in conns]
    out.put(("ready", None))
    await asyncio.sleep(0.3)
    t0 = time.perf_counter() + 0.1
    cpu0 = time.process_time()
    interval = chunk_ms / 1000
    total = int(seconds / interval)

    async def sender(i: int, ws: Any) -> None:
        start = t0 + interval * i / n
        first = (i * 7919) % len(chunks)  # each session at its own place in the loop
        for k in range(total):
            target = start + k * interval
            delay = target - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            lags.append(time.perf_counter() - target)
            await ws.send(chunks[(first + k) % len(chunks)])

    await asyncio.gather(*(sender(i, ws) for i, ws in enumerate(conns)))
    streamed = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    await asyncio.sleep(0.5)
    for ws in conns:
        await ws.close()
    for task in readers:
        task.cancel()
    result = {
        "counts": counts,
        "lag_p99_ms": percentile(lags, 99) * 1000,
        "sent": len(lags),
        "seconds": streamed,
        "cpu": cpu,
    }
    out.put(("done", result))


def capacity_client(
    url: str, n: int, seconds: float, chunk_ms: int, audio_path: str, deflate: bool, out: Any
) -> None:
    audio = pcm16(np.load(audio_path))
    gc.collect()
    gc.freeze()  # as the server does: no long collection pauses in the load generator either
    asyncio.run(_capacity_client(url, n, seconds, chunk_ms, audio, deflate, out))


async def _wait_done(ws: Any, done: asyncio.Future[tuple[float, Any]]) -> None:
    async for frame in ws:
        event = json.loads(frame)
        if event["type"] == "response.done" and not done.done():
            done.set_result((time.perf_counter(), event["response"]["status_details"]))


async def _barge_in(url: str, audio: np.ndarray, onset_ms: float, repeats: int) -> list[float]:
    import websockets

    delays = []
    words = " ".join(f"w{i}" for i in range(400))
    chunk_ms = 20
    step = RATE * chunk_ms // 1000
    # From 300 ms before the onset: the VAD sees a little silence first.
    lead = int((onset_ms - 300) * RATE / 1000)
    speech = pcm16(audio[lead : lead + RATE * 2])
    onset_chunk = int(300 // chunk_ms)
    for _ in range(repeats):
        async with websockets.connect(url, max_size=2**24) as ws:
            await ws.recv()
            await ws.send(VAD_UPDATE)
            item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": words}]}
            await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
            await ws.send(json.dumps({"type": "response.create"}))
            while json.loads(await ws.recv())["type"] != "response.output_audio.delta":
                pass
            done: asyncio.Future[tuple[float, Any]] = asyncio.get_running_loop().create_future()
            task = asyncio.create_task(_wait_done(ws, done))
            sent_at = []
            t0 = time.perf_counter()
            for k in range(0, len(speech) // 2 // step):
                delay = t0 + k * chunk_ms / 1000 - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                chunk = speech[k * step * 2 : (k + 1) * step * 2]
                await ws.send(
                    json.dumps(
                        {"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode()}
                    )
                )
                sent_at.append(time.perf_counter())
                if done.done():
                    break
            at, details = await asyncio.wait_for(done, 5)
            assert details == {"type": "cancelled", "reason": "turn_detected"}, details
            delays.append(at - sent_at[onset_chunk])
            task.cancel()
    return delays


# -- main ---------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 50, 100, 200])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--chunk-ms", type=int, default=100)
    parser.add_argument("--barge-ins", type=int, default=5)
    parser.add_argument(
        "--deflate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="negotiate permessage-deflate as the SDK's websockets client does (default on)",
    )
    parser.add_argument(
        "--server-deflate",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="let the server accept permessage-deflate (default off, as omnirt serve)",
    )
    parser.add_argument("--vad-model", default=None, help="ServerConfig.vad_model_path (default: bundled)")
    parser.add_argument(
        "--gather-ms", type=float, default=ServerConfig.vad_gather_ms, help="ServerConfig.vad_gather_ms"
    )
    parser.add_argument("--vad-nice", type=int, default=ServerConfig.vad_nice, help="ServerConfig.vad_nice")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    from omnirt.realtime.app import create_app
    from omnirt.stages.engine import Engine, EngineClient

    from tests.fakes import EchoPipeline
    from tests.server import serve

    audio, onset_ms = speech_loop()
    audio_path = Path(tempfile.mkdtemp()) / "speech.npy"
    np.save(audio_path, audio)
    config = ServerConfig(
        max_sessions=max(args.sessions) + 8,
        max_idle_seconds=None,
        vad_gather_ms=args.gather_ms,
        vad_model_path=args.vad_model,
        vad_nice=args.vad_nice,
    )
    app = create_app(EngineClient(Engine(EchoPipeline(step_seconds=0.03))), config)
    vad = app.state.realtime.vad
    print(
        f"load before: {os.getloadavg()[0]:.2f} (1-min), {os.cpu_count()} CPUs, "
        f"{args.chunk_ms} ms chunks, {args.seconds:g} s per level, VAD gather {args.gather_ms:g} ms, "
        f"permessage-deflate client {'on' if args.deflate else 'off'}, "
        f"server {'on' if args.server_deflate else 'off'}",
        flush=True,
    )
    rows = []
    with serve(app, ws_per_message_deflate=args.server_deflate) as base_url:
        vad_pid = vad._proc.pid  # started with the app (vad_preload)
        print(f"VAD process {vad_pid} at niceness {niceness(vad_pid)}", flush=True)
        url = base_url.replace("http://", "ws://") + "/v1/realtime"
        ctx = mp.get_context("spawn")
        for n in args.sessions:
            out = ctx.Queue()
            proc = ctx.Process(
                target=capacity_client,
                args=(url, n, args.seconds, args.chunk_ms, str(audio_path), args.deflate, out),
            )
            proc.start()
            kind, _ = out.get(timeout=300)
            assert kind == "ready"
            # Steady state: the sessions' objects are in; their first full collection (one pause
            # of 15-25 ms here for 200 sessions' ~40k objects) happens now, not while measuring.
            gc.collect()
            before = vad.stats.snapshot()
            cpu0, vad_cpu0 = time.process_time(), process_cpu(vad_pid)
            kind, client = out.get(timeout=args.seconds + 120)
            server_cpu = time.process_time() - cpu0
            vad_cpu = process_cpu(vad_pid) - vad_cpu0
            proc.join(30)
            stats = vad.stats.since(before)
            lat = [x * 1000 for x in stats.latencies]
            counts = client["counts"]
            rows.append(
                {
                    "sessions": n,
                    "p50": percentile(lat, 50),
                    "p99": percentile(lat, 99),
                    "max": max(lat) if lat else float("nan"),
                    "windows_s": stats.windows / client["seconds"],
                    "need_s": n * 1000 / 32,
                    "batch": stats.mean_batch,
                    "busy": stats.busy_seconds / client["seconds"],
                    "lag_p99": client["lag_p99_ms"],
                    "turns": counts.get("input_audio_buffer.speech_stopped", 0),
                    "errors": counts.get("error", 0),
                    "load": os.getloadavg()[0],
                    "server_cores": server_cpu / client["seconds"],
                    "vad_cores": vad_cpu / client["seconds"],
                    "client_cores": client["cpu"] / client["seconds"],
                }
            )
            r = rows[-1]
            print(
                f"{n:4d} sessions: p50 {r['p50']:.2f} ms, p99 {r['p99']:.2f} ms, "
                f"{r['windows_s']:.0f} windows/s (need {r['need_s']:.0f}), "
                f"batch {r['batch']:.1f}, busy {r['busy']:.0%}, "
                f"send lag p99 {r['lag_p99']:.1f} ms, turns {r['turns']}, errors {r['errors']}",
                flush=True,
            )
        delays = asyncio.run(_barge_in(url, audio, onset_ms, args.barge_ins))
    print()
    print(
        "| sessions | VAD decision p50 (ms) | p99 (ms) | max (ms) | windows/s | real-time need | mean batch "
        "| VAD busy | server CPU (cores) | VAD CPU (cores) | client CPU (cores) | client send lag p99 (ms) "
        "| speech turns | errors | load (1 min) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['sessions']} | {r['p50']:.2f} | {r['p99']:.2f} | {r['max']:.1f} | {r['windows_s']:.0f} "
            f"| {r['need_s']:.0f} | {r['batch']:.1f} | {r['busy']:.0%} | {r['server_cores']:.2f} "
            f"| {r['vad_cores']:.2f} | {r['client_cores']:.2f} | {r['lag_p99']:.1f} | {r['turns']} "
            f"| {r['errors']} | {r['load']:.2f} |"
        )
    ms = [d * 1000 for d in delays]
    print()
    print(
        f"barge-in, speech onset to response.done (n={len(ms)}): p50 {statistics.median(ms):.0f} ms, "
        f"min {min(ms):.0f} ms, max {max(ms):.0f} ms"
    )


if __name__ == "__main__":
    main()
