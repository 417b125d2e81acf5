"""The page's duplex profile against a stand-in duplex endpoint (PROTOCOL.md, "Native full
duplex"): our server refuses ``?duplex=1`` for now (see test_messages.py), so this checks the
client side alone: audio streams up all the time with no commits, and each stretch of model
speech, bracketed by response.created / response.done, is played and acknowledged."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import numpy as np
from omnirt.realtime.app import web_ui_dir
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket, WebSocketDisconnect

from tests.server import serve

from .browser import requires_browser
from .conftest import played

pytestmark = requires_browser

FRAME = 1920  # 80 ms at 24 kHz
SPEAK_FRAMES = 10  # the stand-in model speaks 800 ms ...
AFTER_INPUT_MS = 600  # ... once it has heard this much


class DuplexStandIn:
    """Answers ``?duplex=1`` like a duplex server would, and keeps what the client sent."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        self.sent_samples: dict[str, int] = {}
        self.query: dict[str, str] = {}

    async def handle(self, ws: WebSocket) -> None:
        await ws.accept(subprotocol="realtime")
        self.query = dict(ws.query_params)
        counter = iter(range(1, 1_000_000))

        async def send(event: dict[str, Any]) -> None:
            await ws.send_text(json.dumps({"event_id": f"event_{next(counter)}", **event}))

        await send({"type": "session.created", "session": {"id": "sess_duplex", "type": "realtime"}})
        heard_ms = 0.0
        spoke = False
        try:
            while True:
                event = json.loads(await ws.receive_text())
                self.received.append(event)
                if event["type"] != "input_audio_buffer.append":
                    continue
                heard_ms += len(base64.b64decode(event["audio"])) / 48
                if heard_ms >= AFTER_INPUT_MS and not spoke:
                    spoke = True
                    asyncio.get_running_loop().create_task(self.speak(send))
        except WebSocketDisconnect:
            return

    async def speak(self, send: Any) -> None:
        rid, iid = "resp_d1", "item_d1"
        await send({"type": "response.created", "response": {"id": rid, "status": "in_progress"}})
        await send(
            {"type": "response.output_item.added", "response_id": rid, "item": {"id": iid, "type": "message"}}
        )
        tone = (0.2 * np.sin(2 * np.pi * 440 * np.arange(FRAME) / 24000) * 32767).astype("<i2").tobytes()
        for n in range(SPEAK_FRAMES):
            delta = {"response_id": rid, "item_id": iid, "output_index": 0, "content_index": 0}
            await send({"type": "response.output_audio_transcript.delta", **delta, "delta": f"w{n} "})
            await send(
                {"type": "response.output_audio.delta", **delta, "delta": base64.b64encode(tone).decode()}
            )
            self.sent_samples[iid] = self.sent_samples.get(iid, 0) + FRAME
            await asyncio.sleep(0.08)
        await send({"type": "response.output_audio.done", "response_id": rid, "item_id": iid})
        await send({"type": "response.done", "response": {"id": rid, "status": "completed"}})


def test_duplex_profile_streams_both_ways_and_acks_what_played(page):
    stand_in = DuplexStandIn()

    async def models(request: Any) -> JSONResponse:
        card = {
            "id": "duplex-stand-in",
            "architecture": "stand-in",
            "source": "tests",
            "random_weights": True,
        }
        return JSONResponse({"object": "list", "data": [card]})

    app = Starlette(
        routes=[
            Route("/v1/models", models),
            WebSocketRoute("/v1/realtime", stand_in.handle),
            Mount("/", StaticFiles(directory=web_ui_dir(), html=True)),
        ]
    )
    with serve(app) as base_url:
        page.goto(base_url + "/")
        page.check("input[name=profile][value=duplex]")
        page.click("#connect")
        page.wait_for_selector("#status[data-state=connected]")
        page.wait_for_function("() => window.omnirt.session.log.acks.length === 1")
        page.wait_for_timeout(300)  # audio keeps flowing after the reply

    assert stand_in.query["duplex"] == "1"
    types = [e["type"] for e in stand_in.received]
    assert set(types) == {"input_audio_buffer.append", "playback.ack"}  # no commits, no session.update
    ack = types.index("playback.ack")
    assert "input_audio_buffer.append" in types[ack + 1 :], "the microphone stopped after the reply"
    counters = played(page)["item_d1"]
    assert counters["samples"] == stand_in.sent_samples["item_d1"] == SPEAK_FRAMES * FRAME
    assert stand_in.received[ack]["played_ms"] == counters["ms"] == SPEAK_FRAMES * 80
    assert page.inner_text("#transcript li[data-item-id=item_d1] .text").split() == [
        f"w{n}" for n in range(SPEAK_FRAMES)
    ]
