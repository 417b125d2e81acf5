"""How a session ends, and what the page lets go of: the server going away mid-reply, a refusal
at the session limit, Disconnect while the microphone is still being allowed, and a double click
on Connect. Microphone and camera must be released, nobody shown speaking, Connect usable again."""

from __future__ import annotations

from omnirt.realtime.app import create_app
from omnirt.realtime.config import ServerConfig
from omnirt.stages.engine import Engine, EngineClient

from tests.server import serve, serve_server

from .browser import requires_browser
from .conftest import ReplyPipeline

pytestmark = requires_browser

#: Every stream getUserMedia hands out, in window.__streams, to check that none is left live.
RECORD_STREAMS = """
window.__streams = [];
const realGetUserMedia = navigator.mediaDevices.getUserMedia.bind(navigator.mediaDevices);
navigator.mediaDevices.getUserMedia = async (constraints) => {
  const stream = await realGetUserMedia(constraints);
  window.__streams.push(stream);
  return stream;
};
"""

#: As RECORD_STREAMS, but the microphone is granted only when the test calls window.__allowMic()
#: (a person still looking at the permission prompt).
HOLD_MICROPHONE = (
    RECORD_STREAMS
    + """
let allow;
const allowed = new Promise((resolve) => (allow = resolve));
window.__micAsked = false;
window.__allowMic = () => allow();
const recording = navigator.mediaDevices.getUserMedia;
navigator.mediaDevices.getUserMedia = async (constraints) => {
  if (constraints && constraints.audio) {
    window.__micAsked = true;
    await allowed;
  }
  return recording(constraints);
};
"""
)

ALL_RELEASED = """() => window.__streams.length > 0
  && window.__streams.every(s => s.getTracks().every(t => t.readyState === 'ended'))"""


def test_server_gone_mid_reply_releases_everything_and_says_so(page):
    pipeline = ReplyPipeline(step_seconds=0.3)
    pipeline.frames_per_word = 8  # a long reply, still playing when the server goes
    app = create_app(EngineClient(Engine(pipeline)), ServerConfig())
    page.add_init_script(RECORD_STREAMS)
    with serve_server(app) as (base_url, server):
        page.goto(base_url + "/")
        page.check("input[name=profile][value=manual]")
        page.check("#camera")
        page.click("#connect")
        page.wait_for_selector("#status[data-state=connected]")
        assert page.is_visible("#camera-preview")
        page.wait_for_function("() => window.omnirt.session.appendedMs >= 1000")
        page.click("#send-turn")
        page.wait_for_selector("#assistant-speaking[data-active=true]")
        server.should_exit = True  # the server restarts (its sessions are closed)
        page.wait_for_selector("#status[data-state=closed]")

    # Nobody is shown speaking, the meter is at rest, microphone and camera are off.
    page.wait_for_selector("#assistant-speaking[data-active=false]")
    page.wait_for_selector("#user-speaking[data-active=false]")
    assert page.evaluate("() => document.getElementById('level').value") == 0
    page.wait_for_function(ALL_RELEASED)
    assert page.evaluate("() => window.__streams.some(s => s.getVideoTracks().length > 0)"), "no camera"
    assert page.is_hidden("#camera-preview")
    assert page.evaluate("() => document.getElementById('camera-preview').srcObject") is None
    # The page says the connection is gone, and lets the user connect again.
    message = page.locator("#messages li.error").last
    assert "The connection to the server closed" in message.inner_text()
    assert page.is_enabled("#connect") and page.is_disabled("#disconnect") and page.is_disabled("#send-turn")


def test_connect_to_a_stopped_server_says_so(page):
    app = create_app(EngineClient(Engine(ReplyPipeline(step_seconds=0.05))), ServerConfig())
    with serve(app) as base_url:
        page.goto(base_url + "/")
        page.wait_for_function("() => document.getElementById('model').textContent.includes('echo-test')")
    # The page stays open; the server is gone. Connect must blame the server, not the audio device.
    page.click("#connect")
    page.wait_for_selector("#status[data-state=failed]")
    message = page.inner_text("#messages li.error")
    assert "the server did not answer" in message and "Audio output" not in message
    assert page.is_enabled("#connect")


def test_refused_at_the_session_limit_releases_the_camera(browser, page):
    app = create_app(EngineClient(Engine(ReplyPipeline(step_seconds=0.05))), ServerConfig(max_sessions=1))
    with serve(app) as base_url:
        first = browser.new_context().new_page()
        try:
            first.goto(base_url + "/")
            first.click("#connect")
            first.wait_for_selector("#status[data-state=connected]")

            page.add_init_script(RECORD_STREAMS)
            page.goto(base_url + "/")
            page.check("#camera")
            page.click("#connect")
            page.wait_for_selector("#status[data-state=failed]")
            assert "at its limit of 1 realtime sessions" in page.inner_text("#messages li.error")
            page.wait_for_function(ALL_RELEASED)
            assert page.is_hidden("#camera-preview")
            assert page.is_enabled("#connect")
        finally:
            first.context.close()


def test_disconnect_while_the_microphone_is_being_allowed(page, web):
    page.add_init_script(HOLD_MICROPHONE)
    page.goto(web.base_url + "/")
    page.check("input[name=profile][value=manual]")
    page.click("#connect")
    page.wait_for_function("() => window.__micAsked")
    page.click("#disconnect")
    page.wait_for_selector("#status[data-state=closed]")
    # The person now answers the prompt: the page must not start listening on a closed session.
    page.evaluate("() => window.__allowMic()")
    page.wait_for_function(ALL_RELEASED)
    assert page.get_attribute("#status", "data-state") == "closed"
    assert page.is_enabled("#connect") and page.is_disabled("#disconnect") and page.is_disabled("#send-turn")
    assert page.inner_text("#messages") == ""


def test_double_click_on_connect_opens_one_session(page, web):
    page.add_init_script(RECORD_STREAMS)
    before = len(web.recorder.connections)
    page.goto(web.base_url + "/")
    page.check("input[name=profile][value=manual]")
    page.check("#camera")
    page.dblclick("#connect")
    page.wait_for_selector("#status[data-state=connected]")
    assert page.is_visible("#camera-preview")
    page.click("#disconnect")
    page.wait_for_selector("#status[data-state=closed]")
    page.wait_for_function(ALL_RELEASED)
    assert len(web.recorder.connections) - before == 1
    assert page.inner_text("#messages") == ""
    assert page.evaluate("() => window.__streams.length") == 2  # one microphone, one camera


def test_a_level_the_worklet_sent_before_the_end_is_not_shown_after_it(page, web):
    """The capture worklet posts levels on its own thread: one already on its way when the session
    lets go of the microphone must not show the user speaking, or the meter up, afterwards (seen
    once in CI under load, after the server went away mid-reply)."""
    page.goto(web.base_url + "/")
    page.check("input[name=profile][value=manual]")
    page.click("#connect")
    page.wait_for_selector("#status[data-state=connected]")
    page.evaluate("() => { window.__port = window.omnirt.session.mic.node.port; }")
    page.click("#disconnect")
    page.wait_for_selector("#status[data-state=closed]")
    # what the port would deliver now, if it still had a listener: a loud level
    delivered = page.evaluate(
        """() => {
          const handler = window.__port.onmessage;
          if (handler) handler({ data: { type: "level", rms: 0.5, peak: 0.9 } });
          return Boolean(handler);
        }"""
    )
    assert page.get_attribute("#user-speaking", "data-active") == "false"
    assert page.evaluate("() => document.getElementById('level').value") == 0
    assert not delivered  # the port's listener went with the microphone
