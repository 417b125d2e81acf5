"""Start the fleet: ``deploy`` (from Python, returns at once) and ``serve_replicas`` (the CLI's
``omnirt serve --replicas N``, runs until SIGINT/SIGTERM).

Both connect to Ray (:func:`connect_ray`: ``ray_address``, or the cluster this process already
joined; none: Ray's own rules, ``RAY_ADDRESS``, else a cluster that ``ray start`` began on this
machine, else a new local instance), start Ray Serve's HTTP proxies on the server's
``host``/``port`` (or check that the Serve already running on the cluster listens there:
:func:`start_serve`), and run one application: the omnirt replicas (:mod:`.deployment`), routed
by :class:`~.router.SessionAwareRouter`, beside the small ``OmnirtFleet`` deployment that gathers
their health and metrics (:mod:`.fleet`).

A cluster is shared: ``serve_replicas`` removes only its own application when it stops, shuts
Ray Serve down only when it started it and no other application runs on it, and stops Ray only
when it started it (leaving a joined cluster disconnects this process only).

The ingress (``ingress``): Ray Serve's HTTP proxy with omnirt's request router (``proxy``, the
default), or HAProxy in front of replicas that serve HTTP themselves, omnirt's routing done in the
replicas (``haproxy``: :mod:`.ingress`; Ray Serve's settings for it, :data:`~.ingress.HAPROXY_ENV`,
go into the environment before a local Ray starts, and a joined cluster must have been started
with them).

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
import os
import signal
import threading
from dataclasses import dataclass, field
from typing import Any

from ..config import ServerConfig
from .ingress import HAPROXY_ENV, INGRESSES

log = logging.getLogger("omnirt.serve")

REPLICA_DEPLOYMENT = "OmnirtReplica"
FLEET_DEPLOYMENT = "OmnirtFleet"
#: Environment variables of this process that every replica gets too (Ray's worker processes
#: have the environment of their node's ``ray start``, not this one's, on a joined cluster).
REPLICA_ENV = ("OMNIRT_CACHE",)
#: Ray Serve's settings for its shortest request path, the defaults of the Ray instance this
#: process starts (each Ray process reads them from its environment when it starts; a cluster
#: that ``ray start`` began has its nodes' environment). The proxy talks to replicas over gRPC
#: rather than Ray actor calls, and runs its router on its own event loop; a replica runs the
#: application on its main event loop, not a thread of its own. Each hop a realtime event takes
#: through the proxy is shorter: ``benchmarks/scale.py`` measured the added latency per event
#: at about 0.8 ms with them and 1.1 to 1.3 ms without (``docs/benchmarks.md``). A value set in
#: the environment wins.
SERVE_ENV = {
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
}


#: Ray Serve's setting for how long a removed replica behind HAProxy keeps its HTTP server (then
#: uvicorn's shutdown closes every WebSocket still open with 1012).
MIN_DRAINING_ENV = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
#: Seconds a replica may take to see that it is being removed (its poll of the controller) and to
#: close its sessions, past the drain and the shutdown grace.
DRAIN_SLACK_SECONDS = 2.0


def min_draining_seconds(drain_seconds: float, shutdown_grace_seconds: float) -> float:
    """How long Ray Serve must keep a removed replica's HTTP server behind HAProxy: its sessions'
    drain, their closing and the time to notice the removal. With less (:data:`HAPROXY_ENV`'s 5 s
    alone), Ray's server shutdown closed the sessions with 1012 before the drain's 1001. Below the
    force-kill deadline, ``graceful_shutdown_timeout_s`` (drain + grace + 5 s)."""
    return drain_seconds + shutdown_grace_seconds + DRAIN_SLACK_SECONDS


def set_serve_env(environ: dict[str, str] | None = None, *, ingress: str = "proxy") -> None:
    """:data:`SERVE_ENV` (and :data:`~.ingress.HAPROXY_ENV` for the ``haproxy`` ingress) into
    ``environ`` (default ``os.environ``) where not set already: call it before ``ray.init`` starts
    a local instance (:func:`connect_ray` does)."""
    environ = os.environ if environ is None else environ
    for name, value in {**SERVE_ENV, **(HAPROXY_ENV if ingress == "haproxy" else {})}.items():
        environ.setdefault(name, value)


@dataclass
class ReplicaOptions:
    #: Replicas to run (with autoscaling: to start with).
    replicas: int = 1
    #: Autoscaling bounds (either set: Ray Serve's autoscaler runs between them).
    min_replicas: int | None = None
    max_replicas: int | None = None
    #: A Ray cluster to join (``ray start --head`` gives it); None: Ray's rules (``RAY_ADDRESS``,
    #: else a cluster ``ray start`` began on this machine, else a new local instance).
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
    #: ``proxy``: Ray Serve's HTTP proxy routes with :class:`~.router.SessionAwareRouter`;
    #: ``haproxy``: HAProxy in front, omnirt's routing in the replicas (:mod:`.ingress`).
    ingress: str = "proxy"

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
        if self.ingress not in INGRESSES:
            raise ValueError(f"--ingress must be one of {', '.join(INGRESSES)}, not {self.ingress!r}")


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
        ingress=options.ingress,
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
        FleetStats,
        name=FLEET_DEPLOYMENT,
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        # Every replica's reports, video job shares and reads (each short) at once.
        max_ongoing_requests=256,
    ).bind(options.stale_seconds)
    # Behind HAProxy, Ray Serve refuses a custom router on the ingress deployment (HAProxy picks
    # the replica; omnirt routes in the replicas, :mod:`.ingress`).
    routing: dict[str, Any] = {}
    if options.ingress == "proxy":
        routing["request_router_config"] = RequestRouterConfig(
            request_router_class=SessionAwareRouter,
            request_router_kwargs={"session_capacity": config.max_sessions},
            request_routing_stats_period_s=options.stats_seconds,
            request_routing_stats_timeout_s=max(5.0, 5 * options.stats_seconds),
        )
    actor_options: dict[str, Any] = {"num_cpus": options.cpus_per_replica, "num_gpus": gpus}
    passed = (*REPLICA_ENV, *SERVE_ENV, *HAPROXY_ENV)
    env = {name: os.environ[name] for name in passed if os.environ.get(name)}
    if options.ingress == "haproxy":
        held = min_draining_seconds(options.drain_seconds, config.shutdown_grace_seconds)
        env[MIN_DRAINING_ENV] = str(held)
    if env:
        actor_options["runtime_env"] = {"env_vars": env}
    replica = serve.deployment(
        OmnirtIngress,
        name=REPLICA_DEPLOYMENT,
        ray_actor_options=actor_options,
        max_ongoing_requests=config.max_sessions + options.http_slots,
        # Sessions finish (or are closed by the drain) within this: then Ray Serve kills the replica.
        graceful_shutdown_timeout_s=options.drain_seconds + config.shutdown_grace_seconds + 5.0,
        graceful_shutdown_wait_loop_s=0.5,
        **routing,
        **scaling,
    )
    return replica.bind(config, device, load_format, settings, fleet)


def connect_ray(address: str | None, *, ingress: str = "proxy") -> None:
    """Join Ray (see the module for ``None``); ConnectionError saying why not (an unreachable
    address, a cluster that wants a token this process lacks, ...)."""
    import ray

    set_serve_env(ingress=ingress)
    try:
        ray.init(address=address)
    except Exception as exc:
        where = f"the Ray cluster at {address}" if address else "Ray"
        raise ConnectionError(f"cannot connect to {where}: {_root_cause(exc)}") from exc


def _root_cause(exc: BaseException) -> str:
    """The innermost exception's message (Ray wraps the reason, an authentication error say)."""
    seen = {id(exc)}
    while (inner := exc.__cause__ or exc.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        exc = inner
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__


def serve_running() -> bool:
    """Whether Ray Serve runs on the cluster this process joined (its controller is alive)."""
    from ray.serve.context import _get_global_client

    return _get_global_client(raise_if_no_controller_running=False) is not None


def start_serve(config: ServerConfig) -> None:
    """Ray Serve's HTTP proxies on ``config.host``/``config.port``. When Serve already runs on the
    cluster, its proxies must listen there: its HTTP options are the cluster's, fixed while it
    runs (``serve.start`` would ignore new ones with a warning); ValueError otherwise."""
    from ray import serve
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        serve.start(http_options={"host": config.host, "port": config.port})
        return
    http = client.http_config
    if (http.host, http.port) != (config.host, config.port):
        where = f"{http.host}:{http.port}" if http.host else "no HTTP proxy (disabled)"
        raise ValueError(
            f"Ray Serve already runs on this cluster with its HTTP proxies on {where}, not "
            f"{config.host}:{config.port}; its HTTP options are fixed while it runs: pass --host "
            f"{http.host} --port {http.port}, or shut that Serve down first (serve shutdown)"
        )


def run_fleet(
    config: ServerConfig,
    options: ReplicaOptions,
    *,
    device: str | None,
    load_format: str,
    log_level: str,
) -> str:
    """Run the application on the Serve this process started or checked (:func:`start_serve`);
    returns its base URL once every replica serves."""
    import ray
    from ray import serve

    if device is None and options.gpus_per_replica is None and ray.cluster_resources().get("GPU", 0) >= 1:
        device = "cuda"
    app = application(config, options, device=device, load_format=load_format, log_level=log_level)
    serve.run(app, name=options.app_name, route_prefix="/", blocking=False)
    if options.ingress == "haproxy" and not behind_haproxy(options.app_name):
        serve.delete(options.app_name)
        raise ValueError(
            "--ingress haproxy: Ray Serve on this cluster runs without HAProxy; start the cluster with "
            + " ".join(f"{k}={v}" for k, v in HAPROXY_ENV.items())
            + " in the environment of `ray start` (a Ray that omnirt starts gets them itself)"
        )
    base = f"http://{config.host}:{config.port}"
    log.info(
        "serving %s on %s: %s replicas behind %s, up to %d realtime sessions each",
        options.app_name,
        base,
        "{}..{}".format(*options.bounds()) if options.autoscaling else options.replicas,
        "HAProxy" if options.ingress == "haproxy" else "Ray Serve's proxy",
        config.max_sessions,
    )
    return base


def behind_haproxy(app_name: str) -> bool:
    """Whether Ray Serve sends the application's traffic to its replicas' own HTTP servers (direct
    ingress, which HAProxy fronts) rather than through its HTTP proxies."""
    import ray

    from .drain import serve_controller

    groups = ray.get(serve_controller().get_target_groups.remote(app_name, from_proxy_manager=True))
    return any(f"#{REPLICA_DEPLOYMENT}#" in t.name for g in groups for t in g.targets)


def deploy(
    config: ServerConfig,
    options: ReplicaOptions,
    *,
    device: str | None = None,
    load_format: str = "auto",
    log_level: str = "info",
) -> str:
    """Run the fleet on Ray (joined or started, see the module) and return its base URL once every
    replica serves. ValueError for options that cannot work (or a running Serve listening
    elsewhere); ConnectionError when Ray cannot be joined; Ray Serve's error when a replica fails
    to start (a model that cannot load, say). Deploying again under the same ``app_name``
    updates that application in place (Ray Serve's redeploy)."""
    import ray

    options.validate()
    check_config(config, device)
    if not ray.is_initialized():
        connect_ray(options.ray_address, ingress=options.ingress)
    start_serve(config)
    return run_fleet(config, options, device=device, load_format=load_format, log_level=log_level)


def serve_replicas(
    config: ServerConfig,
    options: ReplicaOptions,
    *,
    device: str | None = None,
    load_format: str = "auto",
    log_level: str = "info",
) -> int:
    """``omnirt serve --replicas N``: deploy, serve until SIGINT/SIGTERM, then remove the fleet
    (replicas drain) and leave the cluster as it was (see the module). Returns the exit status."""
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
        try:
            connect_ray(options.ray_address, ingress=options.ingress)
        except ConnectionError as exc:
            log.error("%s", exc)
            return 1
    log.info("on Ray at %s", ray.get_runtime_context().gcs_address)
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
    status = 0
    ours = False  # whether the application under our name is ours to remove
    started_serve = False
    try:
        if options.app_name in serve.status().applications:
            raise ValueError(
                f"an application named {options.app_name!r} already runs on this Ray cluster (another "
                "omnirt serve --replicas?): stop it first, or redeploy it from Python (deploy())"
            )
        started_serve = not serve_running()
        start_serve(config)
        ours = True  # a failed serve.run may leave the application behind
        run_fleet(config, options, device=device, load_format=load_format, log_level=log_level)
        serving = True
        stop.wait()
    except KeyboardInterrupt:
        log.info("stopped while the replicas were starting")
    except Exception as exc:
        log.error("the replicas did not start: %s", exc)
        status = 1
    if ours and status == 0:
        log.info("stopping: the replicas drain (live sessions get %gs)", options.drain_seconds)
    _leave_serve(options.app_name, remove_app=ours, started_serve=started_serve)
    _stop_ray(joined)
    return status


def _leave_serve(app_name: str, *, remove_app: bool, started_serve: bool) -> None:
    """Remove our application (its replicas drain: ``serve.delete`` returns once they are gone),
    and Ray Serve too when this process started it and nothing else runs on it."""
    from ray import serve

    with contextlib.suppress(Exception):  # a Ray that went away: nothing left to remove
        if remove_app:
            serve.delete(app_name)
        others = sorted(serve.status().applications)
        if started_serve and not others:
            serve.shutdown()
        elif serve_running():
            log.info(
                "Ray Serve keeps running on the cluster (%s)",
                f"applications: {', '.join(others)}" if others else "it ran before this command",
            )


def _stop_ray(joined: bool) -> None:
    import ray

    if not joined and ray.is_initialized():
        ray.shutdown()
