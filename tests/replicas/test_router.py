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
    from omnirt.realtime.replicas.router import SessionAwareRouter
    from ray.serve._private.common import RequestMetadata, StreamingHTTPRequest
    from ray.serve.request_router import PendingRequest
except ImportError as exc:  # pragma: no cover - depends on the install
    if os.environ.get("CI"):
        pytest.fail(f"ray[serve] is not installed ({exc}): CI must run the replica tests", pytrace=False)
    pytest.skip(f"ray[serve] is not installed ({exc}): pip install -e '.[ray]'", allow_module_level=True)


@dataclass
class FakeReplica:
    """What the router reads of Ray Serve's ``RunningReplica``."""

    replica_id: str
    routing_stats: dict[str, Any] = field(default_factory=dict)


def replica(name: str, active: int, capacity: int = 2, queue: int = 0, draining: bool = False) -> FakeReplica:
    load = ReplicaLoad(capacity, active, queue, draining, True, time.time())
    return FakeReplica(name, load.to_stats())


def router() -> SessionAwareRouter:
    r = SessionAwareRouter.__new__(SessionAwareRouter)  # no Ray Serve routing loop needed
    r.initialize_state(session_capacity=2)
    return r


_ids = iter(range(1_000_000))


def request(kind: str) -> PendingRequest:
    scope = {"type": kind, "path": "/v1/realtime" if kind == "websocket" else "/v1/chat/completions"}
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
    return [[x.replica_id for x in group] for group in groups]


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
    r.on_request_routed(first, chosen, None)
    other = "b" if chosen == "a" else "a"
    assert rank(r, fleet, request("websocket"))[0] == [other]
    # A session of its own that ended after the last report frees the slot at once.
    stale = [replica(chosen, 1), replica(other, 2)]
    r.on_request_completed(chosen, first.metadata.internal_request_id)
    assert rank(r, stale, request("websocket")) == [[chosen]]


def test_other_requests_go_to_the_least_loaded_and_draining_replicas_last() -> None:
    r = router()
    fleet = [replica("a", 0, queue=3), replica("b", 2, queue=1), replica("c", 0, queue=0, draining=True)]
    assert rank(r, fleet, request("http")) == [["b"], ["a"], ["c"]]
    # Requests in flight from this router count as load.
    for _ in range(3):
        pending = request("http")
        r.on_request_routed(pending, "b", None)
    assert rank(r, fleet, request("http"))[0] == ["a"]
    # A draining replica takes no session while another has room.
    assert rank(r, fleet, request("websocket")) == [["a"]]
