"""``omnirt serve --replicas 1`` as a user runs it: the real CLI in a process of its own, which
starts Ray, runs the fleet behind Ray Serve's proxy, serves, and on SIGTERM removes the fleet and
stops Ray (exit 0)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.server import serve_cli_process

try:
    import ray  # noqa: F401  (the ray extra: the CLI's replicas need it)
except ImportError as exc:  # pragma: no cover - depends on the install
    if os.environ.get("CI"):
        pytest.fail(f"ray[serve] is not installed ({exc}): CI must run the replica tests", pytrace=False)
    pytest.skip(f"ray[serve] is not installed ({exc}): pip install -e '.[ray]'", allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_omnirt_serve_replicas_serves_and_stops_on_sigterm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    args = ["--replicas", "1", "--device", "cpu", "--model", "demo", "--duplex-model", "none"]
    args += ["--max-sessions", "1", "--drain-seconds", "1"]
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
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-3000:]
    text = log.read_text()
    # (the fleet serves before the command's start-up returns: a SIGTERM then interrupts the start)
    assert "stopping: the replicas drain" in text, text[-3000:]
