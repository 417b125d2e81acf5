"""A spoken session longer than the model's context, under each ``session.truncation``.

Starts the server in this process (the embedded default model, or ``--model PATH``) with
``--max-context`` tokens a session, then for each truncation setting opens one realtime session
and has it do ``--turns`` manual audio turns of ``--audio-seconds`` each (a speech-like tone,
``input_audio_buffer.append`` in 100 ms pieces, commit, ``response.create``), and prints, per
setting:

- **turns done / failed**: responses that ended ``completed`` or ``incomplete`` (a reply cut at
  ``--max-output-tokens``), and those that ``failed`` (a context over the model's, with
  ``disabled``);
- **first failure**: the turn whose prompt first did not fit, if any;
- **mean prompt / mean read** (tokens): ``usage.input_tokens`` and the part of it not from the
  prefix cache (``input_tokens - cached_tokens``), over the last half of the turns (a full
  conversation, past the context with ``--turns`` long enough): what each turn costs the
  prefill. Leaving out just enough (``retention_ratio`` 1.0, OpenAI's ``auto``) truncates a full
  conversation at every turn, and its prompt no longer starts as the turn before's did; a lower
  ratio (``auto`` here is 0.8) truncates once every few turns;
- **first audio p50** (ms): commit to the first ``response.output_audio.delta``, same turns.

Each setting's session speaks other audio (no prefix of one session is in the cache for another).

    python benchmarks/long_session.py --turns 30 --max-context 1024
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import websockets
from omnirt.codecs.audio import b64encode, float_to_pcm16
from omnirt.realtime.app import create_app
from omnirt.realtime.config import ServerConfig
from omnirt.stages.engine import Engine, EngineClient
from omnirt.stages.factory import build_pipeline
from omnirt.stages.types import SAMPLE_RATE

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.server

SETTINGS: dict[str, Any] = {
    "disabled": "disabled",
    "auto": "auto",  # a retention ratio of 0.8 (sessions.context.AUTO_RETENTION)
    "retention 1.0": {"type": "retention_ratio", "retention_ratio": 1.0},  # just enough: OpenAI's auto
    "retention 0.6": {"type": "retention_ratio", "retention_ratio": 0.6},
}


def speechlike(seconds: float, seed: int) -> bytes:
    t = np.arange(int(SAMPLE_RATE * seconds)) / SAMPLE_RATE
    pitch = 160 + 40 * np.sin(2 * np.pi * (1.5 + 0.001 * seed) * t)
    pcm = 0.3 * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t)) * np.sin(2 * np.pi * pitch * t)
    return float_to_pcm16(pcm.astype(np.float32))


async def until(ws: Any, kind: str, timeout: float = 300.0) -> tuple[dict[str, Any], float | None]:
    """The first event of type ``kind``, and when the first audio delta before it came."""
    first_audio = None
    async with asyncio.timeout(timeout):
        while True:
            event = json.loads(await ws.recv())
            if event["type"] == "response.output_audio.delta" and first_audio is None:
                first_audio = time.perf_counter()
            if event["type"] == "error":
                raise RuntimeError(event["error"])
            if event["type"] == kind:
                return event, first_audio


async def session(url: str, truncation: Any, voice: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    turns = []
    async with websockets.connect(url, max_size=None) as ws:
        await until(ws, "session.created")
        update = {"type": "realtime", "truncation": truncation, "audio": {"input": {"turn_detection": None}}}
        await ws.send(json.dumps({"type": "session.update", "session": update}))
        await until(ws, "session.updated")
        for turn in range(args.turns):
            audio = speechlike(args.audio_seconds, 1000 * voice + turn)
            step = int(SAMPLE_RATE * 0.1) * 2
            for i in range(0, len(audio), step):
                await ws.send(
                    json.dumps({"type": "input_audio_buffer.append", "audio": b64encode(audio[i : i + step])})
                )
            t0 = time.perf_counter()
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            await ws.send(json.dumps({"type": "response.create"}))
            done, first_audio = await until(ws, "response.done")
            response = done["response"]
            usage = response.get("usage") or {}
            cached = (usage.get("input_token_details") or {}).get("cached_tokens", 0)
            turns.append(
                {
                    "status": response["status"],
                    "prompt": usage.get("input_tokens", 0),
                    "cached": cached,
                    "first_audio_ms": None if first_audio is None else (first_audio - t0) * 1000,
                }
            )
    return turns


def summary(name: str, turns: list[dict[str, Any]]) -> str:
    done = [t for t in turns if t["status"] in ("completed", "incomplete")]
    failed = [i for i, t in enumerate(turns) if t["status"] == "failed"]
    late = [t for t in turns[len(turns) // 2 :] if t in done]

    def mean(values: list[float]) -> str:
        return f"{statistics.fmean(values):.0f}" if values else "-"

    audio = [t["first_audio_ms"] for t in late if t["first_audio_ms"] is not None]
    return (
        f"| {name} | {len(done)} / {len(failed)} | {failed[0] + 1 if failed else '-'} "
        f"| {mean([t['prompt'] for t in late])} | {mean([t['prompt'] - t['cached'] for t in late])} "
        f"| {f'{statistics.median(audio):.0f}' if audio else '-'} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the embedded demo)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--max-output-tokens", type=int, default=16)
    ap.add_argument("--turns", type=int, default=30)
    ap.add_argument("--audio-seconds", type=float, default=3.0)
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    args = ap.parse_args()

    from tests.server import serve

    pipeline = build_pipeline(args.model, device=args.device, max_slots=2, max_context=args.max_context)
    engine = Engine(pipeline)
    app = create_app(EngineClient(engine), ServerConfig(max_output_tokens=args.max_output_tokens))
    rows = []
    with serve(app) as base_url:
        url = base_url.replace("http://", "ws://") + "/v1/realtime"
        for voice, name in enumerate(args.settings):
            turns = asyncio.run(session(url, SETTINGS[name], voice, args))
            rows.append(summary(name, turns))
            print(
                f"{name}: " + " ".join(f"{t['prompt']}/{t['cached']}" for t in turns),
                file=sys.stderr,
                flush=True,
            )
    print(
        f"# {args.turns} turns of {args.audio_seconds:g} s, context {args.max_context} tokens, "
        f"replies of at most {args.max_output_tokens} tokens ({pipeline.info.id})\n"
    )
    print(
        "| truncation | turns done / failed | first failure | mean prompt, last half | mean read, last half "
        "| first audio p50, last half (ms) |"
    )
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
