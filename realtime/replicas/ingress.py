"""omnirt's routing inside the replicas when HAProxy is the fleet's ingress (``--ingress haproxy``).

With the default ingress, Ray Serve's Python HTTP proxy carries every request and WebSocket frame
to a replica, ranked by :class:`~.router.SessionAwareRouter`; the hop costs about 0.6 to 1 ms per
realtime event and about 2 ms of CPU per round trip (``docs/benchmarks.md``). Ray Serve 2.60 can
put HAProxy in front instead (``RAY_SERVE_ENABLE_HA_PROXY=1`` with direct ingress, :data:`HAPROXY_ENV`):
each replica serves HTTP and WebSockets on a port of its own and HAProxy forwards each client
connection there, so an event crosses no Python on its way. But HAProxy balances by its own
algorithm (``leastconn``: the replica with the fewest open connections; Ray Serve refuses a custom
request router on the ingress deployment with it), so omnirt routes where a request lands
(:class:`FleetIngress`, the replica's outermost middleware):

- a realtime session (a WebSocket on ``/v1/realtime``) is served by the replica HAProxy picked,
  which with the same ``--max-sessions`` on every replica is the one with the most free slots,
  unless that replica has no free slot or drains: then it relays the session
  (:class:`~.relay.WebSocketRelay`) to the replica with the most free slots in the fleet's
  reports (:class:`Peers`, refreshed every report period), and serves it itself (a
  ``resource_exhausted`` refusal) only when none has room;
- a request on a video job that another replica holds (its id names it: :mod:`.video_ids`) is
  forwarded to that replica (:func:`~.relay.forward_http`); a job whose replica is gone gets
  this replica's 404;
- a request that puts work on the engine (chat, images, a new video) is served where it lands
  unless another replica's engine queue is shorter (HAProxy counts connections, not engine work,
  and keeps a client's keep-alive connection on one replica): then it is forwarded there;
- everything else is served where it lands.

A relayed session's frames cross this replica's Python (as through Ray Serve's proxy, without its
actor calls); HAProxy still counts the connection here, so it sends new sessions elsewhere until
this replica's own sessions end. What one replica hands to another is marked
(:data:`~.relay.FORWARDED_HEADER`) and served there, never handed on again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import replace
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from .fleet import ReplicaReport
from .relay import PeerUnreachable, WebSocketRelay, forward_http, forwarded, replaying, request_body
from .video_ids import owner_of, route_path

log = logging.getLogger(__name__)

#: The fleet's ingress: Ray Serve's HTTP proxy (with omnirt's request router), or HAProxy.
INGRESSES = ("proxy", "haproxy")
#: Ray Serve's settings for HAProxy in front of replicas that serve HTTP themselves. They must be
#: in the environment of Ray Serve's controller (a Ray instance this process starts inherits them;
#: a cluster's ``ray start`` must have them) and of the replicas. Ray holds a removed replica
#: reachable this long (default 30 s) so that load balancers deregister it; HAProxy is
#: reconfigured by Ray Serve itself within a fraction of a second, so a few seconds do for that.
#: The replicas get a longer one (``launch.min_draining_seconds``): past it Ray shuts their HTTP
#: server down, which closes the WebSockets of sessions still draining.
HAPROXY_ENV = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "5",
}
REALTIME_PATH = "/v1/realtime"
#: ``POST`` on these puts work on the engine: to the replica with the shortest engine queue.
ENGINE_PATHS = frozenset({"/v1/chat/completions", "/v1/images/generations", "/v1/videos"})
#: Seconds a forwarded HTTP request may take (a video's content streams within it).
FORWARD_TIMEOUT_SECONDS = 300.0


class Peers:
    """The other replicas as the fleet's last reports have them: their HTTP addresses and loads."""

    def __init__(self, own: str) -> None:
        self.own = own
        self._reports: dict[str, ReplicaReport] = {}

    def update(self, reports: Iterable[ReplicaReport]) -> None:
        self._reports = {r.replica: r for r in reports if r.replica != self.own and r.address}

    def address_of(self, replica: str) -> str | None:
        """Where ``replica`` serves (None: unknown, gone, or draining: it answers no new request)."""
        report = self._reports.get(replica)
        return report.address if report is not None and not report.load.draining else None

    def with_room(self) -> ReplicaReport | None:
        """The serving replica with the most free session slots (None: all full). Counts it one
        session fuller at once, so a burst of relays before the next report spreads."""
        ranked = sorted(
            (r for r in self._reports.values() if r.load.engine_running and r.load.free_session_slots > 0),
            key=lambda r: (-r.load.free_session_slots, r.replica),
        )
        if not ranked:
            return None
        best = ranked[0]
        self._reports[best.replica] = replace(
            best, load=replace(best.load, sessions_active=best.load.sessions_active + 1)
        )
        return best

    def less_loaded(self, own_queue: int) -> ReplicaReport | None:
        """The serving replica with the shortest engine queue, if shorter than ``own_queue``
        (None: none is). Counts it one request busier at once, as :meth:`with_room` does."""
        ranked = sorted(
            (r for r in self._reports.values() if r.load.engine_running and not r.load.draining),
            key=lambda r: (r.load.engine_queue_depth, r.replica),
        )
        if not ranked or ranked[0].load.engine_queue_depth >= own_queue:
            return None
        best = ranked[0]
        self._reports[best.replica] = replace(
            best, load=replace(best.load, engine_queue_depth=best.load.engine_queue_depth + 1)
        )
        return best


class FleetIngress:
    """A replica's routing behind HAProxy (see the module); :class:`IngressMiddleware` runs it
    in front of the replica's app."""

    def __init__(
        self,
        *,
        replica: str,
        capacity: int,
        realtime: Any,
        engine_queue: Callable[[], int],
        peers: Peers,
        replica_header: str,
        refresh_peers: Callable[[], Awaitable[None]] | None = None,
        max_body_bytes: int = 64 << 20,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.replica = replica
        self.capacity = capacity
        #: The replica's ``RealtimeService`` (``draining``, ``shutting_down``).
        self.realtime = realtime
        #: This replica's engine queue now (requests admitted or waiting).
        self.engine_queue = engine_queue
        self.peers = peers
        #: Reads the fleet's reports into ``peers`` now (they are refreshed every report period;
        #: a session about to be refused asks again: a replica may have come up since).
        self.refresh_peers = refresh_peers
        self.replica_header = replica_header
        #: The server's limit on a request body (``max_http_body_bytes``): larger ones stay here.
        self.max_body_bytes = max_body_bytes
        #: Realtime WebSockets this replica serves itself (counted from their first message, so
        #: two arriving together both see the other).
        self.open_sessions = 0
        self.relays: set[WebSocketRelay] = set()
        self._client: httpx.AsyncClient | None = None
        self.handoffs = Counter(
            "omnirt_replica_handoffs",
            "Requests this replica handed to another (HAProxy ingress): relayed sessions (session), "
            "requests on another's video job (video), engine requests to a shorter queue (engine)",
            ["kind"],
            registry=registry,
        )

    def full(self) -> bool:
        return self.open_sessions >= self.capacity or self.realtime.draining or self.realtime.shutting_down

    async def route(self, app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve ``scope`` with ``app`` (this replica's), or hand it to another replica."""
        kind = scope["type"]
        if kind == "websocket" and route_path(scope) == REALTIME_PATH:
            await self._session(app, scope, receive, send)
            return
        if kind == "http" and not forwarded(scope):
            address = self._elsewhere(scope)
            if address is not None:
                await self._forward(app, scope, receive, send, address)
                return
        await app(scope, receive, send)

    def _elsewhere(self, scope: Scope) -> str | None:
        """The address of the replica that should serve this HTTP request, when not this one."""
        path = route_path(scope)
        owner = owner_of(path)
        if owner is not None:
            address = self.peers.address_of(owner) if owner != self.replica else None
            if address is not None:
                self.handoffs.labels("video").inc()
            return address
        if scope["method"] == "POST" and path.rstrip("/") in ENGINE_PATHS:
            peer = self.peers.less_loaded(self.engine_queue())
            if peer is not None:
                self.handoffs.labels("engine").inc()
                return peer.address
        return None

    async def _session(self, app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
        first = await receive()  # websocket.connect (the relay accepts in its place)
        if first["type"] == "websocket.connect" and not forwarded(scope) and self.full():
            peer = self.peers.with_room()
            if peer is None and self.refresh_peers is not None:
                try:
                    await self.refresh_peers()
                except Exception as exc:  # the fleet deployment restarting: refused here
                    log.warning("cannot read the fleet's reports: %s", exc)
                peer = self.peers.with_room()
            if peer is not None and peer.address is not None:
                relay = WebSocketRelay(scope, receive, send, peer.address)
                self.relays.add(relay)
                try:
                    log.info("replica %s full: session relayed to replica %s", self.replica, peer.replica)
                    self.handoffs.labels("session").inc()
                    await relay.run(self.replica_header)
                    return
                except PeerUnreachable as exc:
                    log.warning("cannot relay a session to replica %s (%s): served here", peer.replica, exc)
                finally:
                    self.relays.discard(relay)
        self.open_sessions += 1
        try:
            await app(scope, replaying(first, receive), send)
        finally:
            self.open_sessions -= 1

    async def _forward(self, app: ASGIApp, scope: Scope, receive: Receive, send: Send, address: str) -> None:
        # A body over the server's limit is not carried: this replica's app refuses it (413) as
        # the other would, without holding more of it than the limit.
        declared = Headers(scope=scope).get("content-length", "0")
        if not declared.isdigit() or int(declared) > self.max_body_bytes:
            await app(scope, receive, send)
            return
        body = await request_body(receive, self.max_body_bytes)
        if body.left:
            return  # nobody to answer
        if not body.fits(self.max_body_bytes):
            await app(scope, replaying(body.message(), receive), send)
            return
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=FORWARD_TIMEOUT_SECONDS)
        try:
            await forward_http(scope, body.data, send, address, self._client)
        except PeerUnreachable as exc:
            log.warning("cannot forward %s to %s (%s): served here", scope["path"], address, exc)
            await app(scope, replaying(body.message(), receive), send)

    async def drain(self, grace: float) -> None:
        """As the replica's own sessions drain (``RealtimeService.drain``): the relayed sessions
        go on for ``grace`` seconds, then close with 1001 (a replica being removed carries them no
        longer; their clients reconnect)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while self.relays and loop.time() < deadline:
            await asyncio.sleep(min(0.2, max(0.0, deadline - loop.time())))
        if self.relays:
            log.info("drain grace over: closing %d relayed session(s) with 1001", len(self.relays))
        for relay in list(self.relays):
            await relay.close(1001, "server draining")

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()


class IngressMiddleware:
    """Runs a :class:`FleetIngress` in front of the app (the replica's outermost middleware)."""

    def __init__(self, app: ASGIApp, ingress: FleetIngress) -> None:
        self.app = app
        self.ingress = ingress

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.ingress.route(self.app, scope, receive, send)


async def direct_address(controller: Any, app_name: str, replica_id: str) -> str | None:
    """``host:port`` where Ray Serve's direct ingress serves this replica's HTTP (the targets Ray
    Serve gives HAProxy; None until the replica's server has started). The host is the node's
    address when the servers listen on every interface, else the one they listen on (loopback:
    reachable from this machine only, as for HAProxy)."""
    groups = await controller.get_target_groups.remote(app_name, from_proxy_manager=True)
    for group in groups:
        if str(getattr(group.protocol, "value", group.protocol)).upper() != "HTTP":
            continue
        for target in group.targets:
            if target.name.endswith(f"#{replica_id}"):
                listen = (await controller.get_http_config.remote()).host
                host = target.ip if listen in ("0.0.0.0", "::", "") else listen
                return f"[{host}]:{target.port}" if ":" in host else f"{host}:{target.port}"
    return None
