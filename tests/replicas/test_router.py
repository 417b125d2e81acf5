"""The ranking of :class:`~omnirt.realtime.replicas.router.SessionAwareRouter` on replicas with
given reports (Ray Serve's routing loop around it runs in test_replicas.py)."""

from __future__ import annotations

import asyncio
import os
import pickle
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

try:
    from omnirt.realtime.replicas.load import ReplicaLoad
    from omnirt.realtime.replicas.router import OTHER, RequestKind, SessionAwareRouter, request_kind
    from omnirt.realtime.replicas.video_ids import job_id
    from ray.serve._private.common import DeploymentID, RequestMetadata, StreamingHTTPRequest
    from ray.serve.request_router import PendingRequest, ReplicaID
except ImportError as exc:  # pragma: no cover - depends on the install
    if os.environ.get("CI"):
        pytest.fail(f"ray[serve] is not installed ({exc}): CI must run the replica tests", pytrace=False)
    pytest.skip(f"ray[serve] is not installed ({exc}): pip install -e '.[ray]'", allow_module_level=True)


@dataclass
class FakeReplica:
    """What the router reads of Ray Serve's ``RunningReplica``."""

    replica_id: ReplicaID
    routing_stats: dict[str, Any] = field(default_factory=dict)


def rid(name: str) -> ReplicaID:
    """The replica's id as Ray Serve makes it (``name`` is its ``unique_id``, the replica tag)."""
    return ReplicaID(name, deployment_id=DeploymentID("OmnirtReplica", "omnirt"))


def replica(name: str, active: int, capacity: int = 2, queue: int = 0, draining: bool = False) -> FakeReplica:
    load = ReplicaLoad(capacity, active, queue, draining, True, time.time())
    return FakeReplica(rid(name), load.to_stats())


def router() -> SessionAwareRouter:
    r = SessionAwareRouter.__new__(SessionAwareRouter)  # no Ray Serve routing loop needed
    r.initialize_state(session_capacity=2)
    return r


_ids = iter(range(1_000_000))


def request(kind: str, path: str | None = None, root_path: str = "", method: str = "GET") -> PendingRequest:
    if path is None:
        path = "/v1/realtime" if kind == "websocket" else "/v1/chat/completions"
    scope = {"type": kind, "path": path, "root_path": root_path, "method": method}
    arg = pickle.dumps(StreamingHTTPRequest(asgi_scope=scope, proxy_actor_name="proxy"))
    rid = f"req-{next(_ids)}"
    return PendingRequest(
        args=[arg], kwargs={}, metadata=RequestMetadata(request_id=rid, internal_request_id=rid)
    )


@pytest.fixture(autouse=True)
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop of the test's (a PendingRequest holds a future, as in Ray Serve's router)."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield loop
    asyncio.set_event_loop(None)
    loop.close()


def rank(r: SessionAwareRouter, replicas: list[FakeReplica], pending: PendingRequest) -> list[list[str]]:
    groups = asyncio.get_event_loop().run_until_complete(r.choose_replicas(replicas, pending))  # type: ignore[arg-type]
    return [[x.replica_id.unique_id for x in group] for group in groups]


def test_a_session_goes_to_the_most_free_slots_and_skips_full_replicas() -> None:
    r = router()
    fleet = [replica("a", 1, capacity=4), replica("b", 0), replica("c", 2)]  # free: 3, 2, 0
    assert rank(r, fleet, request("websocket")) == [["a"], ["b"]]  # c (full) is not offered
    full = [replica("a", 2), replica("b", 2)]
    assert rank(r, full, request("websocket")) in ([["a"]], [["b"]])  # one answers resource_exhausted


def test_sessions_this_router_opened_count_before_the_next_report() -> None:
    r = router()
    fleet = [replica("a", 0), replica("b", 0)]
    first = request("websocket")
    (chosen,), *_ = rank(r, fleet, first)
    r.on_request_routed(first, rid(chosen), None)
    other = "b" if chosen == "a" else "a"
    assert rank(r, fleet, request("websocket"))[0] == [other]
    # A session of its own that ended after the last report frees the slot at once.
    stale = [replica(chosen, 1), replica(other, 2)]
    r.on_request_completed(rid(chosen), first.metadata.internal_request_id)
    assert rank(r, stale, request("websocket")) == [[chosen]]


def test_other_requests_go_to_the_least_loaded_and_draining_replicas_last() -> None:
    r = router()
    fleet = [replica("a", 0, queue=3), replica("b", 2, queue=1), replica("c", 0, queue=0, draining=True)]
    assert rank(r, fleet, request("http")) == [["b"], ["a"], ["c"]]
    # Requests in flight from this router count as load.
    for _ in range(3):
        pending = request("http")
        r.on_request_routed(pending, rid("b"), None)
    assert rank(r, fleet, request("http"))[0] == ["a"]
    # A draining replica takes no session while another has room.
    assert rank(r, fleet, request("websocket")) == [["a"]]


def test_a_burst_ranked_before_any_is_routed_alternates_between_equal_replicas() -> None:
    """Ray Serve may rank a whole burst before it reports any of it routed: ties go in turn, so
    equally loaded replicas share the burst (and sessions alike) evenly, not by coin flips."""
    r = router()
    fleet = [replica("a", 0), replica("b", 0), replica("c", 0)]
    firsts = [rank(r, fleet, request("http"))[0][0] for _ in range(9)]
    assert sorted(firsts) == ["a"] * 3 + ["b"] * 3 + ["c"] * 3
    sessions = [rank(r, fleet, request("websocket"))[0][0] for _ in range(6)]
    assert sorted(sessions) == ["a", "a", "b", "b", "c", "c"]
    # Load still comes first: the less loaded replica wins every ranking.
    loaded = [replica("a", 0, queue=1), replica("b", 0)]
    assert {rank(r, loaded, request("http"))[0][0] for _ in range(4)} == {"b"}


def test_a_video_jobs_requests_name_its_replica_and_nothing_else_does() -> None:
    video = job_id("k3x9q2ab")
    assert len(video) == 32 and video.startswith("video_k3x9q2ab_")
    for path in (f"/v1/videos/{video}", f"/v1/videos/{video}/content", f"/v1/videos/{video}/"):
        for method in ("GET", "DELETE"):
            assert request_kind(request("http", path, method=method)) == RequestKind(video_owner="k3x9q2ab")
    # Under a route prefix the proxy puts it in root_path, and the path keeps it (ASGI).
    prefixed = request("http", f"/api/v1/videos/{video}/content", root_path="/api")
    assert request_kind(prefixed).video_owner == "k3x9q2ab"
    for path in (
        "/v1/videos",  # create, list: anywhere
        "/v1/videos/video_AbCdEfGhIjKlMnOpQrSt",  # one process's id: names no replica
        f"/v1/videos/{video}/thumbnail",
        f"/other/v1/videos/{video}",
        "/v1/videos/item_k3x9q2ab_x",
    ):
        assert request_kind(request("http", path)) == OTHER, path
    assert request_kind(request("websocket", f"/v1/videos/{video}")) == RequestKind(websocket=True)
    handle_call = PendingRequest(args=[], kwargs={}, metadata=RequestMetadata("x", "x"))
    assert request_kind(handle_call) == OTHER


def test_a_video_jobs_requests_go_only_to_its_replica_and_anywhere_once_it_is_gone() -> None:
    r = router()
    # The owner is the busiest and drains: it still holds the job, so it alone is offered (Ray
    # Serve's loop waits, backing off, while it has no room rather than ask another).
    fleet = [replica("a", 0), replica("owner", 2, queue=9, draining=True), replica("c", 0, queue=1)]
    for path in (f"/v1/videos/{job_id('owner')}", f"/v1/videos/{job_id('owner')}/content"):
        pending = request("http", path)
        assert rank(r, fleet, pending) == [["owner"]]
        assert pending.routing_context.should_backoff
    # Its replica gone: any replica, by load (it answers 404 video_not_found).
    gone = request("http", f"/v1/videos/{job_id('dead')}")
    assert rank(r, fleet, gone) == [["a"], ["c"], ["owner"]]
    # A list or a create is an ordinary request.
    assert rank(r, fleet, request("http", "/v1/videos"))[0] == ["a"]


def test_a_request_that_ends_before_it_is_reported_routed_is_not_counted() -> None:
    """Ray Serve reports a request's end from its result's done-callback and its routing once the
    replica's acceptance is read: for a quick request the end can come first."""
    r = router()
    fleet = [replica("a", 0), replica("b", 0)]
    for kind in ("http", "websocket"):
        quick = request(kind)
        r.on_request_completed(rid("a"), quick.metadata.internal_request_id)
        r.on_request_routed(quick, rid("a"), None)
        assert not r.in_flight and not r.sessions, (r.in_flight, r.sessions)
    # Ended at one replica (rejected there), routed to another: counted there until it ends.
    retried = request("http")
    r.on_request_completed(rid("a"), retried.metadata.internal_request_id)
    r.on_request_routed(retried, rid("b"), None)
    assert rank(r, fleet, request("http")) == [["a"], ["b"]]
    r.on_request_completed(rid("b"), retried.metadata.internal_request_id)
    assert not r.in_flight
