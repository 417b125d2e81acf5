"""Exposure over HTTP (issue 16): /metrics behind the key or on its own listener, no filesystem
paths or memory addresses in responses, the Origin allow-list for POSTs, and JSON endpoints that
take only JSON. Each through a real server on loopback."""

from __future__ import annotations

import base64
import json

import httpx
import openai
import pytest
from omnirt.realtime.config import ServerConfig

from tests.leaky import LeakyPipeline, assert_nothing_internal
from tests.server import free_port

from .conftest import MODEL, Server, run, running, running_media, user

CHAT = {"model": MODEL, "messages": user("hi")}


def test_metrics_take_the_api_key_when_keys_are_set() -> None:
    with running(config=ServerConfig(api_keys=["k-one"])) as server, server.http() as http:
        bare = http.get("/metrics")
        wrong = http.get("/metrics", headers={"authorization": "Bearer nope"})
        scraped = http.get("/metrics", headers={"authorization": "Bearer k-one"})  # as Prometheus sends it
    for response in (bare, wrong):
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert scraped.status_code == 200 and "omnirt_engine_steps_total" in scraped.text


def test_metrics_stay_open_without_keys(server: Server) -> None:
    with server.http() as http:
        assert http.get("/metrics").status_code == 200


def test_metrics_host_serves_them_on_a_listener_of_their_own() -> None:
    port = free_port()
    config = ServerConfig(api_keys=["k-one"], metrics_host=f"127.0.0.1:{port}")
    with running(config=config) as server:
        with server.http() as http:
            on_api = http.get("/metrics", headers={"authorization": "Bearer k-one"})
            http.post(
                "/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer k-one"}
            ).raise_for_status()
        scraped = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    assert on_api.status_code == 404
    assert scraped.status_code == 200
    assert 'omnirt_http_requests_total{method="POST",route="/v1/chat/completions",status="200"} 1.0' in (
        scraped.text
    )
    with pytest.raises(httpx.ConnectError):  # stopped with the server
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_model_source_path_stays_out_of_models_health_and_metrics() -> None:
    with running(LeakyPipeline()) as server, server.http() as http:
        bodies = [
            http.get(path).text for path in ("/v1/models", f"/v1/models/{MODEL}", "/health", "/metrics")
        ]
        card = http.get(f"/v1/models/{MODEL}").json()
    assert card["source"] == "tiny-omni"  # the folder's name only
    assert 'source="tiny-omni"' in bodies[3]
    for text in bodies:
        assert_nothing_internal(text)


def test_decode_errors_carry_no_heap_address_or_path() -> None:
    garbage = "data:image/png;base64," + base64.b64encode(b"not an image at all").decode()
    content = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": garbage}}]
    with running(LeakyPipeline()) as server:

        async def go() -> str:
            async with server.openai() as client:
                with pytest.raises(openai.BadRequestError) as info:
                    await client.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": content}]
                    )
                return info.value.message

        message = run(go())
    assert "image 1 of <path> could not be decoded: cannot identify image file <object>" in message
    assert_nothing_internal(message)


# -- content types ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/images/generations"])
@pytest.mark.parametrize("content_type", ["text/plain", None, "application/x-www-form-urlencoded"])
def test_json_endpoints_refuse_other_content_types_with_415(path: str, content_type: str | None) -> None:
    body = {"model": MODEL, "messages": user("hi")} if "chat" in path else {"prompt": "a cat"}
    headers = {"content-type": content_type} if content_type else {}
    with running_media() as server, server.http() as http:
        refused = http.post(path, content=json.dumps(body).encode(), headers=headers)
        as_json = http.post(
            path, content=json.dumps(body).encode(), headers={"content-type": "application/json"}
        )
    assert refused.status_code == 415, refused.text
    error = refused.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "unsupported_media_type"
    assert error["param"] == "Content-Type" and "application/json" in error["message"]
    assert as_json.status_code == 200, as_json.text


def test_videos_take_json_or_forms_but_not_text() -> None:
    body = b'{"prompt": "a cat", "seconds": "1"}'
    with running_media() as server, server.http() as http:
        text = http.post("/v1/videos", content=body, headers={"content-type": "text/plain"})
        as_json = http.post(
            "/v1/videos", content=body, headers={"content-type": "application/json; charset=utf-8"}
        )
        as_form = http.post(
            "/v1/videos", data={"prompt": "a cat", "seconds": "1"}, files={"unused": ("", b"")}
        )
    assert text.status_code == 415 and text.json()["error"]["code"] == "unsupported_media_type"
    assert as_json.status_code == 200, as_json.text
    assert as_form.status_code == 200, as_form.text


# -- origins ------------------------------------------------------------------------------------


def test_a_foreign_origin_cannot_post_but_its_own_and_sdks_can(server: Server) -> None:
    own = server.base_url  # http://127.0.0.1:PORT, the Host the request is sent to
    with server.http() as http:
        foreign = http.post("/v1/chat/completions", json=CHAT, headers={"origin": "https://evil.example"})
        null = http.post("/v1/chat/completions", json=CHAT, headers={"origin": "null"})
        other_port = http.post("/v1/chat/completions", json=CHAT, headers={"origin": "http://127.0.0.1:1"})
        same = http.post("/v1/chat/completions", json=CHAT, headers={"origin": own})
        no_origin = http.post("/v1/chat/completions", json=CHAT)
        read_only = http.get("/v1/models", headers={"origin": "https://evil.example"})
    for response in (foreign, null, other_port):
        assert response.status_code == 403
        error = response.json()["error"]
        assert error["code"] == "origin_not_allowed" and error["type"] == "invalid_request_error"
    assert same.status_code == 200 and no_origin.status_code == 200
    assert read_only.status_code == 200  # unreadable to the foreign page (no CORS headers)
    assert "access-control-allow-origin" not in read_only.headers


@pytest.mark.parametrize("allowed", [["https://app.example:8443"], ["*"]])
def test_allowed_origins_may_post(allowed: list[str]) -> None:
    with running(config=ServerConfig(allowed_origins=allowed)) as server, server.http() as http:
        listed = http.post("/v1/chat/completions", json=CHAT, headers={"origin": "https://APP.example:8443"})
        other = http.post("/v1/chat/completions", json=CHAT, headers={"origin": "https://other.example"})
    assert listed.status_code == 200
    assert other.status_code == (200 if allowed == ["*"] else 403)


def test_a_bad_allowed_origin_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="not an origin"):
        with running(config=ServerConfig(allowed_origins=["app.example"])):
            pass
