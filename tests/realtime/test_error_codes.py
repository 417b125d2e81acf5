"""The error-code table of docs/realtime.md against the code and the tests: it lists every code
the server sends (``ErrorCode``), each beside OpenAI's, and each is expected by a test that sends
the offending event to a real server on loopback (tests/realtime)."""

from __future__ import annotations

import re
from pathlib import Path

from omnirt.sessions.errors import ErrorCode

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "realtime.md"
HEADER = "| case | ours | OpenAI's |"


def table() -> list[tuple[str, set[str], str]]:
    """(case, our codes, OpenAI's column) per row of the error-code table."""
    text = DOCS.read_text()
    assert HEADER in text, "docs/realtime.md has no error-code table"
    rows = []
    for line in text[text.index(HEADER) :].splitlines()[2:]:
        if not line.startswith("|"):
            break
        case, ours, openai = (cell.strip() for cell in line.strip("|").split(" | "))
        rows.append((case, set(re.findall(r"`([a-z_]+)`", ours)), openai))
    return rows


def test_the_table_lists_every_code_the_server_sends() -> None:
    rows = table()
    documented = set().union(*(codes for _, codes, _ in rows))
    assert documented == {c.value for c in ErrorCode}
    for case, codes, openai in rows:
        assert codes, f"row without a code: {case}"
        assert openai, f"row without OpenAI's code (or '—, extension'): {case}"


def test_every_code_in_the_table_is_expected_by_a_realtime_test() -> None:
    here = Path(__file__).name
    sources = "\n".join(p.read_text() for p in Path(__file__).parent.glob("test_*.py") if p.name != here)
    missing = [
        code for _, codes, _ in table() for code in sorted(codes) if f'"{code}"' not in sources
    ]
    assert not missing, f"codes no realtime test expects: {missing}"
