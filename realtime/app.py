"""The Starlette application: every HTTP route and the realtime WebSocket, on one engine.

``create_app(client, config)`` wires the endpoints of :mod:`.http` (chat completions, images,
videos, models) and the realtime service onto an :class:`~omnirt.stages.engine.EngineClient`
(``/v1/models`` lists every pipeline's model; ``/health``, the index and the sessions name the
first one, the speech model). Its
lifespan starts the engine thread when nobody has yet (and then stops it on shutdown). The
browser UI is served at ``/`` from the ``omnirt.web_ui`` package's ``static/`` folder when it
exists; otherwise ``/`` answers a small JSON index of the APIs.

Exposure: browsers' requests pass the Origin allow-list (:mod:`.origin`; same-origin by default)
before any route; ``/metrics`` takes the API key when keys are set, or lives on its own listener
(``config.metrics_host``); responses never carry filesystem paths or memory addresses
(:mod:`.redact`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.resources
import logging
from collections.abc import AsyncIterator
from pathlib import Path

from omnirt.stages.engine import EngineClient
from omnirt.vad.model import VadInitError
from omnirt.vad.worker import VadWorker
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse
from starlette.routing import BaseRoute, Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles

from .config import ServerConfig
from .http.chat import ChatCompletions
from .http.errors import EXCEPTION_HANDLERS
from .http.images import ImageGenerations
from .http.metrics import HTTPMetricsMiddleware, Metrics, start_metrics_listener
from .http.models import Models
from .http.videos import Videos
from .origin import OriginGuard, OriginPolicy
from .ws import RealtimeService

log = logging.getLogger(__name__)


def web_ui_dir() -> Path | None:
    """``omnirt/web_ui/static`` when the UI has been built into the package, else None."""
    try:
        static = Path(str(importlib.resources.files("omnirt.web_ui").joinpath("static")))
    except ModuleNotFoundError:
        return None
    return static if (static / "index.html").is_file() else None


def web_ui_routes(static: Path) -> list[BaseRoute]:
    """The UI at ``/``: one route per top-level file or folder of ``static/``.

    Not one catch-all mount at ``/``: that would fully match every path, so an unknown
    ``/v1/...`` path or a wrong method on an API route would reach the file server instead of
    getting the API's JSON 404 / 405.
    """
    routes: list[BaseRoute] = [
        Route("/", _file_endpoint(static / "index.html"), methods=["GET"], name="web_ui")
    ]
    for entry in sorted(static.iterdir()):
        if entry.is_dir():
            routes.append(Mount(f"/{entry.name}", StaticFiles(directory=entry), name=f"web_ui_{entry.name}"))
        elif entry.is_file():
            routes.append(Route(f"/{entry.name}", _file_endpoint(entry), methods=["GET"]))
    return routes


def _file_endpoint(path: Path):  # type: ignore[no-untyped-def]
    async def endpoint(request: Request) -> FileResponse:
        return FileResponse(path)

    return endpoint


def create_app(client: EngineClient, config: ServerConfig) -> Starlette:
    info = client.info
    # Server VAD sits on the sessions' input path: one VAD process for all of them, owned here.
    vad = VadWorker(
        config.vad_model_path,
        max_batch=config.vad_max_batch,
        gather_ms=config.vad_gather_ms,
        nice=config.vad_nice,
    )
    realtime = RealtimeService(client, config, vad)
    chat = ChatCompletions(client, config)
    images = ImageGenerations(client, config)
    videos = Videos(client, config)
    kinds = {p.info.id: kind for kind, p in reversed(client.engine.pipelines.items())}
    models = Models(client.infos, config, {realtime.model: realtime.limits.voices.aliases}, kinds)
    metrics = Metrics(client.engine, lambda: realtime, config.api_keys)
    origins = OriginPolicy(config.allowed_origins)  # a bad origin fails here, before serving

    async def health(request: Request) -> JSONResponse:
        return JSONResponse(
            {
                "status": "ok",
                "model": info.id,
                "random_weights": info.random_weights,
                "engine": "running" if client.engine.running else "stopped",
            }
        )

    async def index(request: Request) -> JSONResponse:
        return JSONResponse(
            {
                "name": "omnirt",
                "model": info.id,
                "random_weights": info.random_weights,
                "endpoints": {
                    "realtime": "/v1/realtime (WebSocket)",
                    "chat_completions": "POST /v1/chat/completions",
                    "images": "POST /v1/images/generations",
                    "videos": "POST|GET /v1/videos, GET|DELETE /v1/videos/{id}, GET /v1/videos/{id}/content",
                    "models": "GET /v1/models",
                    "health": "GET /health",
                    "metrics": "GET /metrics" if config.metrics_host is None else None,
                },
                "web_ui": None,
            }
        )

    routes: list[BaseRoute] = [
        Route("/health", health, methods=["GET"], name="health"),
        Route("/v1/models", models.list, methods=["GET"], name="list_models"),
        Route("/v1/models/{model:path}", models.retrieve, methods=["GET"], name="retrieve_model"),
        Route("/v1/chat/completions", chat.create, methods=["POST"], name="chat_completions"),
        Route("/v1/images/generations", images.create, methods=["POST"], name="image_generations"),
        Route("/v1/videos", videos.create, methods=["POST"], name="create_video"),
        Route("/v1/videos", videos.list, methods=["GET"], name="list_videos"),
        Route("/v1/videos/{video_id}", videos.retrieve, methods=["GET"], name="retrieve_video"),
        Route("/v1/videos/{video_id}", videos.delete, methods=["DELETE"], name="delete_video"),
        Route("/v1/videos/{video_id}/content", videos.content, methods=["GET"], name="video_content"),
        WebSocketRoute("/v1/realtime", realtime.handle, name="realtime"),
    ]
    if config.metrics_host is None:
        routes.append(Route("/metrics", metrics.endpoint, methods=["GET"], name="metrics"))
    static = web_ui_dir()
    if static is not None:
        routes.extend(web_ui_routes(static))
    else:
        routes.append(Route("/", index, methods=["GET"], name="index"))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # The metrics listener first: an address that cannot be bound fails the start-up.
        stop_metrics = (
            start_metrics_listener(metrics, config.metrics_host) if config.metrics_host is not None else None
        )
        if stop_metrics is not None:
            log.info("metrics on http://%s/metrics", config.metrics_host)
        started_here = not client.engine.running
        if started_here:
            client.engine.start()
        if config.vad_preload:
            try:
                await asyncio.to_thread(vad.load)
            except VadInitError as exc:  # sessions asking for server_vad get the error then
                log.error("server VAD is unavailable: %s", exc)
        # Everything alive now (model code, weights, imported modules) lives as long as the
        # server: out of the collector's view, full collections no longer pause the event loop
        # for tens of milliseconds (72 ms measured with 200 sessions streaming).
        gc.collect()
        gc.freeze()
        log.info(
            "omnirt app up: model %s (%s)%s; web UI %s",
            info.id,
            info.architecture,
            ", RANDOM weights" if info.random_weights else "",
            static if static is not None else "not built",
        )
        try:
            yield
        finally:
            await videos.aclose()
            vad.stop()  # sessions still open just stop getting VAD decisions
            if started_here:
                await asyncio.to_thread(client.engine.stop)
            if stop_metrics is not None:
                await asyncio.to_thread(stop_metrics)

    app = Starlette(
        routes=routes,
        middleware=[
            Middleware(HTTPMetricsMiddleware, metrics=metrics),
            Middleware(OriginGuard, policy=origins),
        ],
        exception_handlers=EXCEPTION_HANDLERS,  # type: ignore[arg-type]
        lifespan=lifespan,
    )
    app.state.client = client
    app.state.config = config
    app.state.realtime = realtime
    app.state.vad = vad
    app.state.metrics = metrics
    app.state.videos = videos
    return app
