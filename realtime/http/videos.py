"""``/v1/videos``: video generation as jobs, in OpenAI's videos shape.

- ``POST /v1/videos`` checks the body, then the model's own limits (its pipeline's ``prepare``
  through ``EngineClient.check``: a frame count or size it cannot make), each a 400; submits one
  engine request and answers the job (``queued``) at once. A task follows the request:
  ``Progress`` makes the job ``in_progress`` with ``progress`` = steps done / total (at most 99
  until the MP4 is there) and is logged for long jobs; the ``GeneratedVideo`` completes it. A job
  that fails ends ``failed`` with ``error: {"code", "message"}``.
- ``GET /v1/videos/{id}``: the job (``openai-poll-after-ms`` tells the SDK's ``poll`` how long
  to wait while it runs); ``GET /v1/videos/{id}/content``: the MP4 (``video/mp4``), 409 while
  it is not completed; ``DELETE /v1/videos/{id}``: cancels a job still running and forgets it;
  ``GET /v1/videos``: the jobs kept, newest first by default (``after``, ``limit``, ``order``).
- Jobs live in a bounded in-memory :class:`~.video_jobs.VideoJobStore`. A replica of
  ``omnirt serve --replicas`` also shares them with the fleet (:class:`JobSharing`): its job ids
  name it (the router sends a job's requests to it) and ``GET /v1/videos`` lists every replica's
  jobs. One process has no sharing: the store alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Protocol

from omnirt.stages.diffusion.types import GeneratedVideo, Progress, VideoRequest
from omnirt.stages.engine import EngineClient, RequestStream
from omnirt.stages.pipeline import RequestRejected
from omnirt.stages.types import Finished
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..config import ServerConfig
from ..ids import new_id
from .access import require_api_key
from .body import read_body
from .content_type import require_json_or_form
from .errors import APIError, bad_request, from_engine_error
from .media import ProgressLog, choose_model
from .video_jobs import Order, StoreFull, VideoJob, VideoJobStore
from .video_params import parse_body, read_fields, video_request

log = logging.getLogger(__name__)

#: What ``GET /v1/videos/{id}`` advises the SDK's ``poll`` to wait while a job runs.
POLL_AFTER_MS = 1000
MAX_LIST_LIMIT = 100
DEFAULT_LIST_LIMIT = 20


def _not_found(video_id: str) -> APIError:
    return APIError(404, f"No video with id '{video_id}'.", param="video_id", code="video_not_found")


def _seconds(frames: int, fps: int) -> str:
    return f"{frames / fps:.2f}".rstrip("0").rstrip(".")


class JobSharing(Protocol):
    """How a replica of a fleet shares its jobs (``omnirt.realtime.replicas.video_jobs``)."""

    def new_id(self) -> str:
        """A new job's id (one that names this replica)."""
        ...

    async def shared(self) -> None:
        """Returns once the fleet holds this replica's jobs as they are now (or gave up)."""
        ...

    def changed(self, *, now: bool) -> None:
        """The jobs changed: share them (``now``: at once; else within a short throttle)."""
        ...

    async def page(self, *, after: str | None, limit: int, order: Order) -> tuple[list[dict[str, Any]], bool]:
        """The fleet's jobs' cards as :meth:`VideoJobStore.page` pages its own (``KeyError`` alike)."""
        ...


class Videos:
    """The endpoints, bound to one engine client and server configuration."""

    def __init__(self, client: EngineClient, config: ServerConfig) -> None:
        self.client = client
        self.config = config
        self.store = VideoJobStore(
            max_jobs=config.max_video_jobs,
            max_bytes=config.max_video_store_bytes,
            ttl=config.video_job_ttl_seconds,
        )
        self._running: dict[str, tuple[RequestStream, asyncio.Task[None]]] = {}
        #: Set by a replica of a fleet (``realtime/replicas/``); None in one process.
        self.sharing: JobSharing | None = None

    async def create(self, request: Request) -> JSONResponse:
        require_api_key(request, self.config.api_keys)
        require_json_or_form(request)
        raw = await read_body(request, self.config.max_http_body_bytes)
        body = parse_body(await read_fields(request, raw), self.config)
        probe = VideoRequest(request_id="", prompt="")
        model = choose_model(self.client, body.model, probe, "video generation")
        try:  # what the model cannot make is a 400 now, not a failed job later
            await self.client.check(video_request(body, "check", model, self.config))
        except RequestRejected as exc:
            raise bad_request(str(exc)) from None
        job = VideoJob(
            id=new_id("video") if self.sharing is None else self.sharing.new_id(),
            model=model,
            prompt=body.prompt,
            size=body.size or "auto",
            seconds=f"{body.seconds:g}" if body.seconds is not None else "auto",
        )
        try:
            self.store.add(job)
        except StoreFull as exc:
            raise APIError(
                429,
                f"Too many video jobs: {exc}. Retry later.",
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": "10"},
            ) from None
        stream = self.client.submit(video_request(body, job.id, model, self.config))
        task = asyncio.create_task(self._follow(job, stream), name=f"video {job.id}")
        self._running[job.id] = (stream, task)
        log.info("video %s queued (%s): %r", job.id, model, body.prompt[:80])
        card = job.card()
        if self.sharing is not None:  # a list right after this answer, on any replica, shows the job
            await self.sharing.shared()
        return JSONResponse(card)

    async def retrieve(self, request: Request) -> JSONResponse:
        require_api_key(request, self.config.api_keys)
        job = self._job(request)
        headers = {} if job.finished else {"openai-poll-after-ms": str(POLL_AFTER_MS)}
        return JSONResponse(job.card(), headers=headers)

    async def content(self, request: Request) -> Response:
        require_api_key(request, self.config.api_keys)
        job = self._job(request)
        variant = request.query_params.get("variant", "video")
        if variant != "video":
            raise bad_request(
                f"Unsupported value for 'variant': {variant!r}; this server keeps the MP4 ('video') only.",
                param="variant",
                code="unsupported_value",
            )
        if job.status != "completed" or job.mp4 is None:
            if job.error is not None:
                message = f"Video '{job.id}' failed: {job.error['message']}."
            else:
                message = f"Video '{job.id}' is {job.status}; download it once its status is 'completed'."
            raise APIError(409, message, code="video_not_ready")
        return Response(
            job.mp4,
            media_type="video/mp4",
            headers={"Content-Disposition": f'inline; filename="{job.id}.mp4"'},
        )

    async def delete(self, request: Request) -> JSONResponse:
        require_api_key(request, self.config.api_keys)
        job = self._job(request)
        running = self._running.pop(job.id, None)
        if running is not None:
            stream, task = running
            stream.cancel()  # the engine drops it at its next step boundary
            task.cancel()
            log.info("video %s cancelled at %d%%", job.id, job.progress)
        self.store.remove(job.id)
        if self.sharing is not None:  # gone from the fleet's list once this answers
            await self.sharing.shared()
        return JSONResponse({"id": job.id, "object": "video.deleted", "deleted": True})

    async def list(self, request: Request) -> JSONResponse:
        require_api_key(request, self.config.api_keys)
        query = request.query_params
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request(f"Invalid value for 'order': 'asc' or 'desc', not {order!r}.", param="order")
        try:
            limit = int(query.get("limit", DEFAULT_LIST_LIMIT))
        except ValueError:
            limit = 0
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise bad_request(
                f"Invalid value for 'limit': an integer from 1 to {MAX_LIST_LIMIT}, "
                f"not {query.get('limit')!r}.",
                param="limit",
            )
        after = query.get("after")
        try:
            if self.sharing is None:
                jobs, more = self.store.page(after=after, limit=limit, order=order)  # type: ignore[arg-type]
                cards = [job.card() for job in jobs]
            else:
                cards, more = await self.sharing.page(after=after, limit=limit, order=order)  # type: ignore[arg-type]
        except KeyError:
            raise bad_request(
                f"Invalid value for 'after': no video with id {after!r}.", param="after"
            ) from None
        return JSONResponse(
            {
                "object": "list",
                "data": cards,
                "first_id": cards[0]["id"] if cards else None,
                "last_id": cards[-1]["id"] if cards else None,
                "has_more": more,
            }
        )

    async def aclose(self) -> None:
        """Cancel every job still running (the app is stopping)."""
        running = list(self._running.values())
        self._running.clear()
        for stream, task in running:
            stream.cancel()
            task.cancel()
        for _, task in running:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _job(self, request: Request) -> VideoJob:
        video_id = request.path_params["video_id"]
        job = self.store.get(video_id)
        if job is None:
            raise _not_found(video_id)
        return job

    async def _follow(self, job: VideoJob, stream: RequestStream) -> None:
        progress = ProgressLog(f"video {job.id} ({job.model})", self.config.progress_log_seconds)
        video: GeneratedVideo | None = None
        try:
            async for output in stream:
                if isinstance(output, Progress):
                    started = job.status != "in_progress"
                    job.status = "in_progress"
                    job.progress = min(99, 100 * output.done // max(output.total, 1))
                    progress.step(output.done, output.total)
                    if self.sharing is not None:
                        self.sharing.changed(now=started)
                elif isinstance(output, GeneratedVideo):
                    video = output
                elif isinstance(output, Finished):
                    self._finish(job, output, video, progress)
                    if self.sharing is not None:
                        self.sharing.changed(now=True)
        finally:
            self._running.pop(job.id, None)

    def _finish(
        self, job: VideoJob, finished: Finished, video: GeneratedVideo | None, progress: ProgressLog
    ) -> None:
        if finished.reason in ("stop", "length") and video is not None:
            size, seconds = f"{video.width}x{video.height}", _seconds(video.frames, video.fps)
            self.store.complete(job, video.mp4, size=size, seconds=seconds)
            progress.end(
                f"{job.status} ({size}, {video.frames} frames at {video.fps} fps, {len(video.mp4)} bytes)"
            )
            return
        if finished.reason == "error":
            error = from_engine_error(finished)
            self.store.fail(job, error.code or "server_error", error.message)
        elif finished.reason == "cancelled":
            self.store.fail(job, "cancelled", "the job was cancelled")
        else:
            self.store.fail(job, "server_error", "the model finished without a video")
        progress.end(f"failed ({job.error})")
