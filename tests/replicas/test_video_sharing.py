"""The pieces of fleet-wide ``/v1/videos`` on given data, no Ray (the whole path through Ray Serve
runs in test_replicas.py): the merge of the replicas' jobs, the fleet's keeping of them, and a
replica's sharing (when it sends, what it lists) against a fleet handle of the test's."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from omnirt.realtime.http.video_jobs import VideoJob, VideoJobStore
from omnirt.realtime.replicas.fleet import FleetStats, ReplicaReport
from omnirt.realtime.replicas.load import ReplicaLoad
from omnirt.realtime.replicas.video_ids import owner_of
from omnirt.realtime.replicas.video_jobs import FleetVideoJobs, SharedJobs, merge_jobs


def card(job_id: str, expires_at: int | None = None) -> dict[str, Any]:
    return {"id": job_id, "expires_at": expires_at}


def shared(replica: str, seq: int, *jobs: tuple[float, str]) -> SharedJobs:
    return SharedJobs(replica, seq, [(created, card(job_id)) for created, job_id in jobs])


def ids(cards: list[dict[str, Any]]) -> list[str]:
    return [c["id"] for c in cards]


def test_the_merge_orders_by_creation_across_replicas_and_keeps_each_replicas_order() -> None:
    a = shared("a", 1, (1.0, "a1"), (3.0, "a2"), (2.5, "a3"))  # a's clock stepped back: a3 still after a2
    b = shared("b", 1, (2.0, "b1"), (3.0, "b2"), (4.0, "b3"))
    stale_own = shared("c", 1, (0.5, "old"))
    own = shared("c", 2, (3.5, "c1"))  # taken fresh: the fleet's older view of c is not used
    assert ids(merge_jobs(own, [a, b, stale_own])) == ["a1", "b1", "a2", "a3", "b2", "c1", "b3"]
    # Equal times: by replica, stably.
    assert ids(merge_jobs(shared("b", 1, (1.0, "b")), [shared("a", 1, (1.0, "a"))])) == ["a", "b"]


def test_the_merge_leaves_out_expired_cards() -> None:
    now = 1000.0
    other = SharedJobs("b", 1, [(1.0, card("gone", expires_at=1000)), (2.0, card("kept", expires_at=1001))])
    assert ids(merge_jobs(shared("a", 1), [other], now=now)) == ["kept"]


def test_the_fleet_keeps_the_latest_share_of_each_replica_and_forgets_silent_ones() -> None:
    fleet = FleetStats(stale_seconds=0.3)
    fleet.share_videos(shared("a", 2, (1.0, "new")))
    fleet.share_videos(shared("a", 1, (1.0, "old")))  # sent earlier, came later
    report = ReplicaReport("b", ReplicaLoad(2, 0, 0), videos=shared("b", 5, (2.0, "b1")))
    fleet.report(report)
    assert {s.replica: ids([c for _, c in s.jobs]) for s in fleet.videos()} == {"a": ["new"], "b": ["b1"]}
    assert fleet.reports()[0].videos is None  # health and metrics readers get no cards
    fleet.forget("b")
    assert [s.replica for s in fleet.videos()] == ["a"]
    time.sleep(0.35)
    fleet.share_videos(shared("c", 1))
    assert [s.replica for s in fleet.videos()] == ["c"]  # a stopped sharing


def test_the_fleet_keeps_the_latest_report_of_each_replica() -> None:
    fleet = FleetStats()
    now = time.time()
    fleet.report(ReplicaReport("a", ReplicaLoad(2, 1, 0), at=now))
    fleet.report(ReplicaReport("a", ReplicaLoad(2, 0, 0), at=now - 0.5))  # sent earlier, came later
    assert [r.load.sessions_active for r in fleet.reports()] == [1]
    fleet.report(ReplicaReport("a", ReplicaLoad(2, 2, 0), at=now + 0.5))
    assert [r.load.sessions_active for r in fleet.reports()] == [2]


class FakeFleet:
    """The two methods of the ``OmnirtFleet`` handle a replica calls, with a FleetStats of its own."""

    def __init__(self, stats: FleetStats) -> None:
        self.stats = stats
        self.sent: list[SharedJobs] = []
        self.failing = False
        fleet = self

        class Method:
            def __init__(self, name: str) -> None:
                self.name = name

            def remote(self, *args: Any) -> Any:
                async def call() -> Any:
                    await asyncio.sleep(0)
                    if fleet.failing:
                        raise ConnectionError("fleet restarting")
                    if self.name == "share_videos":
                        fleet.sent.append(args[0])
                    return getattr(fleet.stats, self.name)(*args)

                return call()

        self.share_videos = Method("share_videos")
        self.videos = Method("videos")


def job(job_id: str, created: float) -> VideoJob:
    return VideoJob(job_id, "m", "p", "auto", "auto", created=created)


def test_a_replica_shares_at_once_or_throttled_and_lists_the_fleets_jobs() -> None:
    async def go() -> None:
        stats = FleetStats()
        fleet = FakeFleet(stats)
        store = VideoJobStore(max_jobs=10, max_bytes=100, ttl=60)
        sharing = FleetVideoJobs(store, fleet, "abc123de", throttle_seconds=0.2)
        new = sharing.new_id()
        assert owner_of(f"/v1/videos/{new}") == "abc123de"
        store.add(job(new, 2.0))
        await sharing.shared()  # a create: awaited, the fleet has it when it returns
        assert ids([c for _, c in stats.videos()[0].jobs]) == [new]
        stats.share_videos(shared("other", 1, (1.0, "x1"), (3.0, "x2")))

        sent = len(fleet.sent)
        for _ in range(5):  # progress: one send within the throttle
            sharing.changed(now=False)
        await asyncio.sleep(0.05)
        assert len(fleet.sent) == sent
        await asyncio.sleep(0.3)
        assert len(fleet.sent) == sent + 1
        sharing.changed(now=True)  # a status change: at once
        await asyncio.sleep(0.01)
        assert len(fleet.sent) == sent + 2

        assert await sharing.page(after=None, limit=10, order="asc") == (
            [card("x1"), store.get(new).card(), card("x2")],  # type: ignore[union-attr]
            False,
        )
        page, more = await sharing.page(after="x2", limit=1, order="desc")
        assert ids(page) == [new] and more
        with pytest.raises(KeyError):
            await sharing.page(after="nope", limit=1, order="desc")
        fleet.failing = True  # the fleet unavailable: its own jobs alone, sharing gives up quietly
        assert ids((await sharing.page(after=None, limit=10, order="asc"))[0]) == [new]
        await sharing.shared()
        fleet.failing = False
        await sharing.withdraw()  # being removed: its jobs leave the list
        assert [s.jobs for s in stats.videos() if s.replica == "abc123de"] == [[]]
        sharing.close()

    asyncio.run(go())


def test_a_tag_that_cannot_go_into_ids_leaves_jobs_unpinned() -> None:
    sharing = FleetVideoJobs(VideoJobStore(max_jobs=1, max_bytes=1, ttl=1), None, "no-good_tag")
    new = sharing.new_id()
    assert new.startswith("video_") and len(new) == 26 and owner_of(f"/v1/videos/{new}") is None
