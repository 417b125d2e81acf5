"""``omnirt serve --replicas --ingress haproxy``: the fleet behind Ray Serve's HAProxy, each
replica serving HTTP and WebSockets on its own port, omnirt's routing done in the replicas
(realtime/replicas/ingress.py).

Every test of ``test_replicas.py`` runs again here against this fleet (the same clients, the same
assertions: sessions spread and pinned, chat balanced, a full fleet refusing, fleet health and
metrics, video jobs served by their replica, a killed replica, a drained one, autoscaling), plus
what only this ingress does: a session that reaches a full replica relayed to one with room, and a
video job's request that reaches the other replica forwarded to the job's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

import httpx
import pytest
import websockets
from prometheus_client.parser import text_string_to_metric_families

from tests.realtime.conftest import MAX_FRAME, Client
from tests.replicas import test_replicas as shared
from tests.replicas.haproxy import haproxy_settings
from tests.replicas.test_replicas import (
    HEADER,
    MODEL,
    SLOTS,
    Fleet,
    create_videos,
    run,
    running_fleet,
    session,
    text_turn,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning"),
]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with haproxy_settings() as env, running_fleet(tmp_path_factory, ingress="haproxy", env=env) as f:
        shared.wait_routable(f, 2)  # HAProxy's configuration may lag the replicas' start
        yield f


# The shared tests, collected again in this module (pytest collects in assignment order): each
# takes this module's ``fleet``. Those that change the fleet come last, as in test_replicas.py.
test_sessions_spread_over_both_replicas_and_each_stays_on_its_own = (
    shared.test_sessions_spread_over_both_replicas_and_each_stays_on_its_own
)
test_chat_requests_are_balanced = shared.test_chat_requests_are_balanced
test_a_full_replica_is_skipped_and_only_an_all_full_fleet_refuses = (
    shared.test_a_full_replica_is_skipped_and_only_an_all_full_fleet_refuses
)
test_health_and_metrics_cover_every_replica = shared.test_health_and_metrics_cover_every_replica
test_video_jobs_are_served_by_their_replica_and_listed_by_every_replica = (
    shared.test_video_jobs_are_served_by_their_replica_and_listed_by_every_replica
)


def addresses(fleet: Fleet) -> dict[str, str]:
    """Replica id -> where it serves HTTP itself, from the fleet's /health."""
    return {r["replica"]: r["address"] for r in fleet.health()["replicas"] if "address" in r}


def wait_handoffs(fleet: Fleet, kind: str, at_least: float, replica: str | None = None) -> None:
    """Until the fleet's /metrics (each replica's part as of its last report) shows ``at_least``
    handoffs of ``kind`` by ``replica`` (None: by all together)."""
    deadline = time.monotonic() + 10
    while True:
        counts = handoffs(fleet, kind)
        got = sum(counts.values()) if replica is None else counts.get(replica, 0.0)
        if got >= at_least:
            return
        assert time.monotonic() < deadline, (kind, replica, counts, at_least)
        time.sleep(0.2)


def handoffs(fleet: Fleet, kind: str) -> dict[str, float]:
    """Replica id -> requests of ``kind`` it handed to another (the fleet's /metrics)."""
    text = httpx.get(fleet.base_url + "/metrics", timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return {
        s.labels["replica"]: s.value
        for s in families["omnirt_replica_handoffs"].samples
        if s.name.endswith("_total") and s.labels["kind"] == kind
    }


def test_every_replica_serves_http_itself_behind_haproxy(fleet: Fleet) -> None:
    fleet.wait_for(lambda r: len(addresses(fleet)) == 2, what="both replicas' addresses")
    for replica, address in addresses(fleet).items():
        got = httpx.get(f"http://{address}/v1/models", timeout=10)
        assert got.status_code == 200 and got.headers[HEADER] == replica
    # Through HAProxy, requests reach both (leastconn: in turn when idle).
    served = {httpx.get(fleet.base_url + "/v1/models", timeout=10).headers[HEADER] for _ in range(6)}
    assert served == set(addresses(fleet))


def test_a_session_reaching_a_full_replica_is_relayed_to_one_with_room(fleet: Fleet) -> None:
    fleet.wait_for(lambda r: len(addresses(fleet)) == 2 and sum(r.values()) == 0, what="an idle fleet")
    where = addresses(fleet)
    full, roomy = sorted(where)
    before = handoffs(fleet, "session").get(full, 0.0)

    async def go() -> None:
        async with contextlib.AsyncExitStack() as stack:
            # `full`'s slots taken by sessions HAProxy does not see (straight to its own port) ...
            for _ in range(SLOTS):
                direct = await stack.enter_async_context(
                    websockets.connect(f"ws://{where[full]}/v1/realtime?model={MODEL}", max_size=MAX_FRAME)
                )
                assert direct.response.headers[HEADER] == full
                assert (await Client(direct).recv(timeout=30))["type"] == "session.created"
            fleet.wait_for(lambda r: r == {full: SLOTS, roomy: 0}, timeout=10, what="one replica full")
            # ... so HAProxy, balancing its own connections, sends one of the next two there: both
            # end up on the other replica, and each works.
            relayed = [await stack.enter_async_context(session(fleet)) for _ in range(SLOTS)]
            assert [at for _, at in relayed] == [roomy] * SLOTS, relayed
            await asyncio.gather(*(text_turn(client) for client, _ in relayed))
            fleet.wait_for(lambda r: r == {full: SLOTS, roomy: SLOTS}, timeout=10, what="both full")
            await shared.refused_as_full(fleet)  # whichever replica HAProxy picks

    run(go())
    wait_handoffs(fleet, "session", before + 1, full)
    fleet.wait_for(lambda r: len(r) == 2 and sum(r.values()) == 0, what="sessions closed")


def test_a_video_jobs_requests_reaching_the_other_replica_are_forwarded(fleet: Fleet) -> None:
    async def go() -> None:
        async with httpx.AsyncClient(base_url=fleet.base_url, timeout=60) as http:
            _, owners = await create_videos(http, fleet, each=1)
            where = addresses(fleet)
            for video_id, owner in owners.items():
                other = next(r for r in where if r != owner)
                # Straight to the replica that does not hold the job: it forwards to the one that does.
                got = await http.get(f"http://{where[other]}/v1/videos/{video_id}")
                assert got.status_code == 200 and got.json()["id"] == video_id, got.text
                assert got.headers[HEADER] == owner
                assert (await http.delete(f"http://{where[other]}/v1/videos/{video_id}")).status_code == 200
                gone = await http.get(f"http://{where[other]}/v1/videos/{video_id}")
                assert gone.status_code == 404 and gone.headers[HEADER] == owner

    time.sleep(2 * fleet.options.stats_seconds)  # the earlier tests' handoffs reported
    before = sum(handoffs(fleet, "video").values())
    run(go())
    wait_handoffs(fleet, "video", before + 6)


def test_an_engine_request_reaching_a_busy_replica_goes_to_an_idle_one(fleet: Fleet) -> None:
    """HAProxy balances connections, not engine work: a chat request that reaches a replica whose
    engine is busy (a long video job) is forwarded to the idle one."""
    where = addresses(fleet)
    busy, idle = sorted(where)
    long_job = {**shared.VIDEO_JOB, "size": "128x128", "num_frames": 33, "num_inference_steps": 50}

    async def go() -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            created = await http.post(f"http://{where[busy]}/v1/videos", json=long_job)
            assert created.status_code == 200 and created.headers[HEADER] == busy, created.text
            job = created.json()["id"]
            try:
                while (await http.get(f"http://{where[busy]}/v1/videos/{job}")).json()["status"] == "queued":
                    await asyncio.sleep(0.05)
                chat = await http.post(
                    f"http://{where[busy]}/v1/chat/completions",
                    json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                )
                assert chat.status_code == 200, chat.text
                status = (await http.get(f"http://{where[busy]}/v1/videos/{job}")).json()["status"]
                assert status == "in_progress", "the job ended before the chat: make it longer"
                assert chat.headers[HEADER] == idle
                assert chat.json()["choices"][0]["message"]["content"] is not None
            finally:
                await http.delete(f"http://{where[busy]}/v1/videos/{job}")

    time.sleep(2 * fleet.options.stats_seconds)
    before = handoffs(fleet, "engine").get(busy, 0.0)
    run(go())
    wait_handoffs(fleet, "engine", before + 1, busy)


test_a_killed_replica_closes_only_its_sessions_and_clients_reconnect = (
    shared.test_a_killed_replica_closes_only_its_sessions_and_clients_reconnect
)
test_a_removed_replica_drains_its_sessions = shared.test_a_removed_replica_drains_its_sessions
test_ray_serve_autoscales_on_the_sessions = shared.test_ray_serve_autoscales_on_the_sessions
