"""Server VAD in a real browser: the fake microphone's speech ends turns on its own, and speech
during a reply interrupts it (barge-in) with the truncate and ack matching what was played."""

from __future__ import annotations

from .browser import requires_browser
from .conftest import open_ui, page_log, played, sent_audio_samples, server_transcript

pytestmark = requires_browser


def test_vad_turn_is_detected_answered_and_played(page, web):
    web.reply(frames_per_word=1, step_seconds=0.03)
    conn = open_ui(page, web, "vad")
    page.wait_for_function("() => window.omnirt.session.log.acks.length >= 1")
    updated = conn.server_events("session.updated")
    assert updated and updated[-1]["session"]["audio"]["input"]["turn_detection"]["type"] == "server_vad"
    assert conn.server_events("input_audio_buffer.speech_started")
    stopped = conn.server_events("input_audio_buffer.speech_stopped")
    assert stopped
    # No commit or response.create from the page: the server made the turn.
    types = [e["type"] for e in conn.client_events()]
    assert "input_audio_buffer.commit" not in types and "response.create" not in types

    ack = conn.client_events("playback.ack")[0]
    item_id = ack["item_id"]
    counters = played(page)[item_id]
    assert counters["samples"] == sent_audio_samples(conn, item_id) > 0, "the reply was not played to its end"
    assert ack["played_ms"] == counters["ms"]
    text = server_transcript(conn, item_id)
    assert text.startswith("You said:")
    page.wait_for_selector(f"#transcript li[data-item-id={item_id}].final")
    assert page.inner_text(f"#transcript li[data-item-id={item_id}] .text") == text
    # Latency counts from the end of speech, so it includes the 500 ms of silence VAD waits for.
    latency = page_log(page)["latencies"][0]
    assert 500 < latency < 2500
    assert page.inner_text("#messages") == ""
    page.screenshot(path=web.shots / "server-vad.png", full_page=True)


def test_vad_barge_in_stops_playback_and_truncates_what_was_heard(page, web):
    # A reply far longer than the pause in the looping speech, still generating when the next
    # sentence starts: that sentence barges in.
    web.reply(frames_per_word=8, step_seconds=0.4)
    conn = open_ui(page, web, "vad")
    page.wait_for_function("() => window.omnirt.session.log.truncates.length >= 1")
    truncate = page_log(page)["truncates"][0]
    item_id = truncate["item_id"]
    at_stop = played(page)[item_id]
    page.wait_for_timeout(300)
    after = played(page)[item_id]
    assert after["samples"] == at_stop["samples"] == truncate["played"], "playback went on after the stop"
    assert 0 < truncate["played"] < sent_audio_samples(conn, item_id), "not an interruption"
    assert truncate["audio_end_ms"] == truncate["played"] * 1000 // 24000

    # What the server saw: speech_started during the reply, the response cancelled by the turn,
    # then the page's truncate and ack carrying the played milliseconds.
    response_id = next(
        e["response_id"] for e in conn.server_events("response.output_audio.delta") if e["item_id"] == item_id
    )
    done = next(e for e in conn.server_events("response.done") if e["response"]["id"] == response_id)
    assert done["response"]["status"] == "cancelled"
    assert done["response"]["status_details"]["reason"] == "turn_detected"
    (sent_truncate,) = [
        e for e in conn.client_events("conversation.item.truncate") if e["item_id"] == item_id
    ]
    assert sent_truncate["audio_end_ms"] == truncate["audio_end_ms"]
    acks = [e for e in conn.client_events("playback.ack") if e["item_id"] == item_id]
    assert [a["played_ms"] for a in acks] == [truncate["audio_end_ms"]]
    page.wait_for_function(
        "id => document.querySelector(`#transcript li[data-item-id=${id}]`)"
        ".classList.contains('interrupted')",
        arg=item_id,
    )
    truncated = [e for e in conn.server_events("conversation.item.truncated") if e["item_id"] == item_id]
    assert [e["audio_end_ms"] for e in truncated] == [truncate["audio_end_ms"]]
    assert page.inner_text("#messages") == ""
    page.screenshot(path=web.shots / "server-vad-barge-in.png", full_page=True)
