"""The page against the real model: the embedded Qwen3-Omni default (random weights), not a fake.

What a newcomer sees after ``omnirt serve``: the model's name and the random-weights notice,
a turn from the microphone answered by thinker -> talker -> code2wav, played and acknowledged.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from omnirt.realtime.app import create_app
from omnirt.realtime.config import ServerConfig
from omnirt.stages.engine import Engine, EngineClient
from omnirt.stages.factory import build_pipeline

from tests.server import serve

from .browser import requires_browser
from .conftest import Web, open_ui, played, sent_audio_samples, server_transcript
from .recorder import Recorder

pytestmark = requires_browser


@pytest.fixture(scope="module")
def demo_web(tmp_path_factory: pytest.TempPathFactory, web: Web) -> Iterator[Web]:
    mp = pytest.MonkeyPatch()
    mp.setenv("OMNIRT_CACHE", str(tmp_path_factory.mktemp("cache")))
    try:
        pipeline = build_pipeline(None, device="cpu", max_slots=2)
        # Random weights never stop on their own: keep each reply to 10 thinker tokens.
        app = create_app(EngineClient(Engine(pipeline)), ServerConfig(max_output_tokens=10))
        recorder = Recorder(app)
        with serve(recorder) as base_url:
            yield Web(base_url, pipeline, recorder, web.shots)  # type: ignore[arg-type]
    finally:
        mp.undo()


def test_a_manual_turn_is_answered_by_the_real_pipeline(page: Any, demo_web: Web) -> None:
    conn = open_ui(page, demo_web, "manual")
    assert "demo-qwen3-omni" in page.inner_text("#model")
    assert page.is_visible("#random-weights")
    page.wait_for_function("() => window.omnirt.session.appendedMs >= 1500")
    page.click("#send-turn")
    page.wait_for_function("() => window.omnirt.session.log.acks.length >= 1", timeout=60_000)
    page.wait_for_selector("#assistant-speaking[data-active=false]")

    (done,) = conn.server_events("response.done")
    assert done["response"]["status"] == "incomplete"  # the 10-token budget, as configured
    assert done["response"]["usage"]["input_token_details"]["audio_tokens"] > 0
    (item_id,) = {e["item_id"] for e in conn.server_events("response.output_audio.delta")}
    counters = played(page)[item_id]
    # Every sample the model produced was played, and the ack reports exactly that.
    assert counters["samples"] == counters["received"] == sent_audio_samples(conn, item_id) > 0
    (ack,) = conn.client_events("playback.ack")
    assert ack["played_ms"] == counters["ms"]
    (acked,) = conn.server_events("playback.acknowledged")
    assert acked["played_ms"] == ack["played_ms"]
    text = server_transcript(conn, item_id)
    assert text and page.inner_text(f"#transcript li[data-item-id={item_id}] .text") == text
    page.screenshot(path=demo_web.shots / "demo-manual.png", full_page=True)
