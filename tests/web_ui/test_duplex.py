"""The Full duplex profile end to end: the page against the real server with the embedded duplex
model (the demo Moshi, sampled with a fixed seed, in real time) and the fake microphone playing
real speech. Audio streams up all the time with no commits, and each stretch of model speech,
bracketed by response.created / response.done, is played, shown and acknowledged."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from omnirt.realtime.app import create_app
from omnirt.realtime.config import ServerConfig
from omnirt.stages.engine import Engine, EngineClient

from tests.duplex.helpers import pipeline
from tests.server import serve

from .browser import requires_browser
from .conftest import ReplyPipeline, Web, open_ui, played, sent_audio_samples, server_transcript
from .recorder import Recorder

pytestmark = requires_browser

STRETCHES = 2


@pytest.fixture(scope="module")
def duplex_web(web: Web) -> Iterator[Web]:
    speech = ReplyPipeline(step_seconds=0.05)
    app = create_app(EngineClient(Engine([speech, pipeline(slots=2)])), ServerConfig(vad_preload=False))
    recorder = Recorder(app)
    with serve(recorder) as base_url:
        yield Web(base_url, speech, recorder, web.shots)


def test_duplex_profile_streams_both_ways_and_plays_each_stretch(page: Any, duplex_web: Web) -> None:
    page.goto(duplex_web.base_url + "/")
    page.check("input[name=profile][value=duplex]")
    assert "demo-moshi" in page.inner_text("#model")  # the profile names the model it talks to
    assert page.inner_text("#real-model-flag") == "--duplex-model PATH"
    conn = open_ui(page, duplex_web, "duplex")
    page.wait_for_function(f"() => window.omnirt.session.log.acks.length >= {STRETCHES}", timeout=40_000)
    page.wait_for_timeout(300)  # the microphone keeps streaming after the replies

    assert conn.query.get("duplex") == ["1"]
    types = [e["type"] for e in conn.client_events()]
    assert set(types) == {"input_audio_buffer.append", "playback.ack"}  # no commits, no session.update
    last_ack = len(types) - 1 - types[::-1].index("playback.ack")
    assert "input_audio_buffer.append" in types[last_ack + 1 :], "the microphone stopped"

    done = {e["response"]["id"]: e["response"] for e in conn.server_events("response.done")}
    for ack in conn.client_events("playback.ack")[:STRETCHES]:
        item_id = ack["item_id"]
        assert done[ack["response_id"]]["status"] == "completed"
        # Every sample of the stretch was played, and the ack says exactly that.
        counters = played(page)[item_id]
        assert counters["samples"] == counters["received"] == sent_audio_samples(conn, item_id) > 0
        assert ack["played_ms"] == counters["ms"]
        text = server_transcript(conn, item_id)
        # The page shows exactly the text the server streamed (textContent: the model's sampled
        # text may hold control characters, which innerText and str.strip treat differently).
        assert text and page.text_content(f"#transcript li[data-item-id={item_id}] .text") == text
    # Full duplex: the microphone's audio went up while the model's audio came down.
    first = conn.client_events("playback.ack")[0]["response_id"]
    created = next(f.at for f in conn.sent if f.event.get("response", {}).get("id") == first)
    ended = next(
        f.at for f in conn.sent if f.event["type"] == "response.done" and f.event["response"]["id"] == first
    )
    during = [
        f for f in conn.received if created < f.at < ended and f.event["type"] == "input_audio_buffer.append"
    ]
    assert len(during) >= 3
    assert page.inner_text("#messages") == ""
    page.screenshot(path=duplex_web.shots / "duplex.png", full_page=True)
