"""``/health``, ``/metrics`` and the ``/v1/videos`` list across the replicas.

Every replica sends a :class:`ReplicaReport` (its load, its engine state and its Prometheus
metric families) every ``report_seconds`` to :class:`FleetStats`, a small deployment of one
replica beside the omnirt replicas; whichever replica a ``/health`` or ``/metrics`` request
reaches asks it for the reports of all (its own taken fresh) and answers for the whole fleet.
A replica that stops reporting (killed, gone) drops out after ``stale_seconds``.

``/metrics`` keeps the single process's Prometheus text: the same families, each sample once
per replica with a ``replica`` label, plus ``omnirt_replicas`` (replicas reporting).

The fleet also holds each replica's video jobs' cards (:class:`~.video_jobs.SharedJobs`, sent with
each report and at once on a change: :mod:`.video_jobs`), dropped with the replica's reports.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .load import ReplicaLoad
from .video_jobs import SharedJobs

REPLICA_LABEL = "replica"


@dataclass
class ReplicaReport:
    replica: str
    load: ReplicaLoad
    #: The metric families of the replica's own registry (``app.state.metrics.registry``).
    metrics: list[Metric] = field(default_factory=list)
    at: float = field(default_factory=time.time)
    #: Its video jobs' cards (None: not sharing them).
    videos: SharedJobs | None = None
    #: ``host:port`` where it serves HTTP itself (HAProxy ingress: :mod:`.ingress`); None: only
    #: through Ray Serve's proxy.
    address: str | None = None


class FleetStats:
    """The reports and video jobs of the live replicas (the body of the ``OmnirtFleet`` deployment).

    Ray Serve runs a deployment's plain methods in a thread pool: a lock keeps them one at a time."""

    def __init__(self, stale_seconds: float = 3.0) -> None:
        self.stale_seconds = stale_seconds
        self._lock = threading.Lock()
        self._reports: dict[str, ReplicaReport] = {}
        #: Per replica, its latest video jobs and when they came (this process's ``time.time()``).
        self._videos: dict[str, tuple[SharedJobs, float]] = {}

    def report(self, report: ReplicaReport) -> None:
        """Keeps ``report`` unless a later one of that replica came first (by the replica's own
        clock: Ray runs these calls on a pool of threads, so two may land out of order)."""
        if report.videos is not None:
            self.share_videos(report.videos)
            report = replace(report, videos=None)
        with self._lock:
            held = self._reports.get(report.replica)
            if held is None or held.at <= report.at:
                self._reports[report.replica] = report

    def forget(self, replica: str) -> None:
        with self._lock:
            self._reports.pop(replica, None)
            self._videos.pop(replica, None)

    def share_videos(self, jobs: SharedJobs) -> None:
        """Keep ``jobs`` unless a later snapshot of that replica came first (it is alive anyway)."""
        with self._lock:
            held = self._videos.get(jobs.replica)
            if held is not None and held[0].seq > jobs.seq:
                jobs = held[0]
            self._videos[jobs.replica] = (jobs, time.time())

    def videos(self) -> list[SharedJobs]:
        """The video jobs of the replicas heard from within ``stale_seconds``."""
        horizon = time.time() - self.stale_seconds
        with self._lock:
            for name in [n for n, (_, at) in self._videos.items() if at < horizon]:
                del self._videos[name]
            return [jobs for jobs, _ in self._videos.values()]

    def reports(self) -> list[ReplicaReport]:
        horizon = time.time() - self.stale_seconds
        with self._lock:
            for name in [n for n, r in self._reports.items() if r.at < horizon]:
                del self._reports[name]
            return sorted(self._reports.values(), key=lambda r: r.replica)

    def peers(self) -> list[ReplicaReport]:
        """The live replicas' reports without their metrics: loads and addresses (:mod:`.ingress`)."""
        return [replace(r, metrics=[]) for r in self.reports()]


def merge_reports(own: ReplicaReport, others: Iterable[ReplicaReport]) -> list[ReplicaReport]:
    """The fleet's reports, with ``own`` (fresh) in place of what the fleet holds for it."""
    reports = {r.replica: r for r in others}
    reports[own.replica] = own
    return sorted(reports.values(), key=lambda r: r.replica)


def fleet_health(reports: Sequence[ReplicaReport], *, model: str, random_weights: bool) -> dict[str, Any]:
    """The ``/health`` body: the single process's keys for the fleet, then one entry per replica.
    ``status`` is ``ok`` while at least one replica serves (engine running, not draining)."""
    serving = [r for r in reports if r.load.engine_running and not r.load.draining]
    return {
        "status": "ok" if serving else "unavailable",
        "model": model,
        "random_weights": random_weights,
        "engine": "running" if any(r.load.engine_running for r in reports) else "stopped",
        "replicas_serving": len(serving),
        "sessions_active": sum(r.load.sessions_active for r in reports),
        "free_session_slots": sum(r.load.free_session_slots for r in reports),
        "replicas": [
            {
                "replica": r.replica,
                "engine": "running" if r.load.engine_running else "stopped",
                "draining": r.load.draining,
                "sessions_active": r.load.sessions_active,
                "session_capacity": r.load.session_capacity,
                "free_session_slots": r.load.free_session_slots,
                "engine_queue_depth": r.load.engine_queue_depth,
                **({"address": r.address} if r.address else {}),
            }
            for r in reports
        ],
    }


class _Merged(Collector):
    def __init__(self, reports: Sequence[ReplicaReport]) -> None:
        self.reports = reports

    def collect(self) -> Iterator[Metric]:
        replicas = GaugeMetricFamily("omnirt_replicas", "Replicas reporting to the fleet")
        replicas.add_metric([], len(self.reports))
        yield replicas
        families: dict[str, Metric] = {}
        for report in self.reports:
            for family in report.metrics:
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                merged.samples.extend(
                    s._replace(labels={**s.labels, REPLICA_LABEL: report.replica}) for s in family.samples
                )
        yield from families.values()


def fleet_metrics(reports: Sequence[ReplicaReport]) -> bytes:
    """The ``/metrics`` body (Prometheus text) for the fleet."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(reports))
    return generate_latest(registry)
