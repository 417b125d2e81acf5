"""``benchmarks/long_session.py`` at a tiny size (the embedded model on CPU, a context of 256
tokens, 8 turns of 1.5 s): with truncation disabled the conversation's turns start failing once
it is over the context; with every truncating setting every turn is answered, and ``auto`` (a
retention ratio of 0.8) reads less of each prompt anew than leaving out just enough (ratio 1.0)
does: its prefix stays in the cache."""

from __future__ import annotations

import subprocess
import sys

from tests.scripts import BENCHMARKS


def test_truncation_keeps_a_long_session_going() -> None:
    argv = ["--turns", "8", "--audio-seconds", "1.5", "--max-context", "256", "--max-output-tokens", "8"]
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "long_session.py"), *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {}
    for line in done.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0] in ("disabled", "auto", "retention 1.0", "retention 0.6"):
            rows[cells[0]] = cells
    disabled_done, disabled_failed = (int(n) for n in rows["disabled"][1].split(" / "))
    assert disabled_failed > 0 and disabled_done + disabled_failed == 8
    assert rows["auto"][1] == rows["retention 1.0"][1] == rows["retention 0.6"][1] == "8 / 0"
    assert int(rows["auto"][4]) < int(rows["retention 1.0"][4])  # mean read, last half
