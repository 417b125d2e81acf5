"""benchmarks/scale.py's pure parts: the percentiles, the player's gaps, when a level passes and
how the ramp picks its levels and the sessions served; the round trips' table (answer sizes, the
added latency per one-way event), how a reply frame is awaited, the 80 ms audio item and the
session slots the round trips need (no server, no timing)."""

from __future__ import annotations

import asyncio
import base64
import json
import math
from collections.abc import Iterator
from types import ModuleType

import pytest

from tests.scripts import benchmark_module


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    with benchmark_module("scale.py", "scale_benchmark") as module:
        yield module


@pytest.fixture(scope="module")
def rule(bench: ModuleType) -> object:
    return bench.Rule(first_audio_s=1.0, gap_s=0.02)


def test_percentiles_are_nearest_rank(bench: ModuleType) -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert bench.pct(values, 50) == 50 and bench.pct(values, 99) == 99 and bench.pct(values, 100) == 100
    assert bench.pct(values[:10], 99) == 10  # under 100 values, p99 is the maximum
    assert bench.pct([3.0], 1) == 3.0
    with pytest.raises(ValueError):
        bench.pct([], 50)


def test_playback_gap_and_rate(bench: ModuleType) -> None:
    # 0.2 s chunks every 0.1 s: made at twice real time, never a gap even without a buffer.
    fast = [(10 + 0.1 * i, 0.2) for i in range(10)]
    assert bench.playback_gap(fast, 0.0) == 0.0
    assert bench.audio_rate(fast) == pytest.approx(2.0)
    # 0.1 s chunks every 0.2 s (half real time): the player starts 0.1 s after the first, plays
    # 0.1 s, waits for the next (arrives 0.2 s after the first): 0 s; then 0.1 s per chunk.
    slow = [(10 + 0.2 * i, 0.1) for i in range(4)]
    assert bench.playback_gap(slow, 0.1) == pytest.approx(0.0 + 0.1 + 0.1)
    assert bench.playback_gap(slow, 0.0) == pytest.approx(0.1 * 3)
    assert bench.audio_rate(slow) == pytest.approx(0.5)
    # A big enough buffer hides it.
    assert bench.playback_gap(slow, 0.3) == 0.0
    assert bench.playback_gap([], 0.2) == 0.0 and bench.audio_rate([(1.0, 0.5)]) == math.inf


def level(bench: ModuleType, n: int, first: list[float], gaps: list[float] | None = None) -> object:
    gaps = gaps or [0.0] * len(first)
    turns = [bench.Turn(first_audio_s=f, audio_s=3.0, gap_s=g) for f, g in zip(first, gaps, strict=True)]
    return bench.Level("t", n, turns)


def test_a_level_passes_on_its_p99_first_audio_gaps_and_failures(bench: ModuleType, rule: object) -> None:
    assert level(bench, 4, [0.2] * 99 + [0.9]).passes(rule)
    assert level(bench, 4, [0.2] * 99 + [1.0]).passes(rule)  # at the bound
    assert not level(bench, 4, [0.2] * 98 + [1.2]).passes(rule)  # 99 turns: p99 is the slowest
    assert level(bench, 4, [0.2] * 99 + [1.2]).passes(rule)  # 1 slow turn in 100 is allowed
    assert not level(bench, 4, [0.2] * 10, [0.0] * 9 + [0.05]).passes(rule)  # a turn heard a gap
    assert level(bench, 4, [0.2] * 10, [0.0] * 9 + [0.005]).passes(rule)  # under 20 ms: a click
    failed = level(bench, 4, [0.2] * 10)
    failed.turns.append(bench.Turn(error="TurnFailed: error resource_exhausted"))
    assert not failed.passes(rule) and len(failed.failed) == 1 and len(failed.ok) == 10
    assert not bench.Level("t", 4, []).passes(rule)  # no turn: nothing shown


def test_the_ramp_stops_at_the_first_failure_and_bisects_below_it(bench: ModuleType, rule: object) -> None:
    levels = [1, 4, 8, 16, 24]
    capacity = 11  # a level passes up to here

    def run(refine: int) -> tuple[list[int], object]:
        tried: list[object] = []
        while (n := bench.next_level(tried, levels, rule, refine)) is not None:
            tried.append(level(bench, n, [0.3 if n <= capacity else 1.5] * 5))
        return [lv.sessions for lv in tried], bench.sessions_served(tried, rule)

    order, served = run(refine=0)
    assert order == [1, 4, 8, 16] and served.sessions == 8
    order, served = run(refine=2)
    assert order == [1, 4, 8, 16, 12, 10] and served.sessions == 10  # 12 fails, 10 passes
    # Every level passes: the ramp ends at the top and serves it.
    tried = [level(bench, n, [0.3] * 5) for n in levels]
    assert bench.next_level(tried, levels, rule, 1) is None
    assert bench.sessions_served(tried, rule).sessions == 24
    # The first level fails: nothing served, nothing to bisect.
    tried = [level(bench, 1, [2.0] * 5)]
    assert bench.next_level(tried, levels, rule, 3) is None
    assert bench.sessions_served(tried, rule) is None


def test_round_trip_table_gives_answer_sizes_and_half_the_added_round_trip(bench: ModuleType) -> None:
    single = [0.0003] * 10
    ray = [0.0018] * 9 + [0.0100]  # p50 1.8 ms, p99 (the slowest of 10) 10 ms
    r = bench.RoundTripRow(single, ray, answer_bytes=5381)
    assert bench.added_one_way(r) == pytest.approx(0.00075)  # (1.8 - 0.3) / 2 ms
    table = bench.latency_table({bench.AUDIO_PROBE: r}, "Ray Serve, 1 replica").splitlines()
    assert table[0].startswith("| event | answer (bytes) | n |")
    cells = [c.strip() for c in table[2].strip("|").split("|")]
    assert cells[:3] == [bench.AUDIO_PROBE, "5381", "10"]
    assert cells[3:] == ["0.300", "0.300", "1.800", "10.000", "1.500", "9.700", "0.750"]
    assert set(bench.WS_PROBES) == {bench.CLEAR_PROBE, bench.UPDATE_PROBE, bench.AUDIO_PROBE}


class FakeSocket:
    def __init__(self, frames: list[str]) -> None:
        self.frames = frames

    async def recv(self) -> str:
        return self.frames.pop(0)


def test_until_frame_skips_other_events_and_raises_on_an_error(bench: ModuleType) -> None:
    wanted = json.dumps({"type": "conversation.item.retrieved", "item": {"id": "item_1"}})
    ws = FakeSocket([json.dumps({"type": "conversation.item.added"}), wanted, "{}"])
    assert asyncio.run(bench.until_frame(ws, "conversation.item.retrieved", 5)) == wanted  # as sent
    assert ws.frames == ["{}"]
    error = json.dumps({"type": "error", "error": {"code": "resource_exhausted", "message": "full"}})
    with pytest.raises(bench.TurnFailed, match="resource_exhausted"):
        asyncio.run(bench.until(FakeSocket([error, wanted]), "conversation.item.retrieved", 5))


def test_the_audio_item_holds_80_ms_and_the_round_trips_have_their_sessions(bench: ModuleType) -> None:
    item = json.loads(bench.AUDIO_ITEM)["item"]
    (part,) = item["content"]
    assert part["type"] == "input_audio"
    assert len(base64.b64decode(part["audio"])) == bench.SAMPLE_RATE * 2 * 80 // 1000  # PCM16
    assert bench.parse_args(["--levels", "1"]).max_sessions == bench.ROUND_TRIP_SESSIONS == 2
    assert bench.parse_args(["--levels", "1", "8"]).max_sessions == 8
    assert bench.parse_args(["--levels", "1", "--max-sessions", "1"]).max_sessions == 1


def test_the_ingress_names_the_fleets_and_is_checked(
    bench: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench.parse_args([]).ingress == "proxy"
    assert bench.parse_args(["--ingress", "haproxy"]).ingress == "haproxy"
    assert bench.ray_target(1) == "Ray Serve, 1 replica"
    assert bench.ray_target(2, "haproxy") == "Ray Serve (HAProxy), 2 replicas"
    with pytest.raises(SystemExit):
        bench.parse_args(["--ingress", "nginx"])
    assert "invalid choice: 'nginx'" in capsys.readouterr().err
