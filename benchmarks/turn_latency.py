"""Turn latency of ``/v1/realtime``: time to first audio and the server's own overhead.

Starts the server in this process (the embedded default model, or ``--model PATH``), then for
each concurrency level N (default 1, 4, 16) opens N realtime sessions over a raw ``websockets``
client, all at once, and has each do ``--turns`` manual audio turns: ``--audio-seconds`` of
audio (espeak-ng speech when it is installed, else a speech-like tone) sent with
``input_audio_buffer.append``, then ``input_audio_buffer.commit`` + ``response.create``.
Each session first does ``--warmup-turns`` untimed turns (default 1): the pipeline warms up
lazily for each new batch size, and a cold first turn measures that rather than serving.

Per turn it records:

- **first audio**: from just before the commit is sent to the arrival of the first
  ``response.output_audio.delta`` (what a user waits for);
- **turn wall time**: from the commit to ``response.done``;
- **model time**: how much ``engine.stats.step_seconds`` grew between those two moments, i.e.
  the time the engine thread spent inside ``pipeline.step()`` while this turn was in flight;
- **overhead** = turn wall time - model time: the in-flight time during which no model step
  ran, i.e. the cost of everything that is not the model (protocol parsing and serialization,
  base64, session logic, event-loop and thread hand-offs, admission and scheduling gaps).
  ``first-audio overhead`` is the same split up to the first audio delta.

``mean batch`` is the mean number of rows per batched thinker decode call over the level, warm-up
included. With several sessions the steps are shared (one batched step advances all of them), so a
step counts fully as model time for every turn it overlaps. A step already running when the
commit is sent is counted whole, so overhead is underestimated by at most one step. The client
runs in the same process as the server (it can read ``engine.stats``), so client-side JSON and
base64 work competes with the server for the GIL: the numbers are an upper bound on the
server's overhead.

    python benchmarks/turn_latency.py --device cuda --sessions 1 4 16 --turns 5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import logging
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import soundfile
import websockets
from omnirt.codecs.audio import b64encode, float_to_pcm16, resample
from omnirt.realtime.app import create_app
from omnirt.realtime.cli import ws_max_size
from omnirt.realtime.config import ServerConfig
from omnirt.stages.engine import Engine, EngineClient
from omnirt.stages.types import SAMPLE_RATE

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.server

log = logging.getLogger("turn_latency")

PROMPT = "Hello there. Could you tell me what the weather will be like tomorrow afternoon?"
APPEND_CHUNK_SECONDS = 0.1
TURN_TIMEOUT_S = 300.0


# -- input audio ----------------------------------------------------------------------------------


def espeak_speech(text: str) -> np.ndarray | None:
    """``text`` spoken by espeak-ng at 24 kHz (float32), or None when espeak-ng is missing."""
    exe = shutil.which("espeak-ng") or shutil.which("espeak")
    if exe is None:
        return None
    wav = subprocess.run([exe, "--stdout", text], capture_output=True, check=True, timeout=60).stdout
    pcm, rate = soundfile.read(io.BytesIO(wav), dtype="float32", always_2d=True)
    mono = pcm.mean(axis=1)
    return resample(mono, rate, SAMPLE_RATE)


def speechlike_tone(seconds: float) -> np.ndarray:
    """A 140 Hz voice-like harmonic tone with a 4 Hz syllable envelope (float32, 24 kHz)."""
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    voice = sum(np.sin(2 * np.pi * 140 * k * t) / k for k in range(1, 6))
    envelope = 0.5 * (1 - np.cos(2 * np.pi * 4 * t))
    return (0.25 * voice * envelope).astype(np.float32)


def input_audio(seconds: float, source: str) -> tuple[bytes, str]:
    """``seconds`` of PCM16 (24 kHz mono) and a word saying what it is."""
    pcm = espeak_speech(PROMPT) if source in ("auto", "espeak") else None
    if pcm is None:
        if source == "espeak":
            raise SystemExit("--audio espeak: espeak-ng is not installed")
        pcm, what = speechlike_tone(seconds), "tone"
    else:
        what = "espeak-ng speech"
    n = int(seconds * SAMPLE_RATE)
    pcm = np.pad(pcm[:n], (0, max(0, n - len(pcm))))
    return float_to_pcm16(pcm), what


# -- the server, in process -----------------------------------------------------------------------


@contextlib.contextmanager
def in_process_server(engine: Engine, config: ServerConfig) -> Iterator[str]:
    """Serve the app on a free loopback port from a thread; yields ``ws://127.0.0.1:PORT``."""
    from tests.server import serve

    # uvicorn's default permessage-deflate (on), as this benchmark has always measured.
    app = create_app(EngineClient(engine), config)
    with serve(
        app, ws_max_size=ws_max_size(config), ws_per_message_deflate=True, start_timeout=60
    ) as base_url:
        yield "ws" + base_url.removeprefix("http")


# -- one session ----------------------------------------------------------------------------------


@dataclass
class Turn:
    sessions: int
    first_audio_s: float
    wall_s: float
    model_s: float
    model_to_first_audio_s: float
    audio_s: float
    status: str

    @property
    def overhead_s(self) -> float:
        return self.wall_s - self.model_s

    @property
    def first_audio_overhead_s(self) -> float:
        return self.first_audio_s - self.model_to_first_audio_s


class ServerError(RuntimeError):
    pass


async def _recv(ws: Any) -> dict[str, Any]:
    event = json.loads(await ws.recv())
    if event["type"] == "error":
        raise ServerError(json.dumps(event["error"]))
    return event


async def _until(ws: Any, kind: str) -> dict[str, Any]:
    while True:
        event = await _recv(ws)
        if event["type"] == kind:
            return event


@dataclass(frozen=True)
class Workload:
    url: str
    model: str
    pcm: bytes
    #: Untimed turns each session does first (the pipeline may warm up per batch size).
    warmup: int
    turns: int
    max_output_tokens: int
    engine: Engine


async def run_session(w: Workload, n: int) -> list[Turn]:
    """One session: ``w.warmup`` untimed turns, then ``w.turns`` timed ones."""
    url, model, pcm, engine = w.url, w.model, w.pcm, w.engine
    chunk = int(APPEND_CHUNK_SECONDS * SAMPLE_RATE) * 2
    appends = [
        json.dumps({"type": "input_audio_buffer.append", "audio": b64encode(pcm[i : i + chunk])})
        for i in range(0, len(pcm), chunk)
    ]
    response_create = json.dumps(
        {
            "type": "response.create",
            "response": {"output_modalities": ["audio"], "max_output_tokens": w.max_output_tokens},
        }
    )
    out: list[Turn] = []
    async with websockets.connect(f"{url}/v1/realtime?model={model}", max_size=None) as ws:
        await _until(ws, "session.created")
        await ws.send(
            json.dumps(
                {
                    "type": "session.update",
                    "session": {"type": "realtime", "audio": {"input": {"turn_detection": None}}},
                }
            )
        )
        await _until(ws, "session.updated")
        for turn in range(w.warmup + w.turns):
            for message in appends:
                await ws.send(message)
            stats = engine.stats
            model0 = stats.step_seconds
            t0 = time.perf_counter()
            await ws.send('{"type":"input_audio_buffer.commit"}')
            await ws.send(response_create)
            first = model_first = None
            audio_bytes = 0
            async with asyncio.timeout(TURN_TIMEOUT_S):
                while True:
                    event = await _recv(ws)
                    if event["type"] == "response.output_audio.delta":
                        if first is None:
                            first, model_first = time.perf_counter(), stats.step_seconds
                        audio_bytes += len(event["delta"]) * 3 // 4
                    elif event["type"] == "response.done":
                        done, model_done = time.perf_counter(), stats.step_seconds
                        status = event["response"]["status"]
                        break
            if first is None or model_first is None:
                raise ServerError(f"the response ended ({status}) without audio")
            if turn < w.warmup:
                continue
            out.append(
                Turn(
                    sessions=n,
                    first_audio_s=first - t0,
                    wall_s=done - t0,
                    model_s=model_done - model0,
                    model_to_first_audio_s=model_first - model0,
                    audio_s=audio_bytes / 2 / SAMPLE_RATE,
                    status=status,
                )
            )
    return out


async def run_level(w: Workload, n: int) -> list[Turn]:
    """``n`` sessions at once, each doing its turns back to back."""
    results = await asyncio.gather(*(run_session(w, n) for _ in range(n)))
    return [turn for session in results for turn in session]


# -- report ---------------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


COLUMNS = (
    "sessions",
    "turns",
    "first audio p50 (ms)",
    "p95 (ms)",
    "vs 1 session",
    "first-audio overhead p50 (ms)",
    "turn wall p50 (ms)",
    "model time p50 (ms)",
    "overhead p50 (ms)",
    "p95 (ms)",
    "overhead share",
    "audio / turn (s)",
    "mean batch",
)


def table(levels: dict[int, list[Turn]], batches: dict[int, float]) -> str:
    """A markdown table, one row per concurrency level; ratios against the lowest level's p50."""
    base = pct([t.first_audio_s for t in levels[min(levels)]], 50)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for n, turns in sorted(levels.items()):
        first = [t.first_audio_s for t in turns]
        over = [t.overhead_s for t in turns]
        cells = (
            str(n),
            str(len(turns)),
            f"{pct(first, 50) * 1e3:.0f}",
            f"{pct(first, 95) * 1e3:.0f}",
            f"{pct(first, 50) / base:.2f}x",
            f"{pct([t.first_audio_overhead_s for t in turns], 50) * 1e3:.1f}",
            f"{pct([t.wall_s for t in turns], 50) * 1e3:.0f}",
            f"{pct([t.model_s for t in turns], 50) * 1e3:.0f}",
            f"{pct(over, 50) * 1e3:.1f}",
            f"{pct(over, 95) * 1e3:.1f}",
            f"{sum(over) / sum(t.wall_s for t in turns):.1%}",
            f"{statistics.median(t.audio_s for t in turns):.2f}",
            f"{batches[n]:.1f}",
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def mean_batch(before: Counter[int], after: Counter[int]) -> float:
    delta = {size: after[size] - before.get(size, 0) for size in after}
    steps = sum(delta.values())
    return sum(size * count for size, count in delta.items()) / steps if steps else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default=None, help="demo (default: embedded random weights) or a local path"
    )
    parser.add_argument("--device", default=None, help="cpu, cuda (default: cuda when available)")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 16], help="concurrency levels")
    parser.add_argument("--turns", type=int, default=5, help="turns per session at each level")
    parser.add_argument("--warmup-turns", type=int, default=1, help="untimed turns per session first")
    parser.add_argument("--audio-seconds", type=float, default=1.0)
    parser.add_argument("--audio", choices=("auto", "espeak", "tone"), default="auto")
    parser.add_argument("--max-output-tokens", type=int, default=32, help="reply length cap (thinker tokens)")
    parser.add_argument("--json", metavar="FILE", help="also write every turn as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from omnirt.stages.factory import build_pipeline

    levels = sorted(set(args.sessions))
    pipeline = build_pipeline(args.model, device=args.device, max_slots=max(levels))
    info = pipeline.info
    engine = Engine(pipeline)
    config = ServerConfig(models=[args.model] if args.model else [], max_sessions=max(levels) + 1)
    pcm, what = input_audio(args.audio_seconds, args.audio)
    log.info(
        "model %s%s; input: %.1f s of %s",
        info.id,
        " (RANDOM weights)" if info.random_weights else "",
        args.audio_seconds,
        what,
    )

    results: dict[int, list[Turn]] = {}
    batches: dict[int, float] = {}
    with in_process_server(engine, config) as url:
        workload = Workload(url, info.id, pcm, args.warmup_turns, args.turns, args.max_output_tokens, engine)
        for n in levels:
            before = engine.stats.rows("speech", "thinker")
            t0 = time.perf_counter()
            results[n] = asyncio.run(run_level(workload, n))
            batches[n] = mean_batch(before, engine.stats.rows("speech", "thinker"))
            log.info("%d sessions: %d turns in %.1f s", n, len(results[n]), time.perf_counter() - t0)

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    hardware = (
        torch.cuda.get_device_name()
        if device.startswith("cuda")
        else f"CPU ({torch.get_num_threads()} threads)"
    )
    print(
        f"\nmodel {info.id} ({'random weights' if info.random_weights else info.source}) on {hardware}; "
        f"{args.audio_seconds:.1f} s of {what} per turn; replies capped at {args.max_output_tokens} tokens\n"
    )
    print(table(results, batches))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(n): [asdict(t) for t in turns] for n, turns in results.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
