"""The bounded in-memory store of video jobs, on a simulated clock."""

from __future__ import annotations

import pytest
from omnirt.realtime.http.video_jobs import StoreFull, VideoJob, VideoJobStore


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def job(n: int) -> VideoJob:
    return VideoJob(id=f"video_{n}", model="m", prompt="p", size="auto", seconds="auto", created=n)


def store(clock: Clock, **limits: float) -> VideoJobStore:
    kwargs = {"max_jobs": 3, "max_bytes": 100, "ttl": 60.0, **limits}
    return VideoJobStore(clock=clock, **kwargs)  # type: ignore[arg-type]


def test_full_of_running_jobs_refuses_and_drops_the_oldest_finished_first() -> None:
    s = store(Clock())
    jobs = [job(i) for i in range(3)]
    for j in jobs:
        s.add(j)
    with pytest.raises(StoreFull):
        s.add(job(3))
    assert len(s) == 3  # state intact
    s.fail(jobs[2], "x", "failed")
    s.complete(jobs[1], b"v" * 10, size="8x8", seconds="1")
    s.add(job(3))  # drops video_1: the oldest finished, not video_0 (running)
    assert [j.id for j in s.page(after=None, limit=10, order="asc")[0]] == ["video_0", "video_2", "video_3"]
    assert s.bytes == 0


def test_bytes_over_the_limit_drop_older_videos_and_a_huge_one_fails() -> None:
    s = store(Clock(), max_jobs=10)
    a, b, c, d = (job(i) for i in range(4))
    for j in (a, b, c, d):
        s.add(j)
    s.complete(a, b"a" * 60, size="8x8", seconds="1")
    s.complete(b, b"b" * 30, size="8x8", seconds="1")
    assert s.bytes == 90
    s.complete(c, b"c" * 50, size="8x8", seconds="1")  # a goes
    assert s.get(a.id) is None and s.bytes == 80
    assert (c.status, c.progress, c.size) == ("completed", 100, "8x8")
    s.complete(d, b"d" * 101, size="8x8", seconds="1")
    assert d.status == "failed" and d.error is not None and d.error["code"] == "video_too_large"
    assert d.mp4 is None and s.bytes == 80 and s.get(b.id) is b  # nothing else dropped for it


def test_finished_jobs_expire_and_running_ones_never() -> None:
    clock = Clock()
    s = store(clock)
    done, running = job(0), job(1)
    s.add(done)
    s.add(running)
    s.complete(done, b"x" * 5, size="8x8", seconds="1")
    assert (done.completed_at, done.expires_at) == (1000, 1060)
    clock.t = 1059.0
    assert s.get(done.id) is done
    clock.t = 1060.0
    assert s.get(done.id) is None and s.bytes == 0
    clock.t = 10**6
    assert s.get(running.id) is running


def test_completing_a_removed_job_keeps_nothing() -> None:
    s = store(Clock())
    j = job(0)
    s.add(j)
    s.remove(j.id)
    s.complete(j, b"x" * 5, size="8x8", seconds="1")
    assert s.bytes == 0 and len(s) == 0


def test_pages_in_both_orders() -> None:
    s = store(Clock(), max_jobs=10)
    for i in range(5):
        s.add(job(i))
    first, more = s.page(after=None, limit=2, order="desc")
    assert [j.id for j in first] == ["video_4", "video_3"] and more
    last, more = s.page(after="video_2", limit=2, order="desc")
    assert [j.id for j in last] == ["video_1", "video_0"] and not more
    asc, more = s.page(after="video_3", limit=5, order="asc")
    assert [j.id for j in asc] == ["video_4"] and not more
    with pytest.raises(KeyError):
        s.page(after="video_9", limit=2, order="asc")


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError):
        VideoJobStore(max_jobs=0, max_bytes=1, ttl=1)
