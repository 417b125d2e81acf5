"""Manual turns in a real browser: fake microphone -> Send turn -> the reply played and shown."""

from __future__ import annotations

import base64
import re

import numpy as np

from .browser import requires_browser
from .conftest import open_ui, page_log, played, sent_audio_samples, server_transcript

pytestmark = requires_browser


def test_manual_turn_from_microphone_to_played_reply(page, web):
    web.reply(frames_per_word=2, step_seconds=0.05)
    conn = open_ui(page, web, "manual", camera=True)
    assert "echo-test" in page.inner_text("#model")
    assert page.is_visible("#random-weights")
    # The fake microphone's speech reaches the level meter and the server.
    page.wait_for_function("() => document.getElementById('level').value > 0.1")
    page.wait_for_function("() => window.omnirt.session.appendedMs >= 1500")
    page.click("#send-turn")
    page.wait_for_function("() => window.omnirt.session.log.acks.length >= 1")
    page.wait_for_selector("#assistant-speaking[data-active=false]")

    types = [e["type"] for e in conn.client_events()]
    commit = types.index("input_audio_buffer.commit")
    create = types.index("response.create")
    assert create == commit + 1
    # One camera frame went with the turn, as an input_image item, before the commit.
    images = [i for i, e in enumerate(conn.client_events()) if e["type"] == "conversation.item.create"]
    assert len(images) == 1 and images[0] < commit
    image_url = conn.client_events()[images[0]]["item"]["content"][0]["image_url"]
    assert image_url.startswith("data:image/jpeg;base64,")

    # Audio arrives as 24 kHz PCM16 in 100 ms appends (the one before the commit is the flush),
    # in real time: the audio sent matches the wall time it took.
    appends = [f for f in conn.received if f.event["type"] == "input_audio_buffer.append"]
    turn = [f for f in appends if f.at <= conn.received[commit].at]
    sizes = [len(base64.b64decode(f.event["audio"])) for f in turn]
    assert all(size == 4800 for size in sizes[:-1]) and sizes[-1] % 2 == 0
    audio_ms = sum(sizes) / 48
    wall_ms = (turn[-1].at - turn[0].at) * 1000 + 100
    assert abs(audio_ms - wall_ms) < 0.15 * wall_ms, (audio_ms, wall_ms)
    pcm = np.frombuffer(b"".join(base64.b64decode(f.event["audio"]) for f in turn), "<i2").astype(float)
    assert np.sqrt(np.mean(pcm**2)) > 300, "the microphone audio is silent"

    # The microphone pauses while the reply plays: nothing is appended until its final ack.
    ack_index = types.index("playback.ack")
    assert "input_audio_buffer.append" not in types[create:ack_index]

    # The reply was played to its last sample, the ack says so, and the server agreed.
    (item_id,) = {e["item_id"] for e in conn.server_events("response.output_audio.delta")}
    counters = played(page)[item_id]
    assert counters["samples"] == counters["received"] == sent_audio_samples(conn, item_id) > 0
    (ack,) = conn.client_events("playback.ack")
    assert (
        ack["item_id"] == item_id
        and ack["played_ms"] == counters["ms"] == counters["samples"] * 1000 // 24000
    )
    assert conn.client_events("conversation.item.truncate") == []

    # The transcript shows what the server said, and the latency of the reply.
    text = server_transcript(conn, item_id)
    assert re.fullmatch(r"You said: \d+ ms of audio\.", text)
    assert page.inner_text(f"#transcript li[data-item-id={item_id}] .text") == text
    log = page_log(page)
    assert len(log["latencies"]) == 1
    assert page.inner_text("#latency") == f"{log['latencies'][0]} ms"
    assert page.inner_text("#messages") == ""
    page.screenshot(path=web.shots / "manual.png", full_page=True)


def test_server_acknowledges_playback(page, web):
    """playback.ack (extension) is answered with playback.acknowledged echoing played_ms."""
    web.reply(frames_per_word=1, step_seconds=0.02)
    conn = open_ui(page, web, "manual")
    page.wait_for_function("() => window.omnirt.session.appendedMs >= 500")
    page.click("#send-turn")
    page.wait_for_function("() => window.omnirt.session.acksSupported !== null")
    (ack,) = conn.client_events("playback.ack")
    (answer,) = conn.server_events("playback.acknowledged")
    assert (answer["item_id"], answer["played_ms"]) == (ack["item_id"], ack["played_ms"])
    assert page.evaluate("() => window.omnirt.session.acksSupported") is True
