"""``GET /metrics``: Prometheus text format, one registry per app.

On the API port it takes the API key when keys are set (``Authorization: Bearer KEY``, as
Prometheus sends ``authorization``/``bearer_token``); ``--metrics-host HOST:PORT`` serves it on
a listener of its own instead (:func:`start_metrics_listener`), open, for a private address.

Engine and realtime numbers are read when scraped, by a custom collector, from the counters
their owners already keep (``engine.stats``, with each pipeline's own count of batched model
calls, and the realtime service's counters); nothing on the hot path is touched for them. HTTP
requests are counted by a small ASGI middleware, labelled by route template (never by raw path,
which would let clients create label values).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from omnirt.stages.engine import STEP_BUCKETS, Engine
from omnirt.vad.worker import LATENCY_BUCKETS
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..config import parse_host_port
from ..redact import public_source
from .access import require_api_key


class VadCounters(Protocol):
    windows: int
    batches: int
    busy_seconds: float
    restarts: int
    latency_buckets: list[int]
    latency_sum: float


class RealtimeCounters(Protocol):
    active_sessions: int
    sessions_total: int
    events_received: int
    events_sent: int
    errors_sent: int
    clients_held: int
    slow_clients_closed: int

    @property
    def vad_stats(self) -> VadCounters: ...


class ServerCollector(Collector):
    """Reads ``engine.stats`` and the realtime counters at scrape time."""

    def __init__(self, engine: Engine, realtime: Callable[[], RealtimeCounters | None]) -> None:
        self.engine = engine
        self.realtime = realtime

    def collect(self) -> Iterator[Metric]:
        model = InfoMetricFamily("omnirt_model", "The loaded models, one per pipeline", labels=["kind"])
        for kind, pipeline in self.engine.pipelines.items():
            info = pipeline.info
            model.add_metric(
                [kind],
                {
                    "id": info.id,
                    "architecture": info.architecture,
                    "source": public_source(info.source),
                    "random_weights": str(info.random_weights).lower(),
                },
            )
        yield model

        s = self.engine.stats
        yield CounterMetricFamily("omnirt_engine_steps", "Pipeline steps run, all pipelines", value=s.steps)
        yield CounterMetricFamily(
            "omnirt_engine_step_seconds", "Wall time spent inside pipeline steps", value=s.step_seconds
        )
        yield CounterMetricFamily(
            "omnirt_engine_requests_submitted", "Requests submitted to the engine", value=s.requests_submitted
        )
        ended = CounterMetricFamily(
            "omnirt_engine_requests_ended", "Engine requests by outcome", labels=["outcome"]
        )
        ended.add_metric(["completed"], s.requests_finished)
        ended.add_metric(["cancelled"], s.requests_cancelled)
        ended.add_metric(["failed"], s.requests_failed)
        yield ended
        yield GaugeMetricFamily(
            "omnirt_engine_requests_active", "Requests admitted to the pipeline", value=s.active
        )
        yield GaugeMetricFamily(
            "omnirt_engine_requests_waiting", "Requests waiting for a slot", value=s.waiting
        )
        steps = CounterMetricFamily("omnirt_pipeline_steps", "Pipeline steps run", labels=["kind"])
        seconds = CounterMetricFamily(
            "omnirt_pipeline_step_seconds", "Wall time spent inside the pipeline's steps", labels=["kind"]
        )
        for kind, count in s.steps_by_kind.items():
            steps.add_metric([kind], count)
            seconds.add_metric([kind], s.step_seconds_by_kind[kind])
        yield steps
        yield seconds
        durations = HistogramMetricFamily(
            "omnirt_pipeline_step_duration_seconds",
            "Pipeline steps by wall time (a realtime step holds every session of its pipeline)",
            labels=["kind"],
        )
        for kind, counts in s.step_buckets.items():
            durations.add_metric(
                [kind], _cumulative(STEP_BUCKETS, list(counts)), sum_value=s.step_seconds_by_kind[kind]
            )
        yield durations
        calls = CounterMetricFamily(
            "omnirt_model_calls",
            "Batched model calls by pipeline, model and rows (requests advanced by the one call)",
            labels=["kind", "call", "rows"],
        )
        for kind, counter in s.model_calls.items():
            for (call, rows), count in sorted(dict(counter).items()):
                calls.add_metric([kind, call, str(rows)], count)
        yield calls
        prompt = CounterMetricFamily(
            "omnirt_prompt_tokens",
            "Prompt tokens by pipeline: read by the model, or cached (a prefix another request read)",
            labels=["kind", "source"],
        )
        for kind, counter in s.prompt_tokens.items():
            for source in ("read", "cached"):
                prompt.add_metric([kind, source], counter[source])
        yield prompt

        rt = self.realtime()
        if rt is None:
            return
        yield GaugeMetricFamily(
            "omnirt_realtime_sessions_active", "Open realtime sessions", value=rt.active_sessions
        )
        yield CounterMetricFamily(
            "omnirt_realtime_sessions", "Realtime sessions opened", value=rt.sessions_total
        )
        yield CounterMetricFamily(
            "omnirt_realtime_events_received", "Client events received", value=rt.events_received
        )
        yield CounterMetricFamily("omnirt_realtime_events_sent", "Server events sent", value=rt.events_sent)
        yield CounterMetricFamily("omnirt_realtime_errors_sent", "Error events sent", value=rt.errors_sent)
        yield CounterMetricFamily(
            "omnirt_realtime_clients_held",
            "Times a session's responses were held because its client was behind reading",
            value=rt.clients_held,
        )
        yield CounterMetricFamily(
            "omnirt_realtime_slow_clients_closed",
            "Realtime connections closed (1008) for falling behind reading",
            value=rt.slow_clients_closed,
        )
        vad = rt.vad_stats
        yield CounterMetricFamily("omnirt_vad_windows", "Server-VAD windows scored", value=vad.windows)
        yield CounterMetricFamily("omnirt_vad_batches", "Server-VAD model calls (batched)", value=vad.batches)
        yield CounterMetricFamily(
            "omnirt_vad_busy_seconds", "Wall time the VAD process spent scoring", value=vad.busy_seconds
        )
        yield CounterMetricFamily(
            "omnirt_vad_process_restarts", "Times the VAD process died and was replaced", value=vad.restarts
        )
        yield HistogramMetricFamily(
            "omnirt_vad_decision_seconds",
            "Server VAD: from the arrival of the chunk completing a window to its endpointing decision",
            buckets=_cumulative(LATENCY_BUCKETS, vad.latency_buckets),
            sum_value=vad.latency_sum,
        )


def _cumulative(bounds: Sequence[float], counts: Sequence[int]) -> list[tuple[str, int]]:
    """A histogram's Prometheus buckets from counts per bucket (the last one past every bound)."""
    total, out = 0, []
    for bound, count in zip([*map(str, bounds), "+Inf"], counts, strict=True):
        total += count
        out.append((bound, total))
    return out


class Metrics:
    """The app's registry, its HTTP instruments and the ``/metrics`` endpoint."""

    def __init__(
        self,
        engine: Engine,
        realtime: Callable[[], RealtimeCounters | None],
        api_keys: Sequence[str] = (),
    ) -> None:
        #: Keys a scraper must present on the API port (``Authorization: Bearer KEY``); empty: open.
        self.api_keys = list(api_keys)
        self.registry = CollectorRegistry()
        self.registry.register(ServerCollector(engine, realtime))
        self.http_requests = Counter(
            "omnirt_http_requests",
            "HTTP requests by route template, method and status",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.http_seconds = Histogram(
            "omnirt_http_request_duration_seconds",
            "HTTP request time until the response body ended",
            ["route", "method"],
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )

    async def endpoint(self, request: Request) -> Response:
        require_api_key(request, self.api_keys)
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


def route_label(scope: Scope) -> str:
    route: Any = scope.get("route")
    if route is None:
        return "unmatched"
    if isinstance(route, Mount):
        return f"{route.path}/{{path}}"
    return str(getattr(route, "path", "unmatched"))


_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class HTTPMetricsMiddleware:
    """Counts and times every HTTP request into ``metrics`` (ASGI middleware)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        t0 = time.perf_counter()

        async def send_and_observe(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_observe)
        finally:
            route = route_label(scope)
            method = scope["method"] if scope["method"] in _METHODS else "other"
            self.metrics.http_requests.labels(route, method, str(status)).inc()
            self.metrics.http_seconds.labels(route, method).observe(time.perf_counter() - t0)


def start_metrics_listener(metrics: Metrics, host_port: str) -> Callable[[], None]:
    """Serve ``metrics``' registry over HTTP on ``host_port`` (a thread of prometheus_client);
    returns the function that stops it. OSError when the address cannot be bound."""
    host, port = parse_host_port(host_port)
    server, thread = start_http_server(port, addr=host, registry=metrics.registry)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(5)

    return stop
