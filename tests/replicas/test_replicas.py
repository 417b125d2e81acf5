"""``omnirt serve --replicas``: a local Ray instance, Ray Serve's HTTP proxy on loopback and two
replicas of the embedded models (speech with two session slots, image and video: random weights)
on CPU, driven by real clients: raw WebSockets whose every frame is validated against the openai
SDK's models (tests/realtime/conftest.py) and the SDK's HTTP client.

Where a request went: every response and WebSocket accept carries ``x-omnirt-replica``; the
fleet's ``/health`` lists each replica's own session count.

The ``ray`` extra is needed (``pip install -e '.[ray]'``, which install.sh runs); without it
the module skips locally and fails under CI (``CI`` set).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import itertools
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import av
import httpx
import pytest
import websockets
from omnirt.realtime.config import ServerConfig
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.realtime.conftest import MANUAL_TURNS, MAX_FRAME, Client, text_item
from tests.server import free_port

try:
    import ray
    from omnirt.realtime.replicas import ReplicaOptions, deploy
    from omnirt.realtime.replicas.ingress import HAPROXY_ENV
    from omnirt.realtime.replicas.launch import REPLICA_DEPLOYMENT, SERVE_ENV, set_serve_env
    from ray import serve
except ImportError as exc:  # pragma: no cover - depends on the install
    if os.environ.get("CI"):
        pytest.fail(f"ray[serve] is not installed ({exc}): CI must run the replica tests", pytrace=False)
    pytest.skip(f"ray[serve] is not installed ({exc}): pip install -e '.[ray]'", allow_module_level=True)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning"),  # the SDK's videos notice
]

MODEL = "demo-qwen3-omni"
HEADER = "x-omnirt-replica"
SLOTS = 2
DRAIN_SECONDS = 3.0
#: A tiny video job of the embedded video model (tiny Wan): 5 frames of 64x64, 2 steps.
VIDEO_JOB = {"prompt": "waves", "size": "64x64", "num_frames": 5, "num_inference_steps": 2, "seed": 1}


@dataclass
class Fleet:
    base_url: str
    config: ServerConfig
    options: ReplicaOptions

    @property
    def ws_url(self) -> str:
        return self.base_url.replace("http://", "ws://") + "/v1/realtime?model=" + MODEL

    def health(self) -> dict[str, Any]:
        return httpx.get(self.base_url + "/health", timeout=10).json()

    def creation_urls(self) -> list[str]:
        """Where to create a video job: through the ingress, or (HAProxy) each replica's own port."""
        if self.options.ingress != "haproxy":
            return ["/v1/videos"]
        addresses = [r["address"] for r in self.health()["replicas"]]
        return [f"http://{address}/v1/videos" for address in addresses]

    def replicas(self) -> dict[str, int]:
        """Replica id -> its open sessions, as the fleet's /health reports them."""
        return {r["replica"]: r["sessions_active"] for r in self.health()["replicas"]}

    def wait_for(self, predicate: Any, timeout: float = 60.0, what: str = "") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                if predicate(self.replicas()):
                    return
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what or predicate}: {self.health()}")


@contextlib.contextmanager
def running_fleet(
    tmp_path_factory: pytest.TempPathFactory, ingress: str = "proxy", env: dict[str, str] | None = None
) -> Iterator[Fleet]:
    """A local Ray instance and the fleet on it (``env``: more of Ray's environment)."""
    # Ray's processes inherit this process's environment: the replicas build the embedded model
    # into a cache of the module's own, and import omnirt as this process does (PYTHONPATH).
    mp = pytest.MonkeyPatch()
    mp.setenv("OMNIRT_CACHE", str(tmp_path_factory.mktemp("cache")))
    mp.setenv("RAY_USAGE_STATS_ENABLED", "0")
    for name, value in (env or {}).items():
        mp.setenv(name, value)
    saved = {name for name in SERVE_ENV.keys() | HAPROXY_ENV.keys() if name in os.environ}
    set_serve_env(ingress=ingress)  # Ray Serve's settings, as `omnirt serve --replicas` sets them
    ray.init(
        num_cpus=4,  # CPU slots for the replicas (the machine's 2 cores are shared)
        object_store_memory=100 * 1024 * 1024,
        include_dashboard=False,
        log_to_driver=False,
    )
    config = ServerConfig(
        port=free_port(),
        models=["demo"],
        duplex_model="none",
        max_sessions=SLOTS,
        vad_preload=False,
        max_output_tokens=8,
        shutdown_grace_seconds=2.0,
    )
    options = ReplicaOptions(
        replicas=2,
        cpus_per_replica=1,
        drain_seconds=DRAIN_SECONDS,
        stats_seconds=0.5,
        stale_seconds=2.0,
        ingress=ingress,
    )
    try:
        base = deploy(config, options, device="cpu")
        f = Fleet(base, config, options)
        f.wait_for(lambda r: len(r) == 2, what="both replicas reporting")
        yield f
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        mp.undo()
        for name in SERVE_ENV.keys() | HAPROXY_ENV.keys():  # set_serve_env's, where it set them
            if name not in (env or {}) and name not in saved:
                os.environ.pop(name, None)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with running_fleet(tmp_path_factory) as f:
        yield f


@contextlib.asynccontextmanager
async def session(fleet: Fleet) -> AsyncIterator[tuple[Client, str]]:
    """A realtime session with manual turns, and the replica serving it."""
    async with websockets.connect(fleet.ws_url, max_size=MAX_FRAME, open_timeout=30) as ws:
        client = Client(ws)
        created = await client.recv(timeout=30)
        assert created["type"] == "session.created", created
        await client.send(MANUAL_TURNS)
        assert (await client.recv(timeout=30))["type"] == "session.updated"
        yield client, ws.response.headers[HEADER]


async def text_turn(client: Client, text: str = "hello") -> list[dict[str, Any]]:
    await client.send({"type": "conversation.item.create", "item": text_item(text)})
    await client.send(
        {"type": "response.create", "response": {"output_modalities": ["text"], "max_output_tokens": 4}}
    )
    events = await client.until("response.done", timeout=60)
    # Random weights: the reply may stop at max_output_tokens (incomplete), never fail.
    assert events[-1]["response"]["status"] in ("completed", "incomplete"), events[-1]
    return events


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_sessions_spread_over_both_replicas_and_each_stays_on_its_own(fleet: Fleet) -> None:
    async def go() -> None:
        async with session(fleet) as (a, at_a), session(fleet) as (b, at_b):
            assert at_a != at_b, "the second session should go to the replica with more free slots"
            fleet.wait_for(lambda r: r == {at_a: 1, at_b: 1}, timeout=10, what="one session on each")
            for _ in range(2):  # several turns each: every event over its one connection
                await asyncio.gather(text_turn(a), text_turn(b))
            # Each replica still counts exactly its own session: nothing moved. (/health reads the
            # replicas' last reports, sent every ``stats_seconds``: a loaded machine may show one a
            # report late, so this waits for them as the first check did.)
            fleet.wait_for(lambda r: r == {at_a: 1, at_b: 1}, timeout=10, what="each still its own session")

    run(go())
    fleet.wait_for(lambda r: len(r) == 2 and sum(r.values()) == 0, what="sessions closed")


def test_chat_requests_are_balanced(fleet: Fleet) -> None:
    # The burst's requests are ranked before any is reported routed, on the replicas' last load
    # reports: start once those show idle engines (a session that just closed may still hold a
    # speech request for a moment; a report of 1 would send the whole burst to the other replica).
    deadline = time.monotonic() + 30
    while any(r["engine_queue_depth"] for r in fleet.health()["replicas"]):
        assert time.monotonic() < deadline, fleet.health()
        time.sleep(0.1)
    time.sleep(2 * fleet.options.stats_seconds)

    async def go() -> list[str]:
        async with httpx.AsyncClient(base_url=fleet.base_url, timeout=60) as http:
            client = AsyncOpenAI(
                api_key="k", base_url=fleet.base_url + "/v1", http_client=http, max_retries=0
            )

            async def one(i: int) -> str:
                raw = await client.chat.completions.with_raw_response.create(
                    model=MODEL, messages=[{"role": "user", "content": f"hi {i}"}], max_tokens=16
                )
                assert raw.parse().choices[0].message.content is not None
                return raw.headers[HEADER]

            return await asyncio.gather(*(one(i) for i in range(8)))

    served = run(go())
    counts = {r: served.count(r) for r in set(served)}
    assert len(counts) == 2 and min(counts.values()) >= 2, (counts, fleet.health())


async def refused_as_full(fleet: Fleet) -> None:
    """A new session on a fleet whose replicas are all full: ``resource_exhausted``, close 1013."""
    async with websockets.connect(fleet.ws_url, max_size=MAX_FRAME, open_timeout=30) as ws:
        refused = Client(ws)
        error = await refused.error()
        assert error["code"] == "resource_exhausted", error
        assert await refused.closed() == 1013


def test_a_full_replica_is_skipped_and_only_an_all_full_fleet_refuses(fleet: Fleet) -> None:
    async def go() -> None:
        async with contextlib.AsyncExitStack() as stack:
            where = [(await stack.enter_async_context(session(fleet)))[1] for _ in range(2 * SLOTS)]
            assert sorted(where.count(r) for r in set(where)) == [SLOTS, SLOTS], where
            await refused_as_full(fleet)

    run(go())
    fleet.wait_for(lambda r: len(r) == 2 and sum(r.values()) == 0, what="sessions closed")


def test_health_and_metrics_cover_every_replica(fleet: Fleet) -> None:
    async def go() -> None:
        async with session(fleet) as (_, at):
            # Reports are up to stats_seconds old (the replica answering has its own fresh): wait
            # until each replica's report shows this session.
            fleet.wait_for(lambda r: r.get(at) == 1 and len(r) == 2, what="one session")
            time.sleep(2 * fleet.options.stats_seconds)
            health = fleet.health()
            assert health["status"] == "ok" and health["model"] == MODEL and health["random_weights"] is True
            assert len(health["replicas"]) == 2 and health["sessions_active"] == 1, health
            assert health["free_session_slots"] == 2 * SLOTS - 1
            text = httpx.get(fleet.base_url + "/metrics", timeout=10).text
            families = {f.name: f for f in text_string_to_metric_families(text)}
            assert families["omnirt_replicas"].samples[0].value == 2
            sessions = {
                s.labels["replica"]: s.value for s in families["omnirt_realtime_sessions_active"].samples
            }
            assert sessions[at] == 1 and sorted(sessions.values()) == [0, 1], sessions
            steps = families["omnirt_engine_steps"].samples
            assert {s.labels["replica"] for s in steps} == set(sessions)

    run(go())


async def listed(http: httpx.AsyncClient, **params: Any) -> tuple[list[dict[str, Any]], str]:
    """``GET /v1/videos``: the cards and the replica that answered."""
    response = await http.get("/v1/videos", params={"limit": 100, **params})
    assert response.status_code == 200, response.text
    return response.json()["data"], response.headers[HEADER]


async def list_from_each_replica(http: httpx.AsyncClient, replicas: int = 2) -> list[list[dict[str, Any]]]:
    """Lists until each replica has answered one (a list goes to the least-loaded replica, ties at
    random; a replica busier for a while, finishing a job on a loaded machine, gets none until its
    load report says otherwise: so the lists go on for up to 30 s); every list answered, in order."""
    answers, by = [], set()
    deadline = time.monotonic() + 30
    while True:
        cards, at = await listed(http)
        answers.append(cards)
        by.add(at)
        if len(by) == replicas:
            return answers
        if time.monotonic() > deadline:
            raise AssertionError(f"lists reached only {by} in {len(answers)} lists")
        await asyncio.sleep(0.05)


async def create_videos(
    http: httpx.AsyncClient, fleet: Fleet, each: int, fleet_stats_seconds: float = 0.5
) -> tuple[list[str], dict[str, str]]:
    """Video jobs created one after another until each replica holds ``each`` (a job in a replica's
    engine makes it the more loaded): their ids in creation order, and who holds each.

    Behind HAProxy the jobs are created on each replica in turn, straight on its own port: HAProxy
    keeps sending requests to one replica while all are idle (its ``leastconn`` ties), and these
    tiny jobs end before any load report shows them (test_replicas_haproxy.py tests how a busy
    replica hands engine requests on)."""
    targets = itertools.cycle(fleet.creation_urls())
    order: list[str] = []
    owners: dict[str, str] = {}
    deadline = time.monotonic() + 30  # a loaded machine may delay the replicas' load reports
    while len(order) < 16 * each and time.monotonic() < deadline:
        if order and Counter(owners.values())[owners[order[-1]]] > each:
            # A replica's queue shows in its next load report; these jobs may end before it. Then
            # the replicas tie, and Ray Serve's router breaks ties in turn, each request it ranks
            # taking one: with this loop's two requests a job (the create, the list) every create
            # would get the same turn. One more request moves the turn on.
            await asyncio.sleep(fleet_stats_seconds)
            await http.get("/v1/models")
        created = await http.post(next(targets), json=VIDEO_JOB)
        assert created.status_code == 200, created.text
        job = created.json()
        assert job["status"] in ("queued", "in_progress") and job["object"] == "video", job
        order.append(job["id"])
        owners[job["id"]] = created.headers[HEADER]
        # The create answered once the fleet had the job: a list right after it, on any replica, shows it.
        assert [c["id"] for c in (await listed(http))[0]][0] == job["id"]
        counts = Counter(owners.values())
        if len(counts) == 2 and min(counts.values()) >= each:
            return order, owners
    raise AssertionError(f"video jobs did not land on both replicas: {owners}")


def video_frames(mp4: bytes) -> list[Any]:
    with av.open(io.BytesIO(mp4)) as container:
        assert container.streams.video[0].codec_context.name == "h264"
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


def test_video_jobs_are_served_by_their_replica_and_listed_by_every_replica(fleet: Fleet) -> None:
    async def go() -> None:
        async with httpx.AsyncClient(base_url=fleet.base_url, timeout=60) as http:
            client = AsyncOpenAI(
                api_key="k", base_url=fleet.base_url + "/v1", http_client=http, max_retries=0
            )
            order, owners = await create_videos(http, fleet, each=2)
            # A job's own requests reach the replica that holds it, every time.
            for video_id, owner in owners.items():
                for _ in range(4):
                    got = await http.get(f"/v1/videos/{video_id}")
                    assert got.status_code == 200 and got.json()["id"] == video_id, got.text
                    assert got.headers[HEADER] == owner
            for video_id, owner in owners.items():
                done = await client.videos.poll(video_id, poll_interval_ms=200)
                assert (done.status, done.progress, done.size) == ("completed", 100, "64x64"), done
                raw = await client.videos.with_raw_response.download_content(video_id)
                assert raw.headers[HEADER] == owner and raw.headers["content-type"] == "video/mp4"
                pictures = video_frames(raw.content)
                assert len(pictures) == 5 and pictures[0].shape == (64, 64, 3)
            # The list, whichever replica answers: every job, newest first, as the jobs are now
            # (a card may lag its job by the sharing throttle: wait for that).
            deadline = time.monotonic() + 10
            while True:
                answers = await list_from_each_replica(http)
                if all(c["status"] == "completed" for cards in answers for c in cards):
                    break
                assert time.monotonic() < deadline, answers
                await asyncio.sleep(0.2)
            for cards in answers:
                assert [c["id"] for c in cards] == order[::-1]
            # Paged through the SDK (each page may come from another replica), both orders.
            assert [v.id async for v in client.videos.list(limit=2, order="asc")] == order
            assert [v.id async for v in client.videos.list(limit=3)] == order[::-1]
            page = await http.get("/v1/videos", params={"limit": 2, "after": order[-1]})
            body = page.json()
            assert [c["id"] for c in body["data"]] == order[-3:-1][::-1] and body["has_more"] is True
            # Deleted: the request reaches the job's replica; the job is gone there and from the list.
            for video_id in (order[0], next(v for v in order if owners[v] != owners[order[0]])):
                deleted = await http.delete(f"/v1/videos/{video_id}")
                assert deleted.status_code == 200 and deleted.json()["deleted"] is True
                assert deleted.headers[HEADER] == owners[video_id]
                gone = await http.get(f"/v1/videos/{video_id}")
                assert gone.status_code == 404 and gone.json()["error"]["code"] == "video_not_found"
                assert gone.headers[HEADER] == owners[video_id]
                order.remove(video_id)
                for cards in await list_from_each_replica(http):
                    assert [c["id"] for c in cards] == order[::-1]
            for video_id in order:  # leave the fleet as it was
                assert (await http.delete(f"/v1/videos/{video_id}")).status_code == 200

    run(go())


def wait_routable(fleet: Fleet, replicas: int, timeout: float = 30.0) -> None:
    """Until Ray Serve runs ``replicas`` replicas and the proxy routes requests to each."""
    deadline = time.monotonic() + timeout
    seen: set[str] = set()
    while time.monotonic() < deadline:
        states = serve.status().applications["omnirt"].deployments[REPLICA_DEPLOYMENT].replica_states
        if states.get("RUNNING") == replicas:
            seen.add(httpx.get(fleet.base_url + "/v1/models", timeout=10).headers[HEADER])
            if len(seen) == replicas:
                return
        time.sleep(0.1)
    raise AssertionError(f"{replicas} replicas not routable: {seen}, {serve.status()}")


def _replica_actor(replica_id: str) -> Any:
    from ray.serve._private.constants import SERVE_NAMESPACE

    name = f"SERVE_REPLICA::{fleet_app(replica_id)}"
    return ray.get_actor(name, namespace=SERVE_NAMESPACE)


def fleet_app(replica_id: str) -> str:
    return f"omnirt#{REPLICA_DEPLOYMENT}#{replica_id}"


def test_a_killed_replica_closes_only_its_sessions_and_clients_reconnect(fleet: Fleet) -> None:
    """Its realtime sessions close (their clients reconnect to the other replica), and its video
    jobs die with it: 404 ``video_not_found`` and gone from the list; the other's stay."""

    async def go() -> str:
        async with (
            session(fleet) as (doomed, victim),
            session(fleet) as (survivor, other),
            httpx.AsyncClient(base_url=fleet.base_url, timeout=60) as http,
        ):
            assert victim != other
            _, owners = await create_videos(http, fleet, each=1)
            ray.kill(_replica_actor(victim), no_restart=True)
            with pytest.raises(websockets.ConnectionClosed):
                while True:
                    await doomed.recv(timeout=30)
            await text_turn(survivor)  # the other replica's session goes on
            # The client of the killed replica reconnects: to the other one, and completes a turn.
            deadline = time.monotonic() + 30
            while True:
                try:
                    async with session(fleet) as (again, at):
                        assert at == other
                        await text_turn(again)
                        break
                except (OSError, websockets.WebSocketException, TimeoutError, AssertionError):
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.5)
            kept = [v for v, at in owners.items() if at == other]
            lost = [v for v, at in owners.items() if at == victim]
            deadline = time.monotonic() + 30
            while True:  # until the proxy has seen the replica go and the fleet has dropped it
                answers = await list_from_each_replica(http, replicas=1)
                if [c["id"] for c in answers[-1]] == kept[::-1]:
                    break
                assert time.monotonic() < deadline, (answers[-1], owners)
                await asyncio.sleep(0.5)
            for video_id in lost:  # another replica answers (the proxy may need a moment to see it gone)
                while (gone := await http.get(f"/v1/videos/{video_id}")).status_code >= 500:
                    assert time.monotonic() < deadline, gone.text
                    await asyncio.sleep(0.5)
                assert gone.status_code == 404 and gone.json()["error"]["code"] == "video_not_found"
                assert gone.headers[HEADER] != victim
            for video_id in kept:
                assert (await http.get(f"/v1/videos/{video_id}")).headers[HEADER] == other
                assert (await http.delete(f"/v1/videos/{video_id}")).status_code == 200
        return victim

    victim = run(go())
    # Ray Serve replaces the killed replica.
    fleet.wait_for(
        lambda r: len(r) == 2 and victim not in r and sum(r.values()) == 0, timeout=120, what="a new replica"
    )
    wait_routable(fleet, 2)


def test_a_removed_replica_drains_its_sessions(fleet: Fleet) -> None:
    """Scaled from 2 to 1: the replica removed admits no new session and closes its live one with
    1001 once the drain period is over; the other's session goes on. Its video jobs leave the list
    as it starts draining (no request reaches it any more), before that close."""

    async def go() -> None:
        async with (
            session(fleet) as (a, at_a),
            session(fleet) as (b, at_b),
            httpx.AsyncClient(base_url=fleet.base_url, timeout=60) as http,
        ):
            assert at_a != at_b
            order, owners = await create_videos(http, fleet, each=1)
            jobs_of = {at: [v for v in order if owners[v] == at] for at in (at_a, at_b)}
            one = dataclasses.replace(fleet.options, replicas=1)
            from omnirt.realtime.replicas.launch import application

            t0 = time.monotonic()
            app = application(fleet.config, one, device="cpu", load_format="auto")
            # serve.run returns once the removed replica is gone: in a thread, the sessions watched meanwhile.
            scaled = asyncio.create_task(
                asyncio.to_thread(serve.run, app, name="omnirt", route_prefix="/", blocking=False)
            )
            closed = {}

            async def watch(client: Client, at: str) -> None:
                with contextlib.suppress(websockets.ConnectionClosed, TimeoutError):
                    while True:
                        await client.recv(timeout=DRAIN_SECONDS + 15)
                closed[at] = (client.ws.close_code, client.ws.close_reason, time.monotonic() - t0)

            seen: list[tuple[str, float]] = []  # (replica, when) of each list of its jobs alone

            async def one_replicas_jobs_left() -> None:
                # Counted only from a list that replica answered itself: one answered by the other,
                # right after the redeploy, may lack its jobs for a report period (the fleet's
                # view of a replica is its last report), which says nothing of the drain. Right
                # after the redeploy the removed one may still answer such a list of its own jobs
                # (the same stale view): every one is kept, and the survivor's is looked for.
                while True:
                    cards, by = await listed(http, order="asc")
                    ids = [c["id"] for c in cards]
                    for at, jobs in jobs_of.items():
                        if ids == jobs and by == at:
                            seen.append((at, time.monotonic() - t0))
                    await asyncio.sleep(0.1)

            listing = asyncio.create_task(one_replicas_jobs_left())
            tasks = [asyncio.create_task(watch(a, at_a)), asyncio.create_task(watch(b, at_b))]
            _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            assert len(closed) == 1, closed
            ((gone, (code, reason, after)),) = closed.items()
            assert code == 1001 and reason == "server draining", closed
            assert after >= DRAIN_SECONDS, closed
            kept = b if gone == at_a else a
            await text_turn(kept)
            listing.cancel()
            await asyncio.gather(listing, return_exceptions=True)
            survivor = at_b if gone == at_a else at_a
            when = min((t for at, t in seen if at == survivor), default=None)
            # the removed replica's video jobs left the list before it closed its session
            assert when is not None and when < after, (survivor, gone, seen, after)
            for video_id in jobs_of[gone]:
                lost = await http.get(f"/v1/videos/{video_id}")
                assert lost.status_code == 404 and lost.headers[HEADER] == survivor, lost.text
            await scaled

    run(go())
    fleet.wait_for(lambda r: len(r) == 1, what="the removed replica gone")


def test_ray_serve_autoscales_on_the_sessions(fleet: Fleet) -> None:
    """Autoscaling between 1 and 2 replicas, the target from the session slots (1.5 ongoing
    requests a replica): two sessions on the one replica bring a second, which takes the next
    session (it has the free slots); once they end the fleet shrinks back to one."""
    from omnirt.realtime.replicas.launch import application

    wait_routable(fleet, 1)
    scaled = dataclasses.replace(
        fleet.options,
        replicas=1,
        min_replicas=1,
        max_replicas=2,
        autoscaling_overrides={
            "upscale_delay_s": 0.5,
            "downscale_delay_s": 2.0,
            "look_back_period_s": 1.0,
            "metrics_interval_s": 0.25,
        },
    )
    app = application(fleet.config, scaled, device="cpu", load_format="auto")
    serve.run(app, name="omnirt", route_prefix="/", blocking=False)

    async def go() -> None:
        async with session(fleet) as (a, first), session(fleet) as (b, second):
            assert first == second  # one replica so far
            await asyncio.to_thread(wait_routable, fleet, 2, 90.0)
            async with session(fleet) as (c, third):
                assert third != first, "the new replica has the free slots"
                await text_turn(c)

    run(go())
    fleet.wait_for(lambda r: len(r) == 1, timeout=60, what="the fleet back to one replica")
