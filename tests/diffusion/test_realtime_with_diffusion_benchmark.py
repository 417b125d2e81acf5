"""``benchmarks/realtime_with_diffusion.py`` end to end on CPU with the embedded models, at a tiny
size: every phase completes its ramp (sessions hear audio, both diffusion streams step) and
reports frames, first audio and diffusion throughput (the script once ran without a single turn
for a day: nothing drove it)."""

from __future__ import annotations

import re

import pytest

from tests.scripts import benchmark_module


def _row(out: str, phase: str) -> list[str]:
    line = next(line for line in out.splitlines() if line.startswith(f"| {phase} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_the_benchmark_runs_every_phase_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--device", "cpu", "--threads", "1", "--sessions", "2", "--seconds", "3", "--audio-seconds", "0.5",
        "--max-output-tokens", "2", "--max-audio-frames", "8", "--image-size", "64x64",
        "--image-steps", "2", "--video-size", "32x32", "--video-frames", "5", "--video-steps", "2",
        "--first-audio-targets", "0.25", "none", "--batch-slices", "0.02", "none", "--dit-iters", "0",
        "--phase-timeout", "60",
    ]  # fmt: skip
    with benchmark_module("realtime_with_diffusion.py", "realtime_with_diffusion_under_test") as bench:
        assert bench.main(argv) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("| phase |"))
    cells = [c.strip() for c in header.strip("|").split("|")]
    for phase in ("realtime alone", "both", "both, first-audio target none", "both, batch slice none"):
        row = dict(zip(cells, _row(out, phase), strict=True))
        assert row["ramp (s)"] != "incomplete", row
        assert int(row["frame ticks"]) > 0 and float(row["frame p99 (ms)"]) > 0, row
        assert re.fullmatch(r"[\d.]+ \(n=\d+\)", row["first audio p50 (ms)"]), row
    for phase in ("diffusion alone", "both"):
        row = dict(zip(cells, _row(out, phase), strict=True))
        assert float(row["image steps/s"]) > 0 and float(row["video steps/s"]) > 0, row
    assert "goal realtime p99:" in out and "goal diffusion throughput:" in out
