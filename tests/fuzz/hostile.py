"""Hostile JSON values and raw frames, shared by the realtime and HTTP fuzzers.

A :class:`Raw` is text that goes on the wire as is (``json.dumps`` cannot write it: integers of
thousands of digits, nesting past any parser's stack, invalid JSON); :func:`encode` writes a
value holding ``Raw`` pieces, and NaN / Infinity as Python's ``json`` writes them (non-standard
tokens that Python's parser, and so the server's, reads back as floats).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st


@dataclass(frozen=True)
class Raw:
    """JSON text spliced verbatim into an encoded value."""

    text: str

    def __repr__(self) -> str:
        return f"Raw({self.text[:40]!r}{'...' if len(self.text) > 40 else ''}, {len(self.text)} chars)"


@dataclass(frozen=True)
class Long:
    """A string of ``n`` characters ``char`` (kept short in failure reports)."""

    n: int
    char: str = "x"


def encode(value: Any) -> str:
    """``value`` as JSON text, with its :class:`Raw` pieces spliced in."""
    pieces: list[str] = []

    def swap(v: Any) -> Any:
        if isinstance(v, Raw):
            pieces.append(v.text)
            return f"\x00raw{len(pieces) - 1}\x00"
        if isinstance(v, Long):
            return v.char * v.n
        if isinstance(v, dict):
            return {k: swap(x) for k, x in v.items()}
        if isinstance(v, list):
            return [swap(x) for x in v]
        return v

    text = json.dumps(swap(value), allow_nan=True)
    for i, piece in enumerate(pieces):
        text = text.replace(json.dumps(f"\x00raw{i}\x00"), piece)
    return text


def nested(depth: int, kind: str = "list") -> Raw:
    """Objects or arrays nested ``depth`` levels (past 1,000 Python's parser gives up)."""
    if kind == "list":
        return Raw("[" * depth + "]" * depth)
    return Raw('{"a":' * depth + "1" + "}" * depth)


#: Strings that have broken servers: control characters, lone surrogates (valid JSON escapes that
#: no UTF-8 encoder takes), a NUL, bidi and combining marks, path and markup look-alikes.
ODD_STRINGS = [
    "",
    " ",
    "\x00",
    "\ud800",
    "a\udfffb",
    "\u202e\u0301\ufeff",
    "\r\n\t\x1b[31m",
    "../../../../etc/passwd",
    "%s%n%x{0}",
    "<script>alert(1)</script>",
    "NaN",
    "null",
    "0x10",
    "-1",
    "1e999",
    "\U0001f600" * 3,
]

#: Numbers past every bound: huge and tiny magnitudes, floats that are integers, NaN / Infinity.
ODD_NUMBERS: list[Any] = [
    0,
    -1,
    2**31,
    2**63,
    2**64,
    -(2**63) - 1,
    10**40,
    1e308,
    -1e308,
    5e-324,
    0.5,
    1.0,
    -0.0,
    float("nan"),
    float("inf"),
    float("-inf"),
]


def big_int(digits: int) -> Raw:
    """An integer of ``digits`` digits as JSON text (over 4,300, Python's int() refuses it)."""
    return Raw("9" * digits)


def json_values(max_leaves: int = 12) -> st.SearchStrategy[Any]:
    """Arbitrary JSON-ish values (what ``json.loads`` could give), odd numbers and strings mixed in."""
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.sampled_from(ODD_NUMBERS),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=12),
        st.sampled_from(ODD_STRINGS),
    )
    return st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4),
            st.dictionaries(st.text(max_size=8), inner, max_size=4),
        ),
        max_leaves=max_leaves,
    )


def odd_values() -> st.SearchStrategy[Any]:
    """A value where a field expects something else: any JSON value, a deep or huge one."""
    return st.one_of(
        json_values(),
        st.sampled_from(
            [
                nested(40),
                nested(40, "dict"),
                nested(3_000),
                nested(3_000, "dict"),
                big_int(5_000),
                big_int(400),
                Raw("-" + "9" * 5_000),
                Raw("1e99999"),
                Raw("-Infinity"),
            ]
        ),
        st.builds(Long, st.sampled_from([33, 65, 257, 4_097, 262_145])),
    )


def weighted(*choices: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """One of the strategies, picked with the given weights (the first ones are where shrinking
    goes)."""
    total = sum(w for w, _ in choices)

    @st.composite
    def pick(draw: st.DrawFn) -> Any:
        n = draw(st.integers(0, total - 1))
        for weight, strategy in choices:
            if n < weight:
                return draw(strategy)
            n -= weight
        raise AssertionError("unreachable")

    return pick()


def maybe_odd(plausible: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly ``plausible``, sometimes (1 in 12) any odd value in its place."""
    return weighted((11, plausible), (1, odd_values()))


def fields(
    required: dict[str, st.SearchStrategy[Any]], optional: dict[str, st.SearchStrategy[Any]]
) -> st.SearchStrategy[dict[str, Any]]:
    """An object with the ``required`` fields (each sometimes, 1 in 16, left out), each of the
    ``optional`` ones 1 time in 3, and sometimes (1 in 12) an unknown field."""

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, strategy in required.items():
            if draw(st.integers(0, 15)) < 15:
                out[name] = draw(strategy)
        for name, strategy in optional.items():
            if draw(st.integers(0, 2)) == 2:
                out[name] = draw(strategy)
        if draw(st.integers(0, 11)) == 11:
            out[draw(st.text(min_size=1, max_size=10))] = draw(odd_values())
        return out

    return build()


@dataclass(frozen=True)
class Frame:
    """One WebSocket message: ``text`` (a str), ``bad_utf8`` (bytes sent as a text frame) or
    ``binary``."""

    kind: str
    data: str | bytes

    def __repr__(self) -> str:  # keep failure reports readable
        shown = self.data if len(self.data) <= 300 else self.data[:300] + "..."  # type: ignore[operator]
        return f"Frame({self.kind}, {shown!r}, {len(self.data)} long)"


def malformed_frames() -> st.SearchStrategy[Frame]:
    """Frames that are not a well-formed JSON object."""
    texts = st.one_of(
        st.text(max_size=40),
        st.sampled_from(
            [
                "",
                "{",
                '{"type": "session.update"',
                "[]",
                "null",
                "42",
                '"session.update"',
                "NaN",
                '{"type": NaN}',
                '{"type": "session.update", "session": {"instructions": "a"}, "session": 1}',
                '{"type": "session.update"} trailing',
                '{"type": "input_audio_buffer.append", "audio": 12}',
                "\ufeff{}",
            ]
        ),
        st.builds(lambda v: encode(v), json_values()),
        st.sampled_from([nested(3_000).text, nested(3_000, "dict").text, big_int(5_000).text]),
    )
    return weighted(
        (4, texts.map(lambda t: Frame("text", t))),
        (1, st.binary(max_size=64).map(lambda b: Frame("binary", b))),
        (
            1,
            st.sampled_from(
                [b"\xff", b'{"type": "\xc3\x28"}', b"\xed\xa0\x80", b'"\xf8\x88\x80\x80\x80"']
            ).map(lambda b: Frame("bad_utf8", b)),
        ),
    )
