"""Push-to-talk in a real browser: hold the Talk button (pointer) or the space bar to speak;
pressing during a reply cancels it and truncates it to what was heard."""

from __future__ import annotations

from .browser import requires_browser
from .conftest import open_ui, page_log, played, sent_audio_samples, server_transcript

pytestmark = requires_browser


def test_push_to_talk_turns_and_interrupting_a_reply(page, web):
    web.reply(frames_per_word=8, step_seconds=0.4)  # a long reply, still generating when cut
    conn = open_ui(page, web, "ptt")
    assert conn.query.get("turn") == ["push_to_talk"]
    page.wait_for_timeout(600)
    assert conn.client_events("input_audio_buffer.append") == [], "audio sent with the button up"

    # Turn 1: hold the Talk button with the pointer while the fake microphone speaks.
    page.hover("#talk")
    page.mouse.down()
    assert page.get_attribute("#talk", "aria-pressed") == "true"
    page.wait_for_function("() => window.omnirt.session.appendedMs >= 1500")
    page.mouse.up()
    assert page.get_attribute("#talk", "aria-pressed") == "false"

    # Interrupt the reply once it is audibly playing: press the space bar.
    page.wait_for_function("() => Object.values(window.omnirt.played()).some(p => p.samples > 4800)")
    page.keyboard.down("Space")
    page.wait_for_function("() => window.omnirt.session.log.truncates.length === 1")
    web.reply(frames_per_word=1, step_seconds=0.03)  # turn 2 gets a short reply, played to the end
    page.wait_for_function("() => window.omnirt.session.appendedMs >= 1000")
    page.keyboard.up("Space")
    page.wait_for_function("() => window.omnirt.session.log.acks.length >= 2")
    page.wait_for_selector("#assistant-speaking[data-active=false]")

    events = conn.client_events()
    types = [e["type"] for e in events]
    # Audio goes only while the button is held: each press clears, each release commits.
    held = False
    for kind in types:
        if kind == "input_audio_buffer.clear":
            held = True
        elif kind == "input_audio_buffer.commit":
            held = False
        elif kind == "input_audio_buffer.append":
            assert held, "audio appended with the button up"
    assert types.count("input_audio_buffer.commit") == types.count("response.create") == 2
    assert conn.server_events("error") == []

    # The press cancelled the reply still generating, and cut it where playback was.
    first, second = conn.server_events("response.done")
    cancel = types.index("response.cancel")
    assert events[cancel]["response_id"] == first["response"]["id"]
    assert cancel < types.index("input_audio_buffer.clear", types.index("input_audio_buffer.commit"))
    assert first["response"]["status"] == "cancelled"
    assert first["response"]["status_details"]["reason"] == "client_cancelled"
    (cut,) = page_log(page)["truncates"]
    first_item = first["response"]["output"][0]["id"]
    assert cut["item_id"] == first_item
    assert 4800 < cut["played"] < sent_audio_samples(conn, first_item)
    assert played(page)[first_item]["samples"] == cut["played"]
    (truncate,) = conn.client_events("conversation.item.truncate")
    assert truncate["audio_end_ms"] == cut["audio_end_ms"] == cut["played"] * 1000 // 24000
    (truncated,) = conn.server_events("conversation.item.truncated")
    assert truncated["audio_end_ms"] == truncate["audio_end_ms"]

    # The second reply played to its end; both acks match the page's counters.
    second_item = second["response"]["output"][0]["id"]
    assert second["response"]["status"] == "completed"
    counters = played(page)
    assert counters[second_item]["samples"] == sent_audio_samples(conn, second_item) > 0
    acks = {a["item_id"]: a["played_ms"] for a in conn.client_events("playback.ack")}
    assert acks == {first_item: counters[first_item]["ms"], second_item: counters[second_item]["ms"]}
    page.wait_for_selector(f"#transcript li[data-item-id={second_item}].final")
    assert page.inner_text(f"#transcript li[data-item-id={second_item}] .text") == server_transcript(
        conn, second_item
    )
    assert "interrupted" in page.get_attribute(f"#transcript li[data-item-id={first_item}]", "class")
    page.screenshot(path=web.shots / "push-to-talk.png", full_page=True)


def test_a_turn_held_when_the_page_loses_focus_ends_there(page, web):
    """The space bar held when the window loses focus: its keyup goes elsewhere, so the page ends the
    turn on ``blur`` (commit and reply) instead of sending audio until the next press."""
    web.reply(frames_per_word=1, step_seconds=0.03)
    conn = open_ui(page, web, "ptt")
    page.keyboard.down("Space")
    page.wait_for_function("() => window.omnirt.session.appendedMs >= 600")
    page.evaluate("() => window.dispatchEvent(new Event('blur'))")
    assert page.get_attribute("#talk", "aria-pressed") == "false"
    page.wait_for_function("() => window.omnirt.session.log.acks.length >= 1")  # the reply played
    appended = page.evaluate("() => window.omnirt.session.appendedMs")
    page.wait_for_timeout(500)
    assert page.evaluate("() => window.omnirt.session.appendedMs") == appended, "audio sent after the blur"
    types = [e["type"] for e in conn.client_events()]
    assert types.count("input_audio_buffer.commit") == types.count("response.create") == 1
    page.keyboard.up("Space")  # the late keyup changes nothing
    assert [e["type"] for e in conn.client_events()].count("input_audio_buffer.commit") == 1
