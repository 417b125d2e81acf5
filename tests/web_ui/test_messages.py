"""What the page tells a person when something is refused: duplex the server does not offer,
a denied microphone, and server error events."""

from __future__ import annotations

import pytest
from omnirt.realtime.app import create_app
from omnirt.realtime.config import ServerConfig
from omnirt.stages.engine import Engine, EngineClient

from tests.fakes import EchoPipeline
from tests.server import serve

from .browser import requires_browser
from .conftest import open_ui

pytestmark = requires_browser

DENY_MICROPHONE = """
navigator.mediaDevices.getUserMedia = async (constraints) => {
  if (constraints && constraints.audio) throw new DOMException("Permission denied", "NotAllowedError");
  throw new DOMException("Requested device not found", "NotFoundError");
};
"""


def test_duplex_refused_by_the_server_is_shown_as_unavailable(page, web):
    page.goto(web.base_url + "/")
    page.check("input[name=profile][value=duplex]")
    page.click("#connect")
    page.wait_for_selector("#status[data-state=failed]")
    conn = web.recorder.connections[-1]
    assert conn.query.get("duplex") == ["1"]
    (refusal,) = conn.server_events("error")
    assert refusal["error"]["code"] == "unsupported"
    note = page.locator("#duplex-unavailable")
    assert note.is_visible()
    assert refusal["error"]["message"] in note.inner_text()
    assert page.inner_text("#messages") == f"Error (unsupported): {refusal['error']['message']}"
    assert page.is_disabled("input[name=profile][value=duplex]")
    assert page.is_checked("input[name=profile][value=manual]")
    assert page.is_enabled("#connect"), "the page must let the user connect with another profile"
    page.screenshot(path=web.shots / "duplex-unavailable.png", full_page=True)


def test_denied_microphone_is_explained(page, web):
    page.add_init_script(DENY_MICROPHONE)
    open_ui(page, web, "manual")
    message = page.locator("#messages li.error").first
    message.wait_for()
    assert "Microphone access was denied" in message.inner_text()
    assert page.inner_text("#status").startswith("connected (no microphone)")


def test_server_errors_are_shown_with_code_and_message(page, web):
    conn = open_ui(page, web, "manual")
    page.evaluate("() => window.omnirt.session.send({type: 'response.cancel'})")
    message = page.locator("#messages li.error").first
    message.wait_for()
    (error,) = conn.server_events("error")
    assert error["error"]["code"] == "response_cancel_not_active"
    assert message.inner_text() == f"Error (response_cancel_not_active): {error['error']['message']}"
    # The session goes on: a turn still works after the error.
    page.wait_for_function("() => window.omnirt.session.appendedMs >= 300")
    page.click("#send-turn")
    page.wait_for_function("() => window.omnirt.session.log.acks.length >= 1")


@pytest.mark.allow_console("401 (Unauthorized)")  # GET /v1/models before the key is typed
def test_api_key_goes_as_a_subprotocol_and_a_bad_one_is_reported(page):
    config = ServerConfig(api_keys=["sesame"])
    app = create_app(EngineClient(Engine(EchoPipeline(step_seconds=0.01))), config)
    with serve(app) as base_url:
        page.goto(base_url + "/")
        page.wait_for_function("() => document.getElementById('model').textContent.includes('unknown')")
        page.fill("#api-key", "wrong")
        page.click("#connect")
        page.wait_for_selector("#status[data-state=failed]")
        message = page.inner_text("#messages")
        assert "Invalid API key" in message

        page.fill("#api-key", "sesame")
        page.dispatch_event("#api-key", "change")  # the model card is fetched with the key
        page.wait_for_function("() => document.getElementById('model').textContent.includes('echo-test')")
        page.click("#connect")
        page.wait_for_selector("#status[data-state=connected]")
        protocol = page.evaluate("() => window.omnirt.session.client.ws.protocol")
        assert protocol == "realtime"
        page.click("#disconnect")
        page.wait_for_selector("#status[data-state=closed]")
