"""Strategies for HTTP requests to the JSON routes: bodies of the right shape with plausible and
hostile values, random JSON, bodies that are not JSON, and wrong or missing content types.

Valid requests ask for little work (images of at most 64x64 in 1-2 steps, videos of a few frames,
replies of 1-3 tokens), so the embedded models answer them in well under a second.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from .hostile import Long, encode, fields, json_values, maybe_odd, odd_values, weighted
from .realtime_events import PNG_B64, choice, short_text

CHAT = "/v1/chat/completions"
IMAGES = "/v1/images/generations"
VIDEOS = "/v1/videos"
JSON_ROUTES = [CHAT, IMAGES, VIDEOS]
SPEECH_MODEL = "demo-qwen3-omni"
IMAGE_MODEL = "demo-z-image"
VIDEO_MODEL = "demo-wan2.1-t2v"


@dataclass(frozen=True)
class HttpRequest:
    method: str
    path: str
    content_type: str | None
    body: bytes

    def __repr__(self) -> str:
        shown = self.body[:300] + (b"..." if len(self.body) > 300 else b"")
        size = len(self.body)
        return f"HttpRequest({self.method} {self.path}, {self.content_type!r}, {shown!r}, {size} bytes)"


def schema() -> st.SearchStrategy[Any]:
    props = st.dictionaries(
        st.text(min_size=1, max_size=6),
        st.fixed_dictionaries({"type": choice(["string", "integer", "boolean"], ["bogus", "null"])}),
        max_size=3,
    )
    return maybe_odd(st.fixed_dictionaries({"type": st.just("object"), "properties": props}))


def json_schema() -> st.SearchStrategy[Any]:
    return fields({"name": choice(["out"], ["", "bad name!"])}, {"schema": schema(), "strict": st.booleans()})


def chat_content(role: str) -> st.SearchStrategy[Any]:
    text = st.fixed_dictionaries({"type": st.just("text"), "text": maybe_odd(short_text())})
    parts = [text]
    if role == "user":
        parts += [
            st.fixed_dictionaries(
                {
                    "type": st.just("image_url"),
                    "image_url": fields(
                        {
                            "url": choice(
                                ["data:image/png;base64," + PNG_B64],
                                ["data:image/png;base64,AAAA", "http://x/y.png", ""],
                            )
                        },
                        {"detail": choice(["auto", "low"], ["max"])},
                    ),
                }
            ),
            st.fixed_dictionaries(
                {
                    "type": st.just("input_audio"),
                    "input_audio": fields(
                        {
                            "data": choice(["UklGRg=="], ["@@", ""]),
                            "format": choice(["wav", "mp3"], ["ogg", ""]),
                        },
                        {},
                    ),
                }
            ),
        ]
    return maybe_odd(weighted((3, short_text()), (2, st.lists(st.one_of(*parts), min_size=1, max_size=3))))


def message() -> st.SearchStrategy[Any]:
    def of_role(role: str) -> st.SearchStrategy[Any]:
        optional: dict[str, Any] = {"name": maybe_odd(st.text(max_size=8))}
        required: dict[str, Any] = {"role": st.just(role), "content": chat_content(role)}
        if role == "tool":
            required["tool_call_id"] = maybe_odd(st.sampled_from(["call_1", ""]))
        if role == "assistant":
            optional["tool_calls"] = maybe_odd(
                st.lists(
                    st.fixed_dictionaries(
                        {
                            "id": st.just("call_1"),
                            "type": st.just("function"),
                            "function": fields(
                                {
                                    "name": st.just("get_weather"),
                                    "arguments": choice(['{"city": "Paris"}'], ["{"]),
                                },
                                {},
                            ),
                        }
                    ),
                    max_size=2,
                )
            )
        return fields(required, optional)

    return maybe_odd(
        choice(["user", "system", "assistant"], ["tool", "developer", "function", ""]).flatmap(of_role)
    )


def tools() -> st.SearchStrategy[Any]:
    function = fields(
        {"name": maybe_odd(choice(["get_weather", "lookup"], ["bad name!", Long(65), ""]))},
        {"description": maybe_odd(short_text()), "parameters": schema(), "strict": st.booleans()},
    )
    return maybe_odd(
        st.lists(
            fields({"type": choice(["function"], ["custom", "web"]), "function": function}, {}), max_size=2
        )
    )


def chat_body() -> st.SearchStrategy[Any]:
    return fields(
        {
            "model": maybe_odd(choice([SPEECH_MODEL], ["gpt-4o", "", IMAGE_MODEL, "../" * 8])),
            "messages": maybe_odd(st.lists(message(), min_size=1, max_size=3)),
        },
        {
            "max_tokens": maybe_odd(choice([1, 2, 3], [0, -1, 10**30])),
            "max_completion_tokens": maybe_odd(choice([1, 2], [0])),
            "temperature": maybe_odd(choice([0, 0.7, 2], [-1, 3, float("nan")])),
            "top_p": maybe_odd(choice([0.5, 1], [2, float("inf")])),
            "seed": maybe_odd(choice([0, 7, 2**63 - 1], [-1, 2**64, 10**40])),
            "stop": maybe_odd(choice(["\n", ["a", "b"]], [[], [""] * 5, 3])),
            "n": maybe_odd(choice([1], [0, 2, 10**9])),
            "stream": maybe_odd(st.booleans()),
            "stream_options": maybe_odd(fields({}, {"include_usage": st.booleans()})),
            "modalities": maybe_odd(choice([["text"]], [["text", "audio"], ["audio"], []])),
            "audio": maybe_odd(
                fields({}, {"voice": choice(["alloy"], ["nobody"]), "format": choice(["wav"], ["ogg"])})
            ),
            "response_format": maybe_odd(
                weighted(
                    (2, choice([{"type": "text"}, {"type": "json_object"}], [{"type": "xml"}])),
                    (1, fields({"type": st.just("json_schema"), "json_schema": json_schema()}, {})),
                )
            ),
            "logprobs": maybe_odd(st.booleans()),
            "tools": tools(),
            "tool_choice": maybe_odd(
                choice(
                    ["auto", "none", "required", {"type": "function", "function": {"name": "get_weather"}}],
                    ["any", {"type": "function"}, {"type": "allowed_tools"}],
                )
            ),
            "functions": st.lists(json_values(), max_size=1),
            "user": maybe_odd(short_text()),
        },
    )


SIZES = ["16x16", "32x32", "64x48"]
BAD_SIZES = [
    "17x17",
    "0x0",
    "4096x4096",
    "8192x16",
    "1x1",
    "auto",
    "abc",
    "64x-64",
    "99999999999999999999x16",
    "16X16 ",
]


def image_body() -> st.SearchStrategy[Any]:
    return fields(
        {"prompt": maybe_odd(choice(["a red fox", "x"], ["", " ", Long(32_001)]))},
        {
            "model": maybe_odd(choice([IMAGE_MODEL], [SPEECH_MODEL, "dall-e-3", VIDEO_MODEL])),
            "n": maybe_odd(choice([1, 2], [0, 5, 10**9])),
            "size": maybe_odd(choice(SIZES, BAD_SIZES)),
            "response_format": maybe_odd(choice(["b64_json"], ["url"])),
            "output_format": maybe_odd(choice(["png"], ["jpeg", "svg"])),
            "background": maybe_odd(choice(["auto", "opaque"], ["transparent"])),
            "quality": maybe_odd(choice(["low", "auto"], ["ultra"])),
            "stream": maybe_odd(st.booleans()),
            "partial_images": maybe_odd(choice([0, 1, 2], [4, -1])),
            "seed": maybe_odd(choice([0, 5, 2**64 - 1], [-1, 2**64, 10**40])),
            "num_inference_steps": maybe_odd(choice([1, 2], [0, 201, 10**20])),
            "guidance_scale": maybe_odd(choice([0, 1.5], [-1, float("inf"), 1e308])),
            "negative_prompt": maybe_odd(short_text()),
        },
    )


def video_fields() -> st.SearchStrategy[dict[str, Any]]:
    return fields(
        {"prompt": maybe_odd(choice(["waves", "a cat"], ["", Long(32_001)]))},
        {
            "model": maybe_odd(choice([VIDEO_MODEL], [IMAGE_MODEL, "sora-2"])),
            "seconds": maybe_odd(choice([0.1, "0.2"], [0, -1, 61, "4x", "nan", "inf", 1e308])),
            "size": maybe_odd(choice(["16x16", "32x32"], BAD_SIZES)),
            "seed": maybe_odd(choice([1, "2"], [-1, 2**64, "1e400"])),
            "num_inference_steps": maybe_odd(choice([1, 2], [0, 201, 10**20])),
            "num_frames": maybe_odd(choice([1, 5], [0, 2049, 10**30, "many"])),
            "fps": maybe_odd(choice([8], [0, 121])),
            "guidance_scale": maybe_odd(choice([1.0], [-2, "nan"])),
            "negative_prompt": maybe_odd(short_text()),
            "input_reference": weighted((5, st.just("")), (1, st.just("data:image/png;base64," + PNG_B64))),
        },
    )


def _form(data: dict[str, Any]) -> bytes:
    return urllib.parse.urlencode(
        {k: v if isinstance(v, str) else encode(v) for k, v in data.items()}
    ).encode()


def _multipart(data: dict[str, Any], with_file: bool) -> tuple[str, bytes]:
    boundary = "fuzzboundary7MA4YWxk"
    out = b""
    for name, value in data.items():
        text = value if isinstance(value, str) else encode(value)
        out += (
            f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'.encode()
            + text.encode("utf-8", "surrogatepass")
            + b"\r\n"
        )
    if with_file:
        out += (
            (
                f"--{boundary}\r\n"
                'Content-Disposition: form-data; name="input_reference"; filename="a.png"\r\n'
                "Content-Type: image/png\r\n\r\n"
            ).encode()
            + b"\x89PNG\r\n"
            + b"\r\n"
        )
    out += f"--{boundary}--\r\n".encode()
    return f"multipart/form-data; boundary={boundary}", out


def _json(path: str, body: Any, content_type: str | None = "application/json") -> HttpRequest:
    return HttpRequest("POST", path, content_type, encode(body).encode("utf-8", "surrogatepass"))


CONTENT_TYPES = [
    None,
    "text/plain",
    "application/json; charset=latin-1",
    "application/vnd.api+json",
    "APPLICATION/JSON",
    "application/x-www-form-urlencoded",
    "multipart/form-data",  # no boundary
    "application/json, text/plain",
    "",
]


def requests() -> st.SearchStrategy[HttpRequest]:
    """One request to a JSON route (or a video id route)."""
    route = st.sampled_from(JSON_ROUTES)
    ids = choice(
        ["video_fuzz", "video_" + "a" * 20], ["", "..", "%2e%2e%2fetc%2fpasswd", "a" * 300, "\u00e9"]
    )
    return weighted(
        (4, chat_body().map(lambda b: _json(CHAT, b))),
        (4, image_body().map(lambda b: _json(IMAGES, b))),
        (3, video_fields().map(lambda b: _json(VIDEOS, b))),
        (
            1,
            video_fields().map(
                lambda b: HttpRequest("POST", VIDEOS, "application/x-www-form-urlencoded", _form(b))
            ),
        ),
        (
            1,
            st.tuples(video_fields(), st.booleans()).map(
                lambda a: HttpRequest("POST", VIDEOS, *_multipart(a[0], a[1]))
            ),
        ),
        (2, st.tuples(route, st.one_of(json_values(), odd_values())).map(lambda a: _json(a[0], a[1]))),
        (
            1,
            st.tuples(
                route, st.binary(max_size=64), st.sampled_from(["application/json", *CONTENT_TYPES])
            ).map(lambda a: HttpRequest("POST", a[0], a[2], a[1])),
        ),
        (
            1,
            st.tuples(route, chat_body(), st.sampled_from(CONTENT_TYPES)).map(
                lambda a: HttpRequest("POST", a[0], a[2], encode(a[1]).encode("utf-8", "surrogatepass"))
            ),
        ),
        (
            1,
            st.tuples(
                st.sampled_from(["GET", "DELETE"]),
                ids,
                st.sampled_from(["", "/content", "/content?variant=x"]),
            ).map(lambda a: HttpRequest(a[0], f"{VIDEOS}/{a[1]}{a[2]}", None, b"")),
        ),
        (
            1,
            st.sampled_from(
                [
                    "/v1/models/" + SPEECH_MODEL,
                    "/v1/models/nope",
                    "/v1/videos?limit=-1",
                    "/v1/videos?after=x&limit=99999999999999999999",
                ]
            ).map(lambda p: HttpRequest("GET", p, None, b"")),
        ),
    )
