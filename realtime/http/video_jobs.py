"""The video jobs of ``/v1/videos``, kept in memory and bounded.

A :class:`VideoJobStore` holds at most ``max_jobs`` jobs and at most ``max_bytes`` of finished
MP4s, and forgets a finished (completed or failed) job ``ttl`` seconds after it finished (its
``expires_at``). Room is made by dropping the oldest finished jobs; jobs still queued or running
are never dropped, so a store full of them refuses new jobs (:class:`StoreFull`). A video larger
than ``max_bytes`` on its own fails its job. The store is plain data, touched from the event
loop only; the engine side lives in :mod:`.videos`.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

Status = Literal["queued", "in_progress", "completed", "failed"]
Order = Literal["asc", "desc"]
T = TypeVar("T")


class StoreFull(Exception):
    """Every job kept is still queued or running."""


@dataclass
class VideoJob:
    id: str
    model: str
    prompt: str
    #: As asked (``"WxH"``, ``"auto"``) until the video is made, then what it is.
    size: str
    #: Clip length in seconds, as text (``"4"``, ``"5.06"``); ``"auto"`` while the model decides.
    seconds: str
    #: When the job was made (``time.time()``): ``created_at`` to the second, and the order of the
    #: jobs of a fleet of replicas to the microsecond.
    created: float = field(default_factory=time.time)
    status: Status = "queued"
    progress: int = 0
    completed_at: int | None = None
    expires_at: int | None = None
    #: ``{"code", "message"}`` once failed.
    error: dict[str, str] | None = None
    mp4: bytes | None = None

    @property
    def created_at(self) -> int:
        return int(self.created)

    @property
    def finished(self) -> bool:
        return self.status in ("completed", "failed")

    def card(self) -> dict[str, Any]:
        """The OpenAI ``Video`` object."""
        return {
            "id": self.id,
            "object": "video",
            "model": self.model,
            "status": self.status,
            "progress": self.progress,
            "created_at": self.created_at,
            "completed_at": self.completed_at,
            "expires_at": self.expires_at,
            "error": self.error,
            "prompt": self.prompt,
            "remixed_from_video_id": None,
            "seconds": self.seconds,
            "size": self.size,
        }


class VideoJobStore:
    def __init__(
        self,
        *,
        max_jobs: int,
        max_bytes: int,
        ttl: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if max_jobs < 1 or max_bytes < 1 or ttl <= 0:
            raise ValueError("max_jobs, max_bytes and ttl must be positive")
        self.max_jobs = max_jobs
        self.max_bytes = max_bytes
        self.ttl = ttl
        self.clock = clock
        self._jobs: collections.OrderedDict[str, VideoJob] = collections.OrderedDict()  # oldest first
        self.bytes = 0

    def __len__(self) -> int:
        self.sweep()
        return len(self._jobs)

    def add(self, job: VideoJob) -> None:
        """Keep a new job (the newest); :class:`StoreFull` when no finished job can make room."""
        self.sweep()
        if len(self._jobs) >= self.max_jobs and not self._drop_oldest_finished():
            raise StoreFull(
                f"{len(self._jobs)} video jobs are queued or running; that is this server's limit"
            )
        self._jobs[job.id] = job

    def get(self, job_id: str) -> VideoJob | None:
        self.sweep()
        return self._jobs.get(job_id)

    def remove(self, job_id: str) -> VideoJob | None:
        job = self._jobs.pop(job_id, None)
        if job is not None and job.mp4 is not None:
            self.bytes -= len(job.mp4)
        return job

    def complete(self, job: VideoJob, mp4: bytes, *, size: str, seconds: str) -> None:
        """Keep ``job``'s video; older finished jobs are dropped while the bytes are over the limit.
        A video over the limit on its own fails the job instead."""
        if job.id not in self._jobs:
            return  # deleted meanwhile
        if len(mp4) > self.max_bytes:
            self.fail(
                job,
                "video_too_large",
                f"the video is {len(mp4)} bytes, more than this server keeps ({self.max_bytes})",
            )
            return
        while self.bytes + len(mp4) > self.max_bytes and self._drop_oldest_finished(with_video=True):
            pass
        job.mp4, job.size, job.seconds = mp4, size, seconds
        self.bytes += len(mp4)
        job.status, job.progress = "completed", 100
        self._finish(job)

    def fail(self, job: VideoJob, code: str, message: str) -> None:
        job.status, job.error = "failed", {"code": code, "message": message}
        self._finish(job)

    def _finish(self, job: VideoJob) -> None:
        now = self.clock()
        job.completed_at = int(now)
        job.expires_at = int(now + self.ttl)

    def page(self, *, after: str | None, limit: int, order: Order) -> tuple[list[VideoJob], bool]:
        """Up to ``limit`` jobs in creation order (``desc``: newest first) after the job ``after``;
        and whether more follow. ``KeyError`` for an ``after`` that is not kept."""
        return page_of(self.jobs(), lambda job: job.id, after=after, limit=limit, order=order)

    def jobs(self) -> list[VideoJob]:
        """The jobs kept, oldest first."""
        self.sweep()
        return list(self._jobs.values())

    def sweep(self) -> list[VideoJob]:
        """Forget the finished jobs past their ``expires_at``; the jobs forgotten."""
        now = self.clock()
        expired = [j for j in self._jobs.values() if j.expires_at is not None and j.expires_at <= now]
        for job in expired:
            self.remove(job.id)
        return expired

    def _drop_oldest_finished(self, *, with_video: bool = False) -> bool:
        for job in self._jobs.values():
            if job.finished and (job.mp4 is not None or not with_video):
                self.remove(job.id)
                return True
        return False


def page_of(
    items: Sequence[T], id_of: Callable[[T], str], *, after: str | None, limit: int, order: Order
) -> tuple[list[T], bool]:
    """A page of ``items`` (oldest first), as ``GET /v1/videos`` pages: up to ``limit`` in creation
    order (``desc``: newest first) after the one whose id is ``after``; and whether more follow.
    ``KeyError`` for an ``after`` not among them."""
    ordered = list(reversed(items)) if order == "desc" else list(items)
    start = 0
    if after is not None:
        start = next((i + 1 for i, item in enumerate(ordered) if id_of(item) == after), -1)
        if start < 0:
            raise KeyError(after)
    return ordered[start : start + limit], start + limit < len(ordered)
