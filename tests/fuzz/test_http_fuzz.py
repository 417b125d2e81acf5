"""Property-based fuzzing of the JSON routes on a live ``omnirt serve`` (the embedded models).

Each example sends one request drawn from :mod:`.http_bodies` (``/v1/chat/completions``,
``/v1/images/generations``, ``/v1/videos`` with bodies of the right shape holding plausible and
hostile values, random JSON, bodies that are not JSON, wrong content types; the video id routes
with odd ids). It holds when:

- the status is never 5xx;
- every JSON body is strict JSON (no ``NaN``);
- a 4xx has OpenAI's error body (``{"error": {"message", "type", "param", "code"}}``, message and
  type strings);
- a 200 is what the SDK reads (``ChatCompletion``, ``ImagesResponse``, ``Video``), a stream's
  events are JSON and none is an error of type ``server_error``;
- the server logged no traceback and nothing at ERROR.

Then every video job the fuzzer started ends (completed, or failed with a client error, never
``server_error``), and the server's memory (with its VAD process) has grown by less than
``RSS_GROWTH_LIMIT`` over the whole run, after a warm-up that ran each route once.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
from hypothesis import event, given
from openai.types import ImagesResponse, Video
from openai.types.chat import ChatCompletion

from .conftest import LiveServer, fuzz_settings, strict_json
from .http_bodies import CHAT, IMAGE_MODEL, IMAGES, SIZES, SPEECH_MODEL, VIDEOS, HttpRequest, requests
from .realtime_events import PNG_B64

PNG_URL = "data:image/png;base64," + PNG_B64

#: Growth of the server's RSS over the fuzz run, after the warm-up.
RSS_GROWTH_LIMIT = 128 * 1024 * 1024
#: Longest a request may take (a valid one asks for little work).
TIMEOUT = 120.0


def send(live: LiveServer, request: HttpRequest) -> httpx.Response:
    headers = {"Content-Type": request.content_type} if request.content_type is not None else {}
    with httpx.Client(base_url=live.base_url, timeout=TIMEOUT) as client:
        return client.request(request.method, request.path, content=request.body, headers=headers)


def check_error_body(response: httpx.Response) -> None:
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"] != "server_error", error


def check_stream(response: httpx.Response) -> None:
    for line in response.text.splitlines():
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        data = strict_json(line.removeprefix("data:"))
        error = data.get("error") if isinstance(data, dict) else None
        assert not error or error.get("type") != "server_error", data


def check_video(job: dict[str, Any]) -> None:
    """The SDK's ``Video``, but for ``size``: the SDK lists Sora's four sizes, and any other size
    the model takes is served ("WxH", or "auto" for the model's default)."""
    assert isinstance(job["size"], str), job
    Video.model_validate({**job, "size": "720x1280"})


def check(request: HttpRequest, response: httpx.Response) -> None:
    event(f"{request.method} {request.path.split('?')[0][:24]} -> {response.status_code}")
    assert response.status_code < 500, (response.status_code, response.text[:2000])
    if response.headers.get("content-type", "").startswith("application/json"):
        strict_json(response.content)
    if response.status_code >= 400:
        check_error_body(response)
        event(f"code: {response.json()['error']['code']}")
        return
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        check_stream(response)
        return
    if request.method == "POST" and request.path == CHAT:
        ChatCompletion.model_validate(response.json())
    elif request.method == "POST" and request.path == IMAGES:
        ImagesResponse.model_validate(response.json())
    elif request.method == "POST" and request.path == VIDEOS:
        check_video(response.json())


def warm_up(live: LiveServer) -> None:
    """The valid work the fuzzer asks for, once each (replies, images of each size, plain and
    streamed, videos of each size and length), before the baseline memory."""
    with httpx.Client(base_url=live.base_url, timeout=TIMEOUT) as client:
        content = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": PNG_URL}}]
        for stream in (False, True):
            chat = {
                "model": SPEECH_MODEL,
                "messages": [{"role": "user", "content": content}],
                "max_tokens": 3,
            }
            assert client.post(CHAT, json={**chat, "stream": stream}).status_code == 200
        for size in SIZES:
            image = {"prompt": "a fox", "size": size, "n": 2, "num_inference_steps": 2, "model": IMAGE_MODEL}
            assert client.post(IMAGES, json=image).status_code == 200
            assert client.post(IMAGES, json={**image, "stream": True, "partial_images": 2}).status_code == 200
        for size in ("16x16", "32x32"):
            for frames in (1, 5):
                video = {"prompt": "waves", "size": size, "num_frames": frames, "num_inference_steps": 2}
                assert client.post(VIDEOS, json=video).status_code == 200
        assert client.post(VIDEOS, json={"prompt": "waves"}).status_code == 200  # the model's defaults
        wait_for_videos(live)


def wait_for_videos(live: LiveServer, timeout: float = 120.0) -> list[dict[str, Any]]:
    """Every video job, once none is queued or in progress."""
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=live.base_url, timeout=TIMEOUT) as client:
        while True:
            jobs = client.get(VIDEOS, params={"limit": 100}).json()["data"]
            if all(job["status"] in ("completed", "failed") for job in jobs):
                return jobs
            assert time.monotonic() < deadline, [
                j for j in jobs if j["status"] not in ("completed", "failed")
            ]
            time.sleep(0.2)


@fuzz_settings(examples=120)
@given(request=requests())
def test_requests_never_get_a_5xx_and_errors_are_openai_shaped(
    live: LiveServer, request: HttpRequest
) -> None:
    if live.baseline_rss is None:
        warm_up(live)
        live.assert_no_fault_logged()
        live.baseline_rss = live.rss()
    check(request, send(live, request))
    live.assert_alive()
    live.assert_no_fault_logged()


def test_video_jobs_end_without_server_errors_and_memory_stayed_bounded(live: LiveServer) -> None:
    """Runs after the fuzzing above (same module, same server)."""
    if live.baseline_rss is None:  # run alone
        warm_up(live)
        live.baseline_rss = live.rss()
    for job in wait_for_videos(live):
        check_video(job)
        error = job.get("error") or {}
        assert job["status"] == "completed" or error.get("code") != "server_error", job
    rss = live.settled_rss()
    grown = rss - live.baseline_rss
    print(f"http fuzz: server RSS {live.baseline_rss / 2**20:.0f} MiB -> {rss / 2**20:.0f} MiB")
    assert grown < RSS_GROWTH_LIMIT, f"server RSS grew by {grown / 2**20:.0f} MiB"
    live.assert_no_fault_logged()
