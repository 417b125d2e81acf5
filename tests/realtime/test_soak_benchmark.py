"""``benchmarks/soak.py`` end to end at a tiny size: a real ``omnirt serve`` per phase, a few
well-behaved sessions taking text, audio and barge-in turns, and in the hostile phase every
hostile kind in a process of its own. Every phase must take turns with none failed, report its
RSS and its client loop lag, and the hostile process must have connected and sent events (the
script had no test; a broken hostile process would otherwise read as a calm phase)."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.scripts import BENCHMARKS
from tests.vad.speech import require_espeak


def _row(out: str, phase: str, table: str = "| phase | turns") -> dict[str, str]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(table))
    header = lines[start]
    row = next(line for line in lines[start:] if line.startswith(f"| {phase} |"))
    cells = [c.strip() for c in header.strip("|").split("|")]
    return dict(zip(cells, [c.strip() for c in row.strip("|").split("|")], strict=True))


def _soak(argv: list[str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "soak.py"), *argv], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_the_soak_runs_calm_and_hostile_phases(tmp_path) -> None:
    require_espeak()
    argv = [
        "--sessions", "3", "--minutes", "0.25", "--hostile", "3", "--think", "1", "3",
        "--lifetime", "8", "12", "--mix", "0.4", "0.4", "0.2", "--reply-tokens", "4",
        "--fuzz-rate", "5", "--huge-mib", "1", "--rss-every", "2", "--log-dir", str(tmp_path),
    ]  # fmt: skip
    done = _soak(argv)
    for phase in ("calm", "hostile"):
        row = _row(done.stdout, phase)
        turns = [int(n) for n in row["turns (text/audio/barge-in)"].split("/")]
        assert sum(turns) >= 3 and row["failed"] == "0", row
        assert int(row["RSS at start (MiB)"]) > 0 and re.fullmatch(r"[+-][\d.]+%", row["growth"]), row
        assert row["client loop lag p99 (ms)"].isdigit() and float(row["server CPU (cores)"]) > 0, row
        steps = _row(done.stdout, phase, "| phase | speech steps")  # the server's /metrics histogram
        assert int(steps["speech steps"]) > 10 and float(steps["mean (ms)"]) > 0, steps
        assert all(re.fullmatch(r"[\d.]+%", v) for k, v in steps.items() if k.startswith("over")), steps
    assert float(_row(done.stdout, "hostile")["hostile clients' CPU (cores)"]) > 0
    hostile = re.search(r"hostile: (\d+) connections, (\d+) events", done.stdout)
    assert hostile and int(hostile[1]) >= 3 and int(hostile[2]) > 10, done.stdout[-2000:]


def test_the_soak_interleaves_calm_and_hostile_windows_on_one_server(tmp_path) -> None:
    """``--phases interleaved``: one server, the hostile clients only in every other window; each
    window's turns, CPU and speech steps go to its phase, the first seconds after a switch to
    neither."""
    require_espeak()
    argv = [
        "--phases", "interleaved", "--interleave", "6", "--settle", "1", "--sessions", "3",
        "--minutes", "0.4", "--hostile", "3", "--think", "1", "2", "--lifetime", "8", "12",
        "--mix", "0.5", "0.5", "0", "--reply-tokens", "4", "--fuzz-rate", "5", "--huge-mib", "1",
        "--rss-every", "2", "--log-dir", str(tmp_path), "--save", str(tmp_path / "run.json"),
    ]  # fmt: skip
    done = _soak(argv)
    pooled = _soak(["--pool", str(tmp_path / "run.json"), str(tmp_path / "run.json")]).stdout
    for phase in ("calm (interleaved)", "hostile (interleaved)"):
        turns = sum(int(n) for n in _row(done.stdout, phase)["turns (text/audio/barge-in)"].split("/"))
        assert _row(pooled, phase, "| phase | turns |")["turns"] == str(2 * turns), pooled  # both runs'
    assert "Pooled well-behaved p99 (hostile (interleaved)):" in pooled
    for phase in ("calm (interleaved)", "hostile (interleaved)"):
        row = _row(done.stdout, phase)
        turns = [int(n) for n in row["turns (text/audio/barge-in)"].split("/")]
        assert sum(turns) >= 2 and row["failed"] == "0", row
        assert float(row["server CPU (cores)"]) > 0 and int(row["RSS at start (MiB)"]) > 0, row
        steps = _row(done.stdout, phase, "| phase | speech steps")
        assert int(steps["speech steps"]) > 0, steps
    assert float(_row(done.stdout, "calm (interleaved)")["hostile clients' CPU (cores)"]) == 0
    assert float(_row(done.stdout, "hostile (interleaved)")["hostile clients' CPU (cores)"]) > 0
    goal = r"\(hostile \(interleaved\)\): \d+ ms vs \d+ ms calm.*hostile: (\d+) connections"
    hostile = re.search(goal, done.stdout)
    assert hostile and int(hostile[1]) >= 3, done.stdout[-2000:]
