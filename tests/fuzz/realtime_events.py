"""Strategies for realtime client events: every client type, well-formed and mutated.

Field values are mostly plausible (what a client could mean: short texts, small limits, the ids
of a small pool so that creates, deletes, truncates and references meet) and sometimes hostile
(:func:`.hostile.maybe_odd`: wrong types, deep and huge values, NaN, odd strings); required fields
are sometimes left out and unknown ones added (:func:`.hostile.fields`). Replies are kept short
(``max_output_tokens`` 1-3 when plausible), so the served model spends little time on them.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
from hypothesis import strategies as st
from PIL import Image

from .hostile import Frame, Long, encode, fields, malformed_frames, maybe_odd, odd_values, weighted

ITEM_IDS = ["item_fuzz_a", "item_fuzz_b", "item_fuzz_c"]
BAD_ITEM_IDS = ["", Long(33), "item_fuzz_a "]
RESPONSE_IDS = ["resp_fuzz", "", None]
CALL_IDS = ["call_fuzz_a", "call_fuzz_b"]
FORMATS = ["audio/pcm", "audio/pcmu", "audio/pcma"]
BAD_FORMATS = ["audio/wav", "pcm16", ""]
VOICES = ["alloy", "echo", "marin"]
BAD_VOICES = ["nobody", "", Long(65)]


def choice(good: list[Any], bad: list[Any]) -> st.SearchStrategy[Any]:
    """One of ``good`` (6 in 7), else one of ``bad``."""
    return weighted((6, st.sampled_from(good)), (1, st.sampled_from(bad)))


def item_ids() -> st.SearchStrategy[Any]:
    return maybe_odd(choice(ITEM_IDS, BAD_ITEM_IDS))


def _png() -> str:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


PNG_B64 = _png()


def pcm(ms: int) -> bytes:
    t = np.arange(24 * ms) / 24_000
    return (0.3 * np.sin(2 * np.pi * 330 * t) * 32767).astype("<i2").tobytes()


def audio_b64() -> st.SearchStrategy[str]:
    """Base64 of real tone audio, of random bytes (odd counts too), or text that is not base64."""
    return st.one_of(
        st.sampled_from([20, 100, 300]).map(lambda ms: base64.b64encode(pcm(ms)).decode()),
        st.binary(max_size=300).map(lambda b: base64.b64encode(b).decode()),
        st.sampled_from(["", "=", "AAA", "AA==AA==", "@@@@", "AAAA\n", "////", "AQ"]),
        st.text(max_size=16),
    )


def short_text() -> st.SearchStrategy[str]:
    return st.one_of(st.text(max_size=24), st.sampled_from(["hello", "what is the weather?", "\ud800"]))


def schema() -> st.SearchStrategy[Any]:
    """Tool parameter schemas: valid small ones, and nonsense."""
    prop = st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "array", "bogus", 3])})
    valid = st.fixed_dictionaries(
        {"type": st.just("object"), "properties": st.dictionaries(st.text(max_size=6), prop, max_size=3)},
        optional={
            "required": st.lists(st.text(max_size=6), max_size=2),
            "additionalProperties": st.booleans(),
        },
    )
    return maybe_odd(valid)


def tool() -> st.SearchStrategy[Any]:
    return maybe_odd(
        fields(
            {"name": maybe_odd(choice(["get_weather", "lookup"], ["bad name!", Long(65), ""]))},
            {
                "type": maybe_odd(choice(["function"], ["mcp", "web"])),
                "description": maybe_odd(short_text()),
                "parameters": schema(),
                "server_url": st.just("http://127.0.0.1:1"),
            },
        )
    )


def tool_choice() -> st.SearchStrategy[Any]:
    return maybe_odd(
        st.one_of(
            choice(["auto", "none", "required"], ["any"]),
            fields(
                {"type": choice(["function"], ["mcp"])},
                {"name": choice(["get_weather"], ["missing"]), "server_label": st.text(max_size=4)},
            ),
        )
    )


def audio_format() -> st.SearchStrategy[Any]:
    return maybe_odd(
        fields(
            {},
            {"type": maybe_odd(choice(FORMATS, BAD_FORMATS)), "rate": maybe_odd(choice([24000], [16000]))},
        )
    )


def turn_detection() -> st.SearchStrategy[Any]:
    server_vad = fields(
        {"type": st.just("server_vad")},
        {
            "threshold": maybe_odd(st.floats(0, 1)),
            "prefix_padding_ms": maybe_odd(st.integers(0, 1000)),
            "silence_duration_ms": maybe_odd(st.integers(0, 1000)),
            "create_response": maybe_odd(st.booleans()),
            "interrupt_response": maybe_odd(st.booleans()),
            "idle_timeout_ms": maybe_odd(st.integers(100, 10_000)),
        },
    )
    semantic = fields(
        {"type": st.just("semantic_vad")},
        {"eagerness": maybe_odd(st.sampled_from(["low", "medium", "high", "auto"]))},
    )
    return st.one_of(st.none(), server_vad, semantic, odd_values())


def session() -> st.SearchStrategy[Any]:
    audio_input = fields(
        {},
        {
            "format": audio_format(),
            "transcription": maybe_odd(
                fields(
                    {},
                    {
                        "model": maybe_odd(st.sampled_from(["whisper-1", "gpt-4o-transcribe"])),
                        "language": maybe_odd(choice(["en"], ["xx", ""])),
                        "prompt": maybe_odd(short_text()),
                        "keywords": maybe_odd(st.lists(short_text(), max_size=3)),
                    },
                )
            ),
            "noise_reduction": maybe_odd(
                st.one_of(st.none(), fields({}, {"type": st.sampled_from(["near_field", "far_field"])}))
            ),
            "turn_detection": turn_detection(),
        },
    )
    audio_output = fields(
        {},
        {
            "format": audio_format(),
            "voice": maybe_odd(
                weighted((6, choice(VOICES, BAD_VOICES)), (1, fields({"id": st.sampled_from(VOICES)}, {})))
            ),
            "speed": maybe_odd(st.floats(0.25, 1.5)),
        },
    )
    return maybe_odd(
        fields(
            {},
            {
                "type": maybe_odd(st.just("realtime")),
                "model": maybe_odd(st.just("gpt-realtime")),
                "instructions": maybe_odd(short_text()),
                "output_modalities": maybe_odd(
                    choice([["audio"], ["text"]], [["image"], [], ["audio", "text"]])
                ),
                "audio": maybe_odd(
                    fields({}, {"input": maybe_odd(audio_input), "output": maybe_odd(audio_output)})
                ),
                "tools": maybe_odd(st.lists(tool(), max_size=3)),
                "tool_choice": tool_choice(),
                "max_output_tokens": maybe_odd(st.one_of(st.integers(1, 3), st.just("inf"))),
                "tracing": odd_values(),
                "truncation": odd_values(),
            },
        )
    )


IMAGE_URLS = ["data:image/png;base64," + PNG_B64]
BAD_IMAGE_URLS = [
    "data:image/png;base64,AAAA",  # base64 of no image
    "data:image/jpeg;base64,not base64!",
    "data:image/gif;base64,",
    "https://example.com/cat.png",
    "file:///etc/passwd",
]
#: The content part types each role holds, and the fields of each.
ROLE_PARTS = {
    "user": ["input_text", "input_audio", "input_image"],
    "assistant": ["output_text", "output_audio"],
    "system": ["input_text"],
}


def content_part(kinds: list[str]) -> st.SearchStrategy[Any]:
    """A content part of one of ``kinds`` (sometimes of another kind)."""
    every = sorted({k for ks in ROLE_PARTS.values() for k in ks})
    shapes = {
        "input_text": ({"text": maybe_odd(short_text())}, {}),
        "output_text": ({"text": maybe_odd(short_text())}, {}),
        "input_audio": ({"audio": maybe_odd(audio_b64())}, {"transcript": maybe_odd(short_text())}),
        "output_audio": ({}, {"audio": maybe_odd(audio_b64()), "transcript": maybe_odd(short_text())}),
        "input_image": (
            {"image_url": maybe_odd(choice(IMAGE_URLS, BAD_IMAGE_URLS))},
            {"detail": maybe_odd(choice(["auto", "low", "high"], ["max"]))},
        ),
    }
    return maybe_odd(
        choice(kinds, every).flatmap(
            lambda kind: fields({"type": st.just(kind), **shapes[kind][0]}, shapes[kind][1])
        )
    )


def message() -> st.SearchStrategy[Any]:
    return choice(sorted(ROLE_PARTS), ["tool", "developer"]).flatmap(
        lambda role: fields(
            {
                "type": st.just("message"),
                "role": st.just(role),
                "content": maybe_odd(
                    st.lists(content_part(ROLE_PARTS.get(role, ["input_text"])), max_size=3)
                ),
            },
            {
                "id": item_ids(),
                "status": maybe_odd(choice(["completed", "incomplete"], ["in_progress", "done"])),
                "object": st.just("realtime.item"),
            },
        )
    )


def item() -> st.SearchStrategy[Any]:
    common = {"id": item_ids(), "object": st.just("realtime.item")}
    call = fields(
        {
            "type": st.just("function_call"),
            "name": maybe_odd(choice(["get_weather"], ["bad name", ""])),
            "arguments": maybe_odd(choice(['{"city": "Paris"}'], ["{", ""])),
        },
        {**common, "call_id": maybe_odd(st.sampled_from(CALL_IDS))},
    )
    output = fields(
        {
            "type": st.just("function_call_output"),
            "call_id": maybe_odd(st.sampled_from(CALL_IDS)),
            "output": maybe_odd(short_text()),
        },
        common,
    )
    return maybe_odd(weighted((6, message()), (2, call), (2, output)))


def response_input() -> st.SearchStrategy[Any]:
    reference = fields({"type": st.just("item_reference"), "id": item_ids()}, {})
    return st.lists(weighted((3, item()), (1, reference)), max_size=3)


def response() -> st.SearchStrategy[Any]:
    return maybe_odd(
        fields(
            {},
            {
                "instructions": maybe_odd(short_text()),
                "output_modalities": maybe_odd(choice([["audio"], ["text"]], [[], ["audio", "text"], ["x"]])),
                "max_output_tokens": maybe_odd(choice([1, 2, 3], [0, 4097, "inf"])),
                "conversation": maybe_odd(choice(["auto", "none"], ["other", ""])),
                "input": maybe_odd(response_input()),
                "metadata": maybe_odd(st.dictionaries(st.text(max_size=8), short_text(), max_size=3)),
                "audio": maybe_odd(
                    fields(
                        {},
                        {
                            "output": maybe_odd(
                                fields({}, {"voice": choice(VOICES, BAD_VOICES), "format": audio_format()})
                            )
                        },
                    )
                ),
                "tools": maybe_odd(st.lists(tool(), max_size=2)),
                "tool_choice": tool_choice(),
            },
        )
    )


def beta_session() -> st.SearchStrategy[Any]:
    """A ``session.update`` payload of the beta protocol (refused as unknown fields on GA)."""
    return fields(
        {},
        {
            "modalities": maybe_odd(choice([["text"], ["audio", "text"]], [["audio"], []])),
            "voice": maybe_odd(choice(VOICES, BAD_VOICES)),
            "instructions": maybe_odd(short_text()),
            "input_audio_format": maybe_odd(choice(["pcm16", "g711_ulaw", "g711_alaw"], ["audio/pcm", ""])),
            "output_audio_format": maybe_odd(choice(["pcm16", "g711_ulaw"], ["mp3"])),
            "input_audio_transcription": maybe_odd(
                st.one_of(st.none(), fields({}, {"model": st.just("whisper-1")}))
            ),
            "turn_detection": turn_detection(),
            "temperature": maybe_odd(st.floats(0.6, 1.2)),
            "max_response_output_tokens": maybe_odd(choice([1, 3, "inf"], [0, -1])),
            "tools": maybe_odd(st.lists(tool(), max_size=2)),
            "tool_choice": tool_choice(),
        },
    )


def _event(
    kind: str, required: dict[str, Any], optional: dict[str, Any] | None = None
) -> st.SearchStrategy[Any]:
    return fields(
        {"type": st.just(kind), **required},
        {"event_id": maybe_odd(st.sampled_from(["evt_fuzz", "", Long(40)])), **(optional or {})},
    )


def client_events() -> st.SearchStrategy[Any]:
    """Client events of every type the protocol has (and a few it does not), as dicts; weighted
    toward the ones that change state (items, audio, responses, session updates)."""
    item_id = item_ids()
    return weighted(
        (5, _event("session.update", {"session": session()})),
        (2, _event("session.update", {"session": beta_session()})),
        (
            6,
            _event(
                "conversation.item.create",
                {"item": item()},
                {"previous_item_id": item_ids()},
            ),
        ),
        (4, _event("input_audio_buffer.append", {"audio": audio_b64()})),
        (2, _event("input_audio_buffer.commit", {})),
        (1, _event("input_audio_buffer.clear", {})),
        (5, _event("response.create", {}, {"response": response()})),
        (2, _event("response.cancel", {}, {"response_id": maybe_odd(st.sampled_from(RESPONSE_IDS))})),
        (1, _event("conversation.item.retrieve", {"item_id": item_id})),
        (1, _event("conversation.item.delete", {"item_id": item_id})),
        (
            2,
            _event(
                "conversation.item.truncate",
                {
                    "item_id": item_id,
                    "content_index": maybe_odd(st.integers(0, 2)),
                    "audio_end_ms": maybe_odd(st.integers(0, 2_000)),
                },
            ),
        ),
        (
            1,
            _event(
                "playback.ack",
                {
                    "response_id": maybe_odd(st.sampled_from(RESPONSE_IDS)),
                    "item_id": item_id,
                    "played_ms": maybe_odd(st.integers(0, 2_000)),
                },
            ),
        ),
        (1, _event("output_audio_buffer.clear", {})),
        (1, _event("transcription_session.update", {"session": session()})),
        (1, _event("session.close", {})),
        (1, st.builds(lambda kind: {"type": kind}, maybe_odd(st.text(max_size=30)))),
    )


def frames() -> st.SearchStrategy[Frame]:
    """One client frame: mostly an event of the protocol, sometimes a malformed frame."""
    return weighted(
        (6, client_events().map(lambda e: Frame("text", encode(e)))),
        (1, malformed_frames()),
    )
