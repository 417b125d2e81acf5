"""``omnirt serve --replicas`` options: what they become, and the clear errors of those that
cannot work (no Ray is started here)."""

from __future__ import annotations

import pytest
from omnirt.realtime.cli import build_parser, main, replica_options, replicas_wanted


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--replicas", "0"], "must be at least 1"),
        (["--replicas", "two"], "not an integer"),
        (["--min-replicas", "3", "--max-replicas", "2"], "make no range"),
        (["--replicas", "5", "--max-replicas", "2"], "outside 1..2"),
        (["--replicas", "2", "--metrics-host", "127.0.0.1:9100"], "--metrics-host is not available"),
        (["--replicas", "2", "--device", "cuda:1"], "use --device cuda"),
        (["--replicas", "2", "--replica-cpus", "-1"], "must be at least 0"),
        (["--replicas", "2", "--drain-seconds", "soon"], "not a number"),
        (["--replicas", "2", "--ingress", "nginx"], "invalid choice: 'nginx'"),
    ],
)
def test_replica_option_errors_exit_2_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_replica_options_from_the_command_line() -> None:
    args = build_parser().parse_args(["serve", "--port", "9000"])
    assert not replicas_wanted(args)  # a single process, as before

    args = build_parser().parse_args(
        ["serve", "--replicas", "2", "--replica-cpus", "2", "--drain-seconds", "5", "--ray-address", "h:6379"]
    )
    options = replica_options(args)
    assert replicas_wanted(args) and not options.autoscaling
    assert (options.replicas, options.cpus_per_replica, options.drain_seconds) == (2, 2.0, 5.0)
    assert options.ray_address == "h:6379"
    assert options.ingress == "proxy"  # Ray Serve's proxy unless asked
    assert replica_options(
        build_parser().parse_args(["serve", "--replicas", "2", "--ingress", "haproxy"])
    ).ingress == ("haproxy")

    options = replica_options(
        build_parser().parse_args(["serve", "--min-replicas", "0", "--max-replicas", "4"])
    )
    assert options.autoscaling and options.bounds() == (0, 4) and options.replicas == 1
    options.validate()


def test_an_unknown_ingress_from_python_is_refused() -> None:
    from omnirt.realtime.replicas import ReplicaOptions

    with pytest.raises(ValueError, match="--ingress must be one of proxy, haproxy"):
        ReplicaOptions(ingress="nginx").validate()



def test_replicas_behind_haproxy_keep_their_server_through_the_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray Serve shuts a removed replica's HTTP server down once its draining period is over
    (closing open WebSockets with 1012): behind HAProxy the replicas get one that outlasts the
    sessions' drain and their closing (drain + grace + 2 s), below the force-kill deadline."""
    from omnirt.realtime.config import ServerConfig
    from omnirt.realtime.replicas.launch import MIN_DRAINING_ENV, ReplicaOptions, application

    monkeypatch.setenv(MIN_DRAINING_ENV, "5")  # the cluster's (HAPROXY_ENV): the replicas' own wins
    config = ServerConfig(models=["demo"], duplex_model="none", shutdown_grace_seconds=2.0)
    for ingress, wanted in (("haproxy", "37.0"), ("proxy", "5")):
        options = ReplicaOptions(drain_seconds=33.0, ingress=ingress)
        replica = application(config, options, device="cpu", load_format="auto")._bound_deployment
        env = (replica.ray_actor_options.get("runtime_env") or {}).get("env_vars", {})
        assert env.get(MIN_DRAINING_ENV) == wanted, (ingress, env)
