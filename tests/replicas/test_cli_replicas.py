"""``omnirt serve --replicas`` as a user runs it: the real CLI in a process of its own.

- Alone: it starts Ray, runs the fleet behind Ray Serve's proxy (or HAProxy: ``--ingress
  haproxy``), serves, and on SIGTERM removes the fleet and stops Ray (exit 0).
- Joining a Ray cluster (``--ray-address``) that ``ray start --head`` began: it serves there (a
  chat and a realtime session through the proxy) and on SIGTERM removes only what it added,
  leaving the cluster up; on a cluster where Ray Serve already runs another application, it
  refuses a port other than that Serve's, serves beside that application and leaves it running;
  a second fleet under the same name is refused; ``--ingress haproxy`` on a cluster started
  without Ray Serve's HAProxy settings is refused.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets
from omnirt.realtime.replicas.launch import SERVE_ENV
from openai import OpenAI

from tests.realtime.conftest import MANUAL_TURNS, MAX_FRAME, Client, text_item
from tests.replicas.haproxy import haproxy_settings
from tests.server import cli_env, free_port, serve_cli_process

try:
    import ray  # noqa: F401  (the ray extra: the CLI's replicas need it)
except ImportError as exc:  # pragma: no cover - depends on the install
    if os.environ.get("CI"):
        pytest.fail(f"ray[serve] is not installed ({exc}): CI must run the replica tests", pytrace=False)
    pytest.skip(f"ray[serve] is not installed ({exc}): pip install -e '.[ray]'", allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "demo-qwen3-omni"
REPLICA_ARGS = ["--replicas", "1", "--device", "cpu", "--model", "demo", "--duplex-model", "none"]
REPLICA_ARGS += ["--max-sessions", "1", "--drain-seconds", "1"]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def haproxy_files(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with haproxy_settings() as env:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        yield


@pytest.mark.parametrize("ingress", ["proxy", "haproxy"])
def test_omnirt_serve_replicas_serves_and_stops_on_sigterm(
    ingress: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, haproxy_files: None
) -> None:
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    args = [*REPLICA_ARGS, "--ingress", ingress]
    log = tmp_path / "serve.log"
    with serve_cli_process(args, cache=tmp_path / "cache", log=log, start_timeout=180) as (base, proc):
        health = httpx.get(base + "/health", timeout=10).json()
        assert health["status"] == "ok" and health["model"] == "demo-qwen3-omni"
        reply = OpenAI(
            api_key="k", base_url=base + "/v1", max_retries=0
        ).chat.completions.with_raw_response.create(
            model="demo-qwen3-omni", messages=[{"role": "user", "content": "hello"}], max_tokens=4
        )
        assert reply.parse().usage.completion_tokens > 0
        assert reply.headers["x-omnirt-replica"] in {r["replica"] for r in health["replicas"]}
        assert asyncio.run(realtime_turn(base)) in {r["replica"] for r in health["replicas"]}
        # Behind HAProxy the replica serves HTTP itself, on a port of its own (in its reports
        # once Ray Serve has started that server).
        deadline = time.monotonic() + 10
        while ingress == "haproxy" and "address" not in health["replicas"][0]:
            assert time.monotonic() < deadline, health
            time.sleep(0.2)
            health = httpx.get(base + "/health", timeout=10).json()
        if ingress == "haproxy":
            address = health["replicas"][0]["address"]
            assert httpx.get(f"http://{address}/v1/models", timeout=10).status_code == 200
        else:
            assert "address" not in health["replicas"][0], health
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-3000:]
    text = log.read_text()
    # (the fleet serves before the command's start-up returns: a SIGTERM then interrupts the start)
    assert "stopping: the replicas drain" in text, text[-3000:]


# -- a Ray cluster of its own ----------------------------------------------------------------
@pytest.fixture
def ray_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A one-node Ray cluster as a user starts one (``ray start --head``: 2 CPU slots, a 100 MiB
    object store, token authentication with a token of its own); yields its address.

    ``--block`` keeps ``ray start`` in the foreground, so the cluster is stopped by signalling
    that process (it stops the processes it started), not by ``ray stop``, which stops every Ray
    on the machine. Its temp dir is its own (short: Ray's socket paths have a length limit), so
    no other ``ray.init()`` on the machine finds it."""
    token = tmp_path / "ray-token"
    token.write_text(secrets.token_hex(32))
    # Every process of the test that talks to the cluster (ray start, the probes, the CLI and its
    # replicas) has these; OMNIRT_CACHE is not the cluster's (the CLI passes its own on).
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    for name in ("RAY_AUTH_TOKEN", "RAY_ADDRESS", "OMNIRT_CACHE"):
        monkeypatch.delenv(name, raising=False)
    temp_dir = tempfile.mkdtemp(prefix="omnirt-ray-")
    port = free_port()
    cmd = [str(Path(sys.executable).with_name("ray")), "start", "--head", "--block", "--port", str(port)]
    cmd += ["--num-cpus", "2", "--object-store-memory", str(100 * 2**20), "--include-dashboard", "false"]
    cmd += ["--dashboard-port", str(free_port()), "--dashboard-agent-listen-port", str(free_port())]
    cmd += ["--ray-client-server-port", str(free_port()), "--temp-dir", temp_dir, "--disable-usage-stats"]
    log = tmp_path / "ray-head.log"
    with log.open("w") as out:
        # On SIGTERM the node drains first (up to 30 s by default, while Serve's actors live).
        # With Ray Serve's short request path, as docs/deploy.md tells a user to start a node.
        env = dict(os.environ, RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="2", **SERVE_ENV)
        head = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while "Ray runtime started" not in log.read_text():
            assert head.poll() is None, f"ray start exited: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"ray start did not come up: {log.read_text()[-3000:]}"
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        head.terminate()
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)  # the process group this fixture started
            head.wait(10)
        shutil.rmtree(temp_dir, ignore_errors=True)


def probe(*args: str) -> dict[str, Any] | None:
    """tests/replicas/serve_probe.py in a process of its own (a Ray driver from the repository root)."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.replicas.serve_probe", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else None


def refused_command(args: list[str], cache: Path) -> subprocess.CompletedProcess[str]:
    """``omnirt serve ARGS`` that must exit 1 at once (after joining Ray): its output."""
    done = subprocess.run(
        [sys.executable, "-m", "omnirt.realtime.cli", "serve", *args],
        env=cli_env(cache),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    return done


async def realtime_turn(base: str) -> str:
    """A realtime session through the proxy: one text turn; returns the replica that served it."""
    url = base.replace("http://", "ws://") + "/v1/realtime?model=" + MODEL
    async with websockets.connect(url, max_size=MAX_FRAME, open_timeout=30) as ws:
        client = Client(ws)
        assert (await client.recv(timeout=30))["type"] == "session.created"
        await client.send(MANUAL_TURNS)
        assert (await client.recv(timeout=30))["type"] == "session.updated"
        await client.send({"type": "conversation.item.create", "item": text_item("hello")})
        await client.send(
            {"type": "response.create", "response": {"output_modalities": ["text"], "max_output_tokens": 4}}
        )
        done = (await client.until("response.done", timeout=60))[-1]["response"]
        # Random weights: the reply may stop at the token limit (incomplete), never fail.
        assert done["status"] in ("completed", "incomplete"), done
        return ws.response.headers["x-omnirt-replica"]


def test_omnirt_serve_joins_a_ray_cluster_and_leaves_it_as_it_was(ray_cluster: str, tmp_path: Path) -> None:
    args = [*REPLICA_ARGS, "--ray-address", ray_cluster]

    # 1. A bare cluster: the command starts Ray Serve on it and runs the fleet there.
    cache, log = tmp_path / "cache", tmp_path / "serve.log"
    with serve_cli_process(args, cache=cache, log=log, start_timeout=180) as (base, proc):
        assert httpx.get(base + "/-/healthz", timeout=10).status_code == 200  # Ray Serve's proxy check
        health = httpx.get(base + "/health", timeout=10).json()
        replicas = {r["replica"] for r in health["replicas"]}
        assert health["status"] == "ok" and len(replicas) == 1, health
        reply = OpenAI(api_key="k", base_url=base + "/v1", max_retries=0).chat.completions.with_raw_response
        chat = reply.create(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4)
        assert chat.parse().usage.completion_tokens > 0
        assert chat.headers["x-omnirt-replica"] in replicas
        assert asyncio.run(realtime_turn(base)) in replicas
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-3000:]
    assert "stopping: the replicas drain" in log.read_text()
    # The replica built the demo model under the command's OMNIRT_CACHE, not the cluster's.
    assert cache.is_dir() and any(cache.iterdir()), "the replica did not get the command's OMNIRT_CACHE"
    # Its application and the Serve it started are gone; the cluster is up.
    assert probe("status", ray_cluster) == {"serve": False, "applications": {}, "nodes": 1}
    # HAProxy asked of a cluster started without Ray Serve's HAProxy settings: refused, saying
    # what to set, and the cluster left as it was.
    refused = refused_command([*args, "--ingress", "haproxy"], cache)
    assert "Ray Serve on this cluster runs without HAProxy" in refused.stderr, refused.stderr[-3000:]
    assert "RAY_SERVE_ENABLE_HA_PROXY=1" in refused.stderr
    assert probe("status", ray_cluster) == {"serve": False, "applications": {}, "nodes": 1}

    # 2. Ray Serve already runs on the cluster, with another application, its proxies on `port`.
    port = free_port()
    probe("other", ray_cluster, "127.0.0.1", str(port))
    assert httpx.get(f"http://127.0.0.1:{port}/other", timeout=10).text == "other"
    # Asked for another port: refused (Serve's HTTP options are the cluster's), nothing changed.
    refused = refused_command([*args, "--port", str(free_port())], cache)
    assert f"Ray Serve already runs on this cluster with its HTTP proxies on 127.0.0.1:{port}," in (
        refused.stderr
    )
    assert httpx.get(f"http://127.0.0.1:{port}/other", timeout=10).text == "other"
    # On its port: the fleet serves beside the other application and leaves it running.
    log = tmp_path / "serve-beside.log"
    with serve_cli_process(args, cache=cache, log=log, start_timeout=180, port=port) as (base, proc):
        assert httpx.get(base + "/health", timeout=10).json()["status"] == "ok"
        assert httpx.get(base + "/other", timeout=10).text == "other"
        # A second fleet under the same name: refused, the first one untouched.
        again = refused_command([*args, "--port", str(port)], cache)
        assert "an application named 'omnirt' already runs on this Ray cluster" in again.stderr
        assert httpx.get(base + "/health", timeout=10).json()["status"] == "ok"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-3000:]
    assert "Ray Serve keeps running on the cluster (applications: other)" in log.read_text()
    assert probe("status", ray_cluster) == {"serve": True, "applications": {"other": "RUNNING"}, "nodes": 1}
    assert httpx.get(f"http://127.0.0.1:{port}/other", timeout=10).text == "other"
