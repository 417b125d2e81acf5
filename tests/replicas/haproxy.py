"""Ray Serve's HAProxy settings for a test's own Ray instance (``--ingress haproxy``)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tests.server import free_port


@contextlib.contextmanager
def haproxy_settings() -> Iterator[dict[str, str]]:
    """Environment for HAProxy's files and ports away from Ray's defaults (``/tmp/haproxy-serve``,
    8404, 9101: another Ray on the machine may hold them). The folder is short: Ray adds a
    40-character one under it, and HAProxy's socket path must stay under 98 characters."""
    files = Path(tempfile.mkdtemp(prefix="omnirt-hap-"))
    try:
        yield {
            "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(files / "haproxy.cfg"),
            "RAY_SERVE_HAPROXY_SOCKET_PATH": str(files / "admin.sock"),
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(files),
            "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(files / "server-state"),
            "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
        }
    finally:
        shutil.rmtree(files, ignore_errors=True)
