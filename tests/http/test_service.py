"""/health, /v1/models, /, /metrics, concurrency, disconnects and the engine's lifespan."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import time
from typing import Any
from urllib.parse import urlparse

import httpx
import websockets
from omnirt.realtime.app import create_app, web_ui_dir
from omnirt.realtime.config import ServerConfig
from omnirt.stages.engine import Engine, EngineClient
from prometheus_client.parser import text_string_to_metric_families

from tests.fakes import EchoPipeline
from tests.server import serve
from tests.stages.pipelines import JobPipeline, RealClock

from .conftest import MODEL, Server, run, running, user, wait_for


def test_health(server: Server) -> None:
    with server.http() as http:
        response = http.get("/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "model": MODEL, "random_weights": True, "engine": "running"}


def test_models_list_and_retrieve_say_the_weights_are_random(server: Server) -> None:
    async def go() -> tuple[list[Any], Any]:
        async with server.openai() as client:
            return [m async for m in client.models.list()], await client.models.retrieve(MODEL)

    listed, one = run(go())
    assert [m.id for m in listed] == [MODEL]
    assert listed[0].owned_by == "omnirt" and listed[0].object == "model"
    assert listed[0].model_extra["random_weights"] is True
    assert one.id == MODEL and one.model_extra["architecture"] == "echo"


def test_models_and_metrics_list_every_pipeline() -> None:
    engine = Engine([EchoPipeline(), JobPipeline(RealClock(), cost=0.001)])
    with serve(create_app(EngineClient(engine), ServerConfig())) as url, httpx.Client(base_url=url) as http:
        listed = http.get("/v1/models").json()["data"]
        one = http.get("/v1/models/diffusion-test")
        metrics = _samples(http.get("/metrics").text)
    assert [m["id"] for m in listed] == [MODEL, "diffusion-test"]
    assert one.status_code == 200 and one.json()["architecture"] == "diffusion"
    kinds = {dict(labels)["kind"] for name, labels in metrics if name == "omnirt_model_info"}
    assert kinds == {"speech", "diffusion"}
    assert metrics[("omnirt_pipeline_steps_total", (("kind", "diffusion"),))] == 0


def test_root_serves_the_web_ui_or_points_to_the_apis(server: Server) -> None:
    with server.http() as http:
        response = http.get("/")
    assert response.status_code == 200
    if web_ui_dir() is None:
        assert response.json()["endpoints"]["chat_completions"] == "POST /v1/chat/completions"
    else:
        assert response.headers["content-type"].startswith("text/html")


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_metrics_after_traffic() -> None:
    with running() as server:

        async def traffic() -> None:
            async with server.openai() as client:
                for i in range(3):
                    await client.chat.completions.create(model=MODEL, messages=user(f"n{i}"))

        run(traffic())
        with server.http() as http:
            http.post("/v1/chat/completions", json={"model": MODEL, "messages": []})  # 400
            http.get("/v1/does-not-exist")  # 404, unmatched
            response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    m = _samples(response.text)
    chat = "/v1/chat/completions"
    assert m[("omnirt_http_requests_total", (("method", "POST"), ("route", chat), ("status", "200")))] == 3
    assert m[("omnirt_http_requests_total", (("method", "POST"), ("route", chat), ("status", "400")))] == 1
    # The unknown path is "unmatched", or falls to the web UI's mount when the UI is installed.
    not_found = {
        labels: v
        for (name, labels), v in m.items()
        if name == "omnirt_http_requests_total" and ("status", "404") in labels
    }
    assert list(not_found.values()) == [1]
    assert dict(next(iter(not_found)))["route"] in ("unmatched", "/{path}")
    assert m[("omnirt_http_request_duration_seconds_count", (("method", "POST"), ("route", chat)))] == 4
    assert m[("omnirt_engine_requests_submitted_total", ())] == 3
    assert m[("omnirt_engine_requests_ended_total", (("outcome", "completed"),))] == 3
    assert m[("omnirt_engine_requests_ended_total", (("outcome", "cancelled"),))] == 0
    assert m[("omnirt_engine_steps_total", ())] == server.engine.stats.steps >= 3 * 4
    assert m[("omnirt_engine_step_seconds_total", ())] > 0
    assert m[("omnirt_engine_requests_active", ())] == 0
    assert m[("omnirt_pipeline_steps_total", (("kind", "speech"),))] == server.engine.stats.steps
    assert m[("omnirt_pipeline_step_seconds_total", (("kind", "speech"),))] > 0
    durations = {
        dict(labels)["le"]: v
        for (name, labels), v in m.items()
        if name == "omnirt_pipeline_step_duration_seconds_bucket" and ("kind", "speech") in labels
    }
    by_bound = [durations[le] for le in sorted(durations, key=float)]  # "+Inf" sorts last
    assert by_bound == sorted(by_bound) and by_bound[-1] == server.engine.stats.steps  # cumulative
    assert len(by_bound) == 11
    speech = (("kind", "speech"),)
    assert m[("omnirt_pipeline_step_duration_seconds_count", speech)] == server.engine.stats.steps
    assert abs(
        m[("omnirt_pipeline_step_duration_seconds_sum", speech)]
        - m[("omnirt_pipeline_step_seconds_total", speech)]
    ) < 1e-9
    # One request at a time: every echo call advanced one row ("You said: nI." and the finish).
    echo_calls = {k: v for k, v in m.items() if k[0] == "omnirt_model_calls_total"}
    assert echo_calls == {
        ("omnirt_model_calls_total", (("call", "echo"), ("kind", "speech"), ("rows", "1"))): 3 * 4
    }
    assert m[("omnirt_realtime_sessions_active", ())] == 0
    assert ("omnirt_realtime_sessions_total", ()) in m
    assert (
        m[
            (
                "omnirt_model_info",
                (
                    ("architecture", "echo"),
                    ("id", MODEL),
                    ("kind", "speech"),
                    ("random_weights", "true"),
                    ("source", "tests"),
                ),
            )
        ]
        == 1
    )


def test_concurrent_requests_all_complete_and_share_engine_steps() -> None:
    with running(EchoPipeline(slots=8, step_seconds=0.01)) as server:

        async def go() -> list[Any]:
            async with server.openai() as client:
                return await asyncio.gather(
                    *(
                        client.chat.completions.create(model=MODEL, messages=user(f"request {i}"))
                        for i in range(8)
                    )
                )

        done = run(go())
        assert [c.choices[0].message.content for c in done] == [f"You said: request {i}." for i in range(8)]
        assert len({c.id for c in done}) == 8
        # The requests overlapped in the engine: some model calls advanced several of them at once.
        assert max(server.engine.stats.rows("speech", "echo")) > 1
        assert server.engine.stats.requests_finished == 8


LONG = " ".join(f"w{i}" for i in range(400))


def test_client_disconnect_mid_stream_cancels_the_engine_request() -> None:
    with running(EchoPipeline(step_seconds=0.02)) as server:
        stats = server.engine.stats
        body = {"model": MODEL, "messages": user(LONG), "stream": True}
        with server.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            content = next(line for line in lines if '"content":"' in line and '"role"' not in line)
            assert '"content":"You"' in content
        # The connection is closed here, ~400 words before the end.
        assert wait_for(lambda: stats.requests_cancelled == 1)
        assert stats.requests_finished == 0
        assert wait_for(lambda: not server.pipeline.active and stats.active == 0)


def test_client_disconnect_while_waiting_for_a_plain_completion_cancels_it() -> None:
    with running(EchoPipeline(step_seconds=0.02)) as server:
        stats = server.engine.stats
        with server.http() as http:
            try:
                http.post("/v1/chat/completions", json={"model": MODEL, "messages": user(LONG)}, timeout=0.5)
            except httpx.TimeoutException:
                pass  # the client gives up and closes the connection
            else:
                raise AssertionError("the request should not have finished within 0.5 s")
        assert wait_for(lambda: stats.requests_cancelled == 1)
        assert stats.requests_finished == 0 and not server.pipeline.active


def test_half_sent_request_does_not_reach_the_engine() -> None:
    with running() as server:
        url = urlparse(server.base_url)
        with socket.create_connection((url.hostname, url.port)) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 1000\r\n\r\n{"model":'
            )
            time.sleep(0.1)
        time.sleep(0.1)
        assert server.engine.stats.requests_submitted == 0
        with server.http() as http:
            assert http.get("/health").status_code == 200


def test_lifespan_starts_and_stops_the_engine_only_when_it_started_it() -> None:
    own = Engine(EchoPipeline())
    with serve(create_app(EngineClient(own), ServerConfig())):
        assert own._thread is not None and own._thread.is_alive()
    assert own._thread is None  # stopped on shutdown

    theirs = Engine(EchoPipeline())
    theirs.start()
    try:
        with serve(create_app(EngineClient(theirs), ServerConfig())):
            pass
        assert theirs._thread is not None and theirs._thread.is_alive()  # left running for its owner
    finally:
        theirs.stop()


def test_built_web_ui_is_served_at_root_without_hiding_the_apis(tmp_path, monkeypatch) -> None:
    (tmp_path / "index.html").write_text("<!doctype html><title>omnirt</title>")
    (tmp_path / "app.js").write_text("console.log('ui')")
    monkeypatch.setattr("omnirt.realtime.app.web_ui_dir", lambda: tmp_path)
    app = create_app(EngineClient(Engine(EchoPipeline())), ServerConfig())
    with serve(app) as base_url, httpx.Client(base_url=base_url, timeout=10) as http:
        index = http.get("/")
        script = http.get("/app.js")
        missing = http.get("/nope.js")
        models = http.get("/v1/models")
    assert index.status_code == 200 and index.headers["content-type"].startswith("text/html")
    assert "<title>omnirt</title>" in index.text
    assert script.status_code == 200 and script.text == "console.log('ui')"
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert models.json()["data"][0]["id"] == MODEL


def test_realtime_route_is_mounted_and_its_counters_reach_metrics() -> None:
    with running() as server:

        async def one_session() -> str:
            url = server.base_url.replace("http://", "ws://") + f"/v1/realtime?model={MODEL}"
            async with websockets.connect(url) as ws:
                created = json.loads(await ws.recv())["type"]
                # Server VAD on, then 400 ms of silence: the VAD process scores its 32 ms windows.
                vad = {"type": "server_vad", "create_response": False}
                await ws.send(
                    json.dumps(
                        {
                            "type": "session.update",
                            "session": {"type": "realtime", "audio": {"input": {"turn_detection": vad}}},
                        }
                    )
                )
                assert json.loads(await ws.recv())["type"] == "session.updated"
                silence = base64.b64encode(bytes(24_000 * 2 * 2 // 5)).decode()
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": silence}))
                assert wait_for(lambda: server.app.state.realtime.vad_stats.windows >= 6)
                return created

        assert run(one_session()) == "session.created"
        assert wait_for(lambda: server.app.state.realtime.active_sessions == 0)
        with server.http() as http:
            m = _samples(http.get("/metrics").text)
    assert m[("omnirt_realtime_sessions_total", ())] == 1
    assert m[("omnirt_realtime_sessions_active", ())] == 0
    assert m[("omnirt_realtime_events_sent_total", ())] >= 1
    assert m[("omnirt_vad_windows_total", ())] >= 6
    assert m[("omnirt_vad_batches_total", ())] >= 1
    assert m[("omnirt_vad_process_restarts_total", ())] == 0
    # Decisions delivered to a session are in the latency histogram (windows scored after their
    # session closed are not): cumulative buckets, +Inf = the count.
    count = m[("omnirt_vad_decision_seconds_count", ())]
    assert 6 <= count <= m[("omnirt_vad_windows_total", ())]
    assert count == m[("omnirt_vad_decision_seconds_bucket", (("le", "+Inf"),))]
    assert m[("omnirt_vad_decision_seconds_bucket", (("le", "0.002"),))] <= m[
        ("omnirt_vad_decision_seconds_bucket", (("le", "1.0"),))
    ] <= count
    assert 0 < m[("omnirt_vad_decision_seconds_sum", ())] < count
