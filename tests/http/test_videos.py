"""``/v1/videos`` through the official SDK (create, retrieve, poll, download_content, delete,
list) and raw HTTP, against the real app and Engine with the fake video pipeline."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from typing import Any

import av
import pytest
from openai import BadRequestError, NotFoundError

from tests.diffusion_fakes import FakeVideoPipeline, image_colour

from .conftest import MediaServer, run, running_media, wait_for

pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")  # the SDK's notice


@pytest.fixture(scope="module")
def media() -> Iterator[MediaServer]:
    with running_media() as s:
        yield s


def frames(mp4: bytes) -> list[Any]:
    with av.open(io.BytesIO(mp4)) as container:
        assert container.streams.video[0].codec_context.name == "h264"
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


def test_create_poll_download_delete_through_the_sdk(media: MediaServer) -> None:
    async def go() -> tuple[Any, ...]:
        async with media.openai() as client:
            created = await client.videos.create(
                prompt="a green field",
                size="48x32",  # type: ignore[arg-type]
                extra_body={"seed": 3, "num_inference_steps": 3, "guidance_scale": 4.0, "fps": 4},
            )
            done = await client.videos.poll(created.id, poll_interval_ms=20)
            content = await client.videos.download_content(created.id)
            deleted = await client.videos.delete(created.id)
            with pytest.raises(NotFoundError) as gone:
                await client.videos.retrieve(created.id)
            return created, done, content.content, deleted, gone.value

    created, done, mp4, deleted, gone = run(go())
    assert created.id.startswith("video_") and created.object == "video"
    assert created.status in ("queued", "in_progress") and created.model == "video-test"
    assert created.size == "48x32" and created.seconds == "auto" and created.created_at > 0
    assert (done.status, done.progress, done.error) == ("completed", 100, None)
    assert done.completed_at >= done.created_at and done.expires_at > done.completed_at
    assert (done.size, done.seconds) == ("48x32", "1.25")  # 5 frames at 4 fps
    pictures = frames(mp4)
    assert len(pictures) == 5 and pictures[0].shape == (32, 48, 3)
    assert abs(pictures[0][0, 0].astype(int) - image_colour(3, 0)).max() <= 8  # H.264 is lossy
    assert deleted.deleted and deleted.id == created.id and deleted.object == "video.deleted"
    assert gone.code == "video_not_found"
    seen = media.video.seen[-1]
    assert (seen.request_id, seen.width, seen.height, seen.seed) == (created.id, 48, 32, 3)
    assert (seen.num_inference_steps, seen.guidance_scale, seen.fps, seen.seconds) == (3, 4.0, 4, None)


def test_seconds_become_the_models_frame_count(media: MediaServer) -> None:
    async def go() -> Any:
        async with media.openai() as client:
            video = await client.videos.create_and_poll(prompt="x", seconds="4", poll_interval_ms=20)
            return video, (await client.videos.download_content(video.id)).content

    video, mp4 = run(go())
    assert media.video.seen[-1].seconds == 4.0 and media.video.seen[-1].num_frames is None
    assert video.status == "completed" and video.seconds == "4.12"  # 33 frames at 8 fps
    assert len(frames(mp4)) == 33


def test_json_body_is_accepted_too(media: MediaServer) -> None:
    with media.http() as http:
        created = http.post("/v1/videos", json={"prompt": "json", "num_frames": 9, "seed": 1})
        assert created.status_code == 200, created.text
        video_id = created.json()["id"]
        assert wait_for(lambda: http.get(f"/v1/videos/{video_id}").json()["status"] == "completed")
        content = http.get(f"/v1/videos/{video_id}/content")
    assert content.headers["content-type"] == "video/mp4"
    assert len(frames(content.content)) == 9


def test_progress_is_reported_while_running_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    slow = FakeVideoPipeline(step_seconds=0.05, default_steps=20)
    with running_media(video=slow) as media, media.http() as http, caplog.at_level(logging.INFO):
        video_id = http.post("/v1/videos", json={"prompt": "slow"}).json()["id"]
        seen: set[int] = set()

        def progressed() -> bool:
            job = http.get(f"/v1/videos/{video_id}").json()
            seen.add(job["progress"])
            return job["status"] == "completed"

        assert wait_for(progressed, timeout=10)
        running = http.get(f"/v1/videos/{video_id}")
    assert any(0 < p < 100 for p in seen) and 100 in seen
    assert "openai-poll-after-ms" not in running.headers  # only while it runs
    messages = [r.getMessage() for r in caplog.records if video_id in r.getMessage()]
    assert any("step 1/20 (5%)" in m for m in messages) and any("step 20/20 (100%)" in m for m in messages)
    assert any("completed (32x32, 5 frames at 8 fps" in m for m in messages)


def test_content_before_completion_is_409_and_delete_cancels() -> None:
    slow = FakeVideoPipeline(step_seconds=0.05, default_steps=400)
    slow.max_steps = 1000
    with running_media(video=slow) as media, media.http() as http:
        created = http.post("/v1/videos", json={"prompt": "long"}).json()
        video_id = created["id"]
        assert wait_for(lambda: http.get(f"/v1/videos/{video_id}").json()["status"] == "in_progress")
        job = http.get(f"/v1/videos/{video_id}")
        assert job.headers["openai-poll-after-ms"] == "1000"
        early = http.get(f"/v1/videos/{video_id}/content")
        assert early.status_code == 409
        assert (
            early.json()["error"]["code"] == "video_not_ready"
            and "in_progress" in early.json()["error"]["message"]
        )
        deleted = http.delete(f"/v1/videos/{video_id}")
        assert deleted.json() == {"id": video_id, "object": "video.deleted", "deleted": True}
        assert wait_for(lambda: not slow.active)  # the engine dropped it
        assert http.get(f"/v1/videos/{video_id}").status_code == 404
        assert http.delete(f"/v1/videos/{video_id}").status_code == 404
        assert media.engine.stats.requests_cancelled == 1


def test_a_video_the_model_refuses_is_a_400_and_no_job(media: MediaServer) -> None:
    """The model's own limits (here: frame counts of 4k + 1) are checked before the job exists."""

    async def go() -> Any:
        async with media.openai() as client:
            with pytest.raises(BadRequestError) as info:
                await client.videos.create(prompt="x", extra_body={"num_frames": 6})
            return info.value

    before = media.engine.stats.requests_submitted
    error = run(go())
    assert error.status_code == 400 and "num_frames must be 4k + 1, got 6" in error.message
    assert error.code == "invalid_value"
    assert media.engine.stats.requests_submitted == before  # nothing was started


def test_list_pages_through_the_sdk(media: MediaServer) -> None:
    async def go() -> tuple[list[str], list[str], list[str]]:
        async with media.openai() as client:
            ids = [(await client.videos.create(prompt=f"v{i}")).id for i in range(3)]
            for video_id in ids:
                await client.videos.poll(video_id, poll_interval_ms=20)
            newest = [v.id async for v in client.videos.list(limit=2)]  # follows pages
            oldest = [v.id async for v in client.videos.list(limit=2, order="asc")]
            return ids, newest, oldest

    ids, newest, oldest = run(go())
    assert newest[:3] == ids[::-1]
    assert oldest[-3:] == ids
    assert len(newest) == len(oldest) == len(set(newest))


def test_list_raw_shape(media: MediaServer) -> None:
    with media.http() as http:
        http.post("/v1/videos", json={"prompt": "a"})
        http.post("/v1/videos", json={"prompt": "b"})
        page = http.get("/v1/videos", params={"limit": 1}).json()
        follow = http.get("/v1/videos", params={"limit": 1, "after": page["last_id"]}).json()
    assert page["object"] == "list" and len(page["data"]) == 1 and page["has_more"] is True
    assert page["first_id"] == page["last_id"] == page["data"][0]["id"]
    assert follow["data"][0]["id"] != page["last_id"]


BAD_CREATE = [
    ({"prompt": ""}, "prompt", "the prompt is empty"),
    ({"model": "image-test"}, "model", "does not do video generation"),
    ({"seconds": "0"}, "seconds", "greater than 0"),
    ({"seconds": "61"}, "seconds", "at most 60"),
    ({"seconds": "four"}, "seconds", "Invalid value for 'seconds'"),
    ({"size": "720p"}, "size", "expected 'WIDTHxHEIGHT'"),
    ({"size": "99999x16"}, "size", "between 1 and 4096"),
    ({"num_inference_steps": "0"}, "num_inference_steps", "between 1 and 200"),
    ({"num_frames": "0"}, "num_frames", "between 1 and 2048"),
    ({"fps": "500"}, "fps", "between 1 and 120"),
    ({"seed": "-3"}, "seed", "greater than or equal to 0"),
    ({"guidance_scale": "nan"}, "guidance_scale", "finite number"),
    ({"seconds": "4", "num_frames": "33"}, "num_frames", "not both"),
    ({"input_reference": "ref"}, "input_reference", "text-to-video only"),
]


@pytest.mark.parametrize(
    ("fields", "param", "message"), BAD_CREATE, ids=[repr(b[0])[:40] for b in BAD_CREATE]
)
def test_bad_create_is_a_400_as_form_and_json(
    media: MediaServer, fields: dict[str, str], param: str, message: str
) -> None:
    form = {"prompt": "a cat", **fields}
    kept = len(media.app.state.videos.store)
    with media.http() as http:
        as_form = http.post("/v1/videos", data=form, files={"unused": ("", b"")})
        as_json = http.post("/v1/videos", json=form)
    for response in (as_form, as_json):
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["type"], error["param"]) == ("invalid_request_error", param)
        assert message in error["message"]
    assert len(media.app.state.videos.store) == kept  # no job made


def test_a_json_integer_past_a_float_in_cache_config_is_a_400(media: MediaServer) -> None:
    kept = len(media.app.state.videos.store)
    with media.http() as http:
        for setting in ("threshold", "retention_ratio"):
            body = {"prompt": "x", "cache_backend": "magcache", "cache_config": {setting: 10**400}}
            response = http.post("/v1/videos", json=body)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert (error["param"], error["code"]) == ("cache_config", "invalid_value")
            assert f"{setting} must be from 0 to" in error["message"] and "401 digits" in error["message"]
        assert http.get("/v1/videos").status_code == 200  # the server goes on
    assert len(media.app.state.videos.store) == kept


def test_other_bad_requests(media: MediaServer) -> None:
    with media.http() as http:
        missing = http.post("/v1/videos", data={"model": "video-test"}, files={"unused": ("", b"")})
        upload = http.post("/v1/videos", data={"prompt": "x"}, files={"input_reference": ("a.png", b"png")})
        garbage = http.post("/v1/videos", content=b"[1]", headers={"content-type": "application/json"})
        unknown = http.get("/v1/videos/video_nope")
        unknown_content = http.get("/v1/videos/video_nope/content")
        bad_order = http.get("/v1/videos", params={"order": "up"})
        bad_limit = http.get("/v1/videos", params={"limit": "0"})
        bad_after = http.get("/v1/videos", params={"after": "video_nope"})
        created = http.post("/v1/videos", json={"prompt": "x"}).json()
        thumbnail = http.get(f"/v1/videos/{created['id']}/content", params={"variant": "thumbnail"})
    assert missing.status_code == 400 and missing.json()["error"]["code"] == "missing_required_parameter"
    assert upload.status_code == 400 and upload.json()["error"]["param"] == "input_reference"
    assert garbage.status_code == 400 and garbage.json()["error"]["code"] == "invalid_type"
    for response in (unknown, unknown_content):
        assert response.status_code == 404 and response.json()["error"]["code"] == "video_not_found"
    assert bad_order.status_code == 400 and bad_order.json()["error"]["param"] == "order"
    assert bad_limit.status_code == 400 and bad_limit.json()["error"]["param"] == "limit"
    assert bad_after.status_code == 400 and bad_after.json()["error"]["param"] == "after"
    assert thumbnail.status_code == 400 and thumbnail.json()["error"]["param"] == "variant"


def test_models_lists_speech_image_and_video(media: MediaServer) -> None:
    async def go() -> list[Any]:
        async with media.openai() as client:
            return [m async for m in client.models.list()]

    models = run(go())
    assert [(m.id, m.kind) for m in models] == [  # type: ignore[attr-defined]
        ("echo-test", "speech"),
        ("image-test", "image"),
        ("video-test", "video"),
    ]


def test_a_store_full_of_running_jobs_refuses_with_429() -> None:
    from omnirt.realtime.config import ServerConfig

    slow = FakeVideoPipeline(step_seconds=0.05, default_steps=400)
    slow.max_steps = 1000
    config = ServerConfig(vad_preload=False, max_video_jobs=1)
    with running_media(video=slow, config=config) as media, media.http() as http:
        first = http.post("/v1/videos", json={"prompt": "long"}).json()
        refused = http.post("/v1/videos", json={"prompt": "one more"})
        assert refused.status_code == 429 and refused.headers["retry-after"] == "10"
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        http.delete(f"/v1/videos/{first['id']}")
        assert http.post("/v1/videos", json={"prompt": "now"}).status_code == 200


@pytest.mark.parametrize("field", ["prompt", "negative_prompt", "model"])
def test_a_json_body_with_a_lone_surrogate_is_invalid_json_and_the_list_still_works(
    media: MediaServer, field: str
) -> None:
    """``"\\ud800"`` is a valid JSON escape of no character any UTF-8 encoder takes: the JSON body
    is refused as invalid_json, as the other endpoints' parser does, before it reaches the model's
    tokenizer (which failed the step: a 500) or the job store (whose JSON then failed every
    ``GET /v1/videos``: a 500 for everyone). Found by the fuzzer (tests/fuzz)."""
    body = '{"prompt": "waves", "num_frames": 1, "' + field + '": "a \\ud800 b"}'
    if field == "prompt":
        body = '{"prompt": "a \\ud800 b", "num_frames": 1}'
    with media.http() as http:
        refused = http.post("/v1/videos", content=body, headers={"Content-Type": "application/json"})
        listed = http.get("/v1/videos")
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "invalid_json", refused.json()
    assert listed.status_code == 200, listed.text
