"""The omnirt replica as a Ray Serve deployment, and the application of the fleet.

Each replica (:class:`OmnirtReplica`) builds exactly what one ``omnirt serve`` process builds
(:func:`omnirt.realtime.build.build_app`: pipelines, engine, app) and serves the app as the
deployment's ASGI ingress, so Ray Serve's HTTP proxy carries every route to it: ``/v1/realtime``
WebSockets, chat, images, videos, models and the UI. What the replica adds:

- ``record_routing_stats``: its :class:`~.load.ReplicaLoad` (free session slots, engine queue,
  draining), which Ray Serve hands to :class:`~.router.SessionAwareRouter`;
- ``/health`` and ``/metrics`` for the whole fleet (:mod:`.fleet`);
- its ``/v1/videos`` jobs shared with the fleet: ids that name the replica (the router sends a
  job's requests to it) and a list of every replica's jobs (:mod:`.video_jobs`);
- an ``x-omnirt-replica`` header on every response and WebSocket accept (which replica served);
- draining when Ray Serve removes it (:mod:`.drain`);
- ``check_health``: a replica whose engine thread has stopped is replaced by Ray Serve;
- behind HAProxy (``--ingress haproxy``), omnirt's routing where the request lands
  (:mod:`.ingress`): its own HTTP address in its reports, the others' from the fleet's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..build import build_app
from ..config import ServerConfig
from ..http.access import require_api_key
from .drain import serve_controller, watch_for_removal
from .fleet import ReplicaReport, fleet_health, fleet_metrics, merge_reports
from .ingress import FleetIngress, IngressMiddleware, Peers, direct_address
from .load import ReplicaLoad
from .video_jobs import FleetVideoJobs

log = logging.getLogger(__name__)

REPLICA_HEADER = "x-omnirt-replica"
#: How long a ``/health`` or ``/metrics`` request waits for the fleet's reports before it answers
#: with this replica's alone.
FLEET_TIMEOUT_SECONDS = 2.0
#: Seconds between a replica's looks for its own HTTP address (HAProxy ingress) until found.
ADDRESS_POLL_SECONDS = 0.2


@dataclass(frozen=True)
class ReplicaSettings:
    app_name: str
    #: Seconds between a replica's reports to the fleet (health, metrics).
    report_seconds: float = 1.0
    #: Once removed, how long live sessions may go on before they are closed (1001).
    drain_seconds: float = 30.0
    #: Seconds between a replica's looks at its own state (is it being removed?).
    poll_seconds: float = 1.0
    #: The level of omnirt's log lines in the replica (``--log-level``; Ray Serve keeps its own).
    log_level: str = "info"
    #: ``proxy`` (Ray Serve's HTTP proxy and omnirt's request router) or ``haproxy`` (:mod:`.ingress`).
    ingress: str = "proxy"


def _log_to_stderr(level: str) -> None:
    """omnirt's loggers to the replica's stderr (Ray keeps it in the worker's log and shows it on
    the driver's console), as ``omnirt serve`` logs in one process."""
    from ..cli import LOG_FORMAT

    logger = logging.getLogger("omnirt")
    logger.setLevel(level.upper())
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        logger.addHandler(handler)


class ReplicaHeader:
    """ASGI middleware: ``x-omnirt-replica: ID`` on every HTTP response and WebSocket accept."""

    def __init__(self, app: ASGIApp, replica: str) -> None:
        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return

        async def send_marked(message: Message) -> None:
            if message["type"] in ("http.response.start", "websocket.accept"):
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_marked)


class OmnirtReplica:
    """One omnirt server inside a Ray Serve replica (decorated as an ingress below)."""

    async def __init__(
        self,
        config: ServerConfig,
        device: str | None,
        load_format: str,
        settings: ReplicaSettings,
        fleet: DeploymentHandle,
    ) -> None:
        _log_to_stderr(settings.log_level)
        context = serve.get_replica_context()
        self.replica_id = context.replica_tag
        self.deployment = context.deployment
        self.config = config
        self.settings = settings
        self.fleet = fleet
        # The models load off the replica's event loop (Ray Serve's health checks go on).
        # Not ``self.app``: Ray Serve's ingress wrapper has that name (the app it runs).
        self.omnirt_app: Starlette = await asyncio.to_thread(
            build_app, config, device=device, load_format=load_format
        )
        self.realtime = self.omnirt_app.state.realtime
        self.engine = self.omnirt_app.state.client.engine
        videos = self.omnirt_app.state.videos
        self.videos = FleetVideoJobs(
            videos.store, fleet, self.replica_id, timeout_seconds=FLEET_TIMEOUT_SECONDS
        )
        videos.sharing = self.videos
        self._add_fleet_routes()
        self.omnirt_app.add_middleware(ReplicaHeader, replica=self.replica_id)
        #: Where this replica serves HTTP itself (HAProxy ingress; looked up once it does).
        self.address: str | None = None
        self.ingress: FleetIngress | None = None
        if settings.ingress == "haproxy":
            self.ingress = FleetIngress(
                replica=self.replica_id,
                capacity=config.max_sessions,
                realtime=self.realtime,
                engine_queue=lambda: self.load().engine_queue_depth,
                peers=Peers(self.replica_id),
                replica_header=REPLICA_HEADER,
                refresh_peers=self._refresh_peers,
                max_body_bytes=config.max_http_body_bytes,
                registry=self.omnirt_app.state.metrics.registry,
            )
            self.omnirt_app.add_middleware(IngressMiddleware, ingress=self.ingress)  # outermost
        self._tasks = [
            asyncio.create_task(self._report_forever(), name="omnirt fleet report"),
            *([asyncio.create_task(self._find_address(), name="omnirt address")] if self.ingress else []),
            asyncio.create_task(
                watch_for_removal(
                    settings.app_name,
                    self.deployment,
                    self.replica_id,
                    self._drain,
                    poll_seconds=settings.poll_seconds,
                ),
                name="omnirt drain watch",
            ),
        ]
        log.info("omnirt replica %s ready (%s)", self.replica_id, self.omnirt_app.state.client.info.id)

    def __serve_build_asgi_app__(self) -> Starlette:
        return self.omnirt_app

    # -- what Ray Serve calls ------------------------------------------------------------------
    def record_routing_stats(self) -> dict[str, Any]:
        return self.load().to_stats()

    def check_health(self) -> None:
        if not self.engine.running:
            raise RuntimeError(f"omnirt replica {self.replica_id}: the engine thread has stopped")

    async def __del__(self) -> None:
        for task in getattr(self, "_tasks", ()):  # none when the constructor failed
            task.cancel()
        if hasattr(self, "videos"):
            self.videos.close()
        if getattr(self, "ingress", None) is not None:
            with contextlib.suppress(Exception):
                await self.ingress.aclose()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.fleet.forget.remote(self.replica_id), FLEET_TIMEOUT_SECONDS)

    # -- ours ------------------------------------------------------------------------------------
    def load(self) -> ReplicaLoad:
        stats = self.engine.stats
        return ReplicaLoad(
            session_capacity=self.config.max_sessions,
            sessions_active=self.realtime.active_sessions,
            engine_queue_depth=stats.active + stats.waiting,
            draining=self.realtime.draining,
            engine_running=self.engine.running,
            at=time.time(),
        )

    def report(self, *, videos: bool = False) -> ReplicaReport:
        """Its load and metrics now (``videos``: its video jobs' cards too)."""
        families = list(self.omnirt_app.state.metrics.registry.collect())
        shared = self.videos.snapshot() if videos else None
        return ReplicaReport(self.replica_id, self.load(), families, videos=shared, address=self.address)

    async def _report_forever(self) -> None:
        while True:
            try:
                await self.fleet.report.remote(self.report(videos=True))
                if self.ingress is not None:
                    await self._refresh_peers()
            except Exception as exc:  # the fleet deployment restarting: report again next time
                log.debug("fleet report failed: %s", exc)
            await asyncio.sleep(self.settings.report_seconds)

    async def _refresh_peers(self) -> None:
        assert self.ingress is not None
        self.ingress.peers.update(await asyncio.wait_for(self.fleet.peers.remote(), FLEET_TIMEOUT_SECONDS))

    async def _find_address(self) -> None:
        """Where this replica serves HTTP itself (HAProxy ingress), once Ray Serve has started
        its server (after this constructor); reported at once, so the others can hand it work."""
        controller = None
        while self.address is None:
            await asyncio.sleep(ADDRESS_POLL_SECONDS)
            try:
                if controller is None:
                    controller = await asyncio.to_thread(serve_controller)
                self.address = await direct_address(controller, self.settings.app_name, self.replica_id)
            except Exception as exc:  # the controller restarting: look it up and ask again
                log.debug("cannot read this replica's address: %s", exc)
                controller = None
        log.info("replica %s serves HTTP itself on %s", self.replica_id, self.address)
        with contextlib.suppress(Exception):  # else with the next report
            await self.fleet.report.remote(self.report(videos=True))

    async def _drain(self) -> None:
        await self.videos.withdraw()  # no request reaches this replica any more: nor its jobs
        grace = self.settings.drain_seconds
        if self.ingress is None:
            await self.realtime.drain(grace)
        else:
            await asyncio.gather(self.realtime.drain(grace), self.ingress.drain(grace))

    async def _reports(self) -> list[ReplicaReport]:
        own = self.report()
        try:
            others = await asyncio.wait_for(self.fleet.reports.remote(), FLEET_TIMEOUT_SECONDS)
        except Exception as exc:
            log.warning("fleet reports unavailable (%s): replica %s answers alone", exc, self.replica_id)
            others = []
        return merge_reports(own, others)

    def _add_fleet_routes(self) -> None:
        info = self.omnirt_app.state.client.info
        api_keys = self.config.api_keys

        async def health(request: Request) -> JSONResponse:
            body = fleet_health(await self._reports(), model=info.id, random_weights=info.random_weights)
            return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

        async def metrics(request: Request) -> Response:
            require_api_key(request, api_keys)
            return Response(fleet_metrics(await self._reports()), media_type=CONTENT_TYPE_LATEST)

        # In front of the app's own /health and /metrics (the first matching route serves).
        self.omnirt_app.router.routes[0:0] = [
            Route("/health", health, methods=["GET"], name="fleet_health"),
            Route("/metrics", metrics, methods=["GET"], name="fleet_metrics"),
        ]


#: The ingress deployment class: Ray Serve runs the app that ``__serve_build_asgi_app__`` returns.
OmnirtIngress = serve.ingress()(OmnirtReplica)
