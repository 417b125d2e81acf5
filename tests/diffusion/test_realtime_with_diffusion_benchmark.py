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
    return _cells(line)


def test_the_benchmark_runs_every_phase_on_cpu(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    saved = tmp_path / "run.json"
    argv = [
        "--device", "cpu", "--threads", "1", "--sessions", "2", "--seconds", "3", "--audio-seconds", "0.5",
        "--max-output-tokens", "2", "--max-audio-frames", "8", "--image-size", "64x64",
        "--image-steps", "2", "--video-size", "32x32", "--video-frames", "5", "--video-steps", "2",
        "--first-audio-targets", "0.25", "none", "--batch-slices", "0.02", "none", "--dit-iters", "0",
        "--phase-timeout", "60", "--compare-prompt-ticks", "--compare-vocoder-steps", "--save", str(saved),
    ]  # fmt: skip
    with benchmark_module("realtime_with_diffusion.py", "realtime_with_diffusion_under_test") as bench:
        assert bench.main(argv) == 0
        out = capsys.readouterr().out
        phases, kinds = bench.pool([saved])
        assert bench.main(["--pool", str(saved), str(saved)]) == 0  # one run twice: the same rates
        pooled_out = capsys.readouterr().out
    _pooled_run_matches(out, pooled_out, phases, kinds)
    header = next(line for line in out.splitlines() if line.startswith("| phase |"))
    cells = [c.strip() for c in header.strip("|").split("|")]
    phases = ("realtime alone", "both", "both, first-audio target none", "both, batch slice none")
    others = ("prompts in frame ticks", "a vocoder step a frame")
    for phase in (*phases, *(f"{name}, {other}" for other in others for name in ("realtime alone", "both"))):
        row = dict(zip(cells, _row(out, phase), strict=True))
        assert row["ramp (s)"] != "incomplete", row
        assert int(row["frame ticks"]) > 0 and float(row["frame p99 (ms)"]) > 0, row
        assert re.fullmatch(r"[\d.]+ \(n=\d+\)", row["first audio p50 (ms)"]), row
    for phase in ("diffusion alone", "both"):
        row = dict(zip(cells, _row(out, phase), strict=True))
        assert float(row["image steps/s"]) > 0 and float(row["video steps/s"]) > 0, row
    assert "goal realtime p99:" in out and "goal diffusion throughput:" in out
    assert "| realtime frame p99, prompts in frame ticks (ms) |" in out
    assert "| realtime late deltas, prompts in frame ticks |" in out
    assert "| realtime frame p99, a vocoder step a frame (ms) |" in out
    assert "| image denoising steps/s, a vocoder step a frame |" in out
    places = next(line for line in out.splitlines() if line.startswith("| realtime late deltas: second"))
    assert re.fullmatch(r"\| [^|]+ \| \d+ / \d+ / \d+ \| \d+ / \d+ / \d+ \| - \| - \| - \|", places)
    beside = out.split("## What ran beside each step", 1)[1]
    rows = [_cells(line) for line in beside.splitlines() if line.startswith("| both |")]
    assert {r[1] for r in rows} == {"speech", "image", "video"}, rows
    assert all(int(r[4]) > 0 for r in rows), rows
    engine = out.split("## Where the engine's time went", 1)[1].split("\n## ", 1)[0]
    header = _cells(next(line for line in engine.splitlines() if line.startswith("| phase |")))
    needs = {"both": ("speech frame ticks", "image steps", "video steps"), "realtime alone": ()}
    for phase, needed in needs.items():
        row = dict(zip(header, _row(engine, phase), strict=True))
        shares = [float(m) for m in re.findall(r"\((\d+)%\)", " ".join(row.values()))]
        assert 90 <= sum(shares) <= 110, row  # every part of the window, once
        assert all(row[column] != "-" for column in needed), row


def _pooled_run_matches(out: str, pooled: str, phases, kinds) -> None:
    """``--save`` keeps every measured phase; ``--pool`` of one run twice gives its rates and medians
    (windows and steps doubled, latencies repeated; a p99 of the doubled list moves by the
    percentile's interpolation) and the engine's time for every phase."""
    assert {p.name for p in phases} >= {"realtime alone", "diffusion alone", "both"}
    assert kinds == ["image", "video"]
    assert "2 runs together" in pooled and "goal diffusion throughput:" in pooled
    for label in ("realtime frame p50 (ms)", "image denoising steps/s", "video denoising steps/s"):
        run = next(line for line in out.splitlines() if line.startswith(f"| {label} |"))
        both = next(line for line in pooled.splitlines() if line.startswith(f"| {label} |"))
        assert _cells(run)[1:4] == _cells(both)[1:4], (run, both)
    engine = pooled.split("## Where the engine's time went, pooled", 1)[1]
    assert _row(engine, "both") and _row(engine, "realtime alone")


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_the_probe_sees_collector_pauses_cpu_time_and_encodes_beside_a_step() -> None:
    import gc
    import threading

    import torch

    with benchmark_module("realtime_with_diffusion.py", "realtime_with_diffusion_probe") as bench:
        probe = bench.Probe(torch.device("cpu"))
        try:
            quiet = probe.since(probe.snapshot())
            assert quiet == bench.Beside(cpu_s=quiet.cpu_s) and not quiet.encoding
            before = probe.snapshot()
            gc.collect()
            sum(i * i for i in range(200_000))  # engine CPU time
            seen = probe.since(before)
            assert seen.gc_s > 0 and seen.cpu_s > 0 and not seen.encoding
            started, release = threading.Event(), threading.Event()

            def encode() -> None:
                probe.encode(+1)
                started.set()
                release.wait(5)
                probe.encode(-1)

            worker = threading.Thread(target=encode)
            worker.start()
            started.wait(5)
            assert probe.since(probe.snapshot()).encoding  # under way through the step
            before = probe.snapshot()
            release.set()
            worker.join(5)
            assert probe.since(before).encoding  # ended during the step
            assert not probe.since(probe.snapshot()).encoding
        finally:
            probe.close()
