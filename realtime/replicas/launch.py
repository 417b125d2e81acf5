"""Start the fleet: ``deploy`` (from Python, returns at once) and ``serve_replicas`` (the CLI's
``omnirt serve --replicas N``, runs until SIGINT/SIGTERM).

Both connect to Ray (``ray_address``; none: a Ray instance of this machine is started, or the
one this process already joined is used), start Ray Serve's HTTP proxy on the server's
``host``/``port``, and run one application: the omnirt replicas (:mod:`.deployment`), routed by
:class:`~.router.SessionAwareRouter`, beside the small ``OmnirtFleet`` deployment that gathers
their health and metrics (:mod:`.fleet`).

Sizes: a replica takes ``gpus_per_replica`` GPUs (1 with ``--device cuda``: one replica per
GPU) and ``cpus_per_replica`` CPU slots. ``max_ongoing_requests`` of a replica is its session
limit plus ``http_slots``, so Ray Serve never queues a session in front of a replica that still
has a slot; the router keeps sessions off full replicas. Autoscaling (``min_replicas`` /
``max_replicas``) is Ray Serve's own: it keeps the ongoing requests per replica (its sessions
and in-flight HTTP requests) near ``target_session_share`` of the session limit.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from dataclasses import dataclass, field
from typing import Any

from ..config import ServerConfig

log = logging.getLogger("omnirt.serve")

REPLICA_DEPLOYMENT = "OmnirtReplica"
FLEET_DEPLOYMENT = "OmnirtFleet"


@dataclass
class ReplicaOptions:
    #: Replicas to run (with autoscaling: to start with).
    replicas: int = 1
    #: Autoscaling bounds (either set: Ray Serve's autoscaler runs between them).
    min_replicas: int | None = None
    max_replicas: int | None = None
    #: A Ray cluster to join (``ray start --head`` gives it); None: a local instance.
    ray_address: str | None = None
    cpus_per_replica: float = 1.0
    #: None: 1 when the device is CUDA (or none is given and Ray has GPUs), else 0.
    gpus_per_replica: float | None = None
    #: Autoscaling target: ongoing requests per replica as a share of its session limit.
    target_session_share: float = 0.75
    #: More of Ray Serve's ``autoscaling_config`` (``upscale_delay_s``, ``downscale_delay_s``,
    #: ``look_back_period_s``, ``metrics_interval_s``, ...), over the values derived here.
    autoscaling_overrides: dict[str, Any] = field(default_factory=dict)
    #: Concurrent HTTP requests a replica takes beside its sessions.
    http_slots: int = 64
    #: A removed replica's live sessions may go on this long before they are closed (1001).
    drain_seconds: float = 30.0
    #: Seconds between replicas' load reports to the router and to the fleet.
    stats_seconds: float = 1.0
    #: A replica that has not reported for this long is left out of /health and /metrics.
    stale_seconds: float = 3.0
    app_name: str = "omnirt"

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    def bounds(self) -> tuple[int, int]:
        low = self.min_replicas if self.min_replicas is not None else 1
        high = self.max_replicas if self.max_replicas is not None else max(low, self.replicas)
        return low, high

    def validate(self) -> None:
        """ValueError saying what is wrong."""
        if self.replicas < 1:
            raise ValueError(f"--replicas must be at least 1, not {self.replicas}")
        if self.autoscaling:
            low, high = self.bounds()
            if low < 0 or high < 1 or low > high:
                raise ValueError(f"--min-replicas {low} and --max-replicas {high} make no range")
            if not low <= self.replicas <= high:
                raise ValueError(f"--replicas {self.replicas} (the start) is outside {low}..{high}")
        if self.cpus_per_replica < 0 or (self.gpus_per_replica or 0) < 0:
            raise ValueError("CPUs and GPUs per replica cannot be negative")
        if not 0 < self.target_session_share <= 1:
            raise ValueError(f"the session share must be in (0, 1], not {self.target_session_share}")
        if self.drain_seconds < 0:
            raise ValueError(f"--drain-seconds cannot be negative, not {self.drain_seconds}")


def check_config(config: ServerConfig, device: str | None) -> None:
    """What a single process takes but a fleet cannot: ValueError saying why."""
    if config.metrics_host is not None:
        raise ValueError(
            "--metrics-host is not available with --replicas: every replica would bind it; /metrics "
            "on the API port answers for all replicas"
        )
    if device is not None and device.startswith("cuda:"):
        raise ValueError(
            f"--device {device} names one GPU; with --replicas each replica gets its own: use --device cuda"
        )


def application(
    config: ServerConfig,
    options: ReplicaOptions,
    *,
    device: str | None,
    load_format: str,
    log_level: str = "info",
) -> Any:
    """The Ray Serve application (``serve.run`` takes it)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from .deployment import OmnirtIngress, ReplicaSettings
    from .fleet import FleetStats
    from .router import SessionAwareRouter

    gpus = options.gpus_per_replica
    if gpus is None:
        gpus = 1.0 if device is not None and device.startswith("cuda") else 0.0
    settings = ReplicaSettings(
        app_name=options.app_name,
        report_seconds=options.stats_seconds,
        drain_seconds=options.drain_seconds,
        poll_seconds=min(1.0, options.stats_seconds),
        log_level=log_level,
    )
    scaling: dict[str, Any]
    if options.autoscaling:
        low, high = options.bounds()
        scaling = {
            "autoscaling_config": {
                "min_replicas": low,
                "initial_replicas": options.replicas,
                "max_replicas": high,
                "target_ongoing_requests": max(1.0, config.max_sessions * options.target_session_share),
                **options.autoscaling_overrides,
            }
        }
    else:
        scaling = {"num_replicas": options.replicas}
    fleet = serve.deployment(
        FleetStats, name=FLEET_DEPLOYMENT, num_replicas=1, ray_actor_options={"num_cpus": 0}
    ).bind(options.stale_seconds)
    replica = serve.deployment(
        OmnirtIngress,
        name=REPLICA_DEPLOYMENT,
        ray_actor_options={"num_cpus": options.cpus_per_replica, "num_gpus": gpus},
        max_ongoing_requests=config.max_sessions + options.http_slots,
        # Sessions finish (or are closed by the drain) within this: then Ray Serve kills the replica.
        graceful_shutdown_timeout_s=options.drain_seconds + config.shutdown_grace_seconds + 5.0,
        graceful_shutdown_wait_loop_s=0.5,
        request_router_config=RequestRouterConfig(
            request_router_class=SessionAwareRouter,
            request_router_kwargs={"session_capacity": config.max_sessions},
            request_routing_stats_period_s=options.stats_seconds,
            request_routing_stats_timeout_s=max(5.0, 5 * options.stats_seconds),
        ),
        **scaling,
    )
    return replica.bind(config, device, load_format, settings, fleet)


def deploy(
    config: ServerConfig,
    options: ReplicaOptions,
    *,
    device: str | None = None,
    load_format: str = "auto",
    log_level: str = "info",
) -> str:
    """Run the fleet on Ray (joined or started, see the module) and return its base URL once every
    replica serves. ValueError for options that cannot work; Ray Serve's error when a replica
    fails to start (a model that cannot load, say)."""
    import ray
    from ray import serve

    options.validate()
    check_config(config, device)
    if not ray.is_initialized():
        ray.init(address=options.ray_address)
    if device is None and options.gpus_per_replica is None and ray.cluster_resources().get("GPU", 0) >= 1:
        device = "cuda"
    serve.start(http_options={"host": config.host, "port": config.port})
    app = application(config, options, device=device, load_format=load_format, log_level=log_level)
    serve.run(app, name=options.app_name, route_prefix="/", blocking=False)
    base = f"http://{config.host}:{config.port}"
    log.info(
        "serving %s on %s: %s replicas behind Ray Serve's proxy, up to %d realtime sessions each",
        options.app_name,
        base,
        "{}..{}".format(*options.bounds()) if options.autoscaling else options.replicas,
        config.max_sessions,
    )
    return base


def serve_replicas(
    config: ServerConfig,
    options: ReplicaOptions,
    *,
    device: str | None = None,
    load_format: str = "auto",
    log_level: str = "info",
) -> int:
    """``omnirt serve --replicas N``: deploy, serve until SIGINT/SIGTERM, then remove the fleet
    (replicas drain) and stop Ray when this process started it. Returns the exit status."""
    try:
        options.validate()
        check_config(config, device)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        log.error("--replicas needs Ray Serve (%s): pip install 'omnirt[ray]'", exc)
        return 1
    joined = ray.is_initialized()
    if not joined:
        ray.init(address=options.ray_address)
    # After ray.init, which sets a SIGTERM handler of its own. A signal while the fleet starts
    # interrupts the start (a fleet that cannot be placed would wait forever); once it serves, it
    # ends the wait below.
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        if not serving:
            raise KeyboardInterrupt
        stop.set()

    serving = False
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        deploy(config, options, device=device, load_format=load_format, log_level=log_level)
        serving = True
        stop.wait()
    except KeyboardInterrupt:
        log.info("stopped while the replicas were starting")
    except Exception as exc:
        log.error("the replicas did not start: %s", exc)
        _stop_ray(joined)
        return 1
    log.info("stopping: the replicas drain (live sessions get %gs)", options.drain_seconds)
    with contextlib.suppress(Exception):  # not deployed yet when stopped while starting
        serve.delete(options.app_name)
    serve.shutdown()
    _stop_ray(joined)
    return 0


def _stop_ray(joined: bool) -> None:
    import ray

    if not joined and ray.is_initialized():
        ray.shutdown()
