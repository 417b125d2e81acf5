"""The real app (create_app + Engine + an echo pipeline) on loopback, and one Chromium for all.

Every WebSocket frame is recorded (``recorder.py``) so tests compare what the page did with
what the server received. Screenshots go to ``docs/ui/`` when ``OMNIRT_SCREENSHOTS=1``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from omnirt.realtime.app import create_app
from omnirt.realtime.config import ServerConfig
from omnirt.stages.engine import Engine, EngineClient
from omnirt.stages.types import AudioDelta

from tests.fakes import EchoPipeline
from tests.server import serve

from .browser import MISSING, chromium_args, make_speech_wav
from .recorder import RecordedConnection, Recorder

DOCS_UI = Path(__file__).resolve().parents[2] / "docs" / "ui"


class ReplyPipeline(EchoPipeline):
    """EchoPipeline whose reply audio can be made longer (``frames_per_word`` x 80 ms a word)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.frames_per_word = 1

    def step(self):  # type: ignore[no-untyped-def]
        out = super().step()
        if self.frames_per_word == 1:
            return out
        return [
            (
                rid,
                AudioDelta(np.tile(o.pcm, self.frames_per_word), o.text_chars)
                if isinstance(o, AudioDelta)
                else o,
            )
            for rid, o in out
        ]


@dataclass
class Web:
    base_url: str
    pipeline: ReplyPipeline
    recorder: Recorder
    shots: Path

    def reply(self, *, frames_per_word: int = 1, step_seconds: float = 0.05) -> None:
        """Shape the next replies: audio per word, and generation time per word."""
        self.pipeline.frames_per_word = frames_per_word
        self.pipeline.step_seconds = step_seconds


@pytest.fixture(scope="package")
def web(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Web]:
    pipeline = ReplyPipeline(step_seconds=0.05)
    app = create_app(EngineClient(Engine(pipeline)), ServerConfig())
    recorder = Recorder(app)
    shots = DOCS_UI if os.environ.get("OMNIRT_SCREENSHOTS") == "1" else tmp_path_factory.mktemp("shots")
    with serve(recorder) as base_url:
        yield Web(base_url, pipeline, recorder, shots)


@pytest.fixture(scope="package")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    if MISSING:
        pytest.skip(MISSING)
    from playwright.sync_api import sync_playwright

    wav = make_speech_wav(tmp_path_factory.mktemp("speech"))
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path="/usr/bin/chromium", args=chromium_args(wav))
        yield chromium
        chromium.close()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "allow_console(text): a console error containing text is expected in this web UI test"
    )


@pytest.fixture
def page(browser: Any, web: Web, request: pytest.FixtureRequest) -> Iterator[Any]:
    """A fresh page; fails the test on any uncaught exception or unexpected console error."""
    allowed = [m.args[0] for m in request.node.iter_markers("allow_console")]
    context = browser.new_context(viewport={"width": 1100, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(15_000)
    problems: list[str] = []
    page.on("pageerror", lambda exc: problems.append(f"uncaught: {exc}"))

    def on_console(msg: Any) -> None:
        if msg.type == "error" and not any(text in msg.text for text in allowed):
            problems.append(f"console: {msg.text}")

    page.on("console", on_console)
    yield page
    context.close()
    assert not problems, problems


def open_ui(page: Any, web: Web, profile: str, *, camera: bool = False) -> RecordedConnection:
    """Load the page, pick ``profile``, connect; returns the server's record of the connection."""
    page.goto(web.base_url + "/")
    page.check(f"input[name=profile][value={profile}]")
    if camera:
        page.check("#camera")
    page.click("#connect")
    page.wait_for_selector("#status[data-state=connected]")
    session_id = page.evaluate("() => window.omnirt.session.client.session.id")
    return web.recorder.session(session_id)


def played(page: Any) -> dict[str, dict[str, int]]:
    """The page's own counters: per assistant item, samples rendered / ms / samples received."""
    return page.evaluate("() => window.omnirt.played()")


def page_log(page: Any) -> dict[str, Any]:
    return page.evaluate("() => window.omnirt.session.log")


def sent_audio_samples(conn: RecordedConnection, item_id: str) -> int:
    """Samples of reply audio the server sent for ``item_id`` (24 kHz PCM16)."""
    import base64

    return sum(
        len(base64.b64decode(e["delta"])) // 2
        for e in conn.server_events("response.output_audio.delta")
        if e["item_id"] == item_id
    )


def server_transcript(conn: RecordedConnection, item_id: str) -> str:
    return "".join(
        e["delta"]
        for e in conn.server_events("response.output_audio_transcript.delta")
        if e["item_id"] == item_id
    )
