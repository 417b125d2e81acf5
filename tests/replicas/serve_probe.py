"""A Ray driver of its own for tests/replicas/test_cli_replicas.py, run as a process (the test
process never joins Ray: its Ray settings, such as token authentication, stay as they were):

- ``python -m tests.replicas.serve_probe status ADDRESS``: prints, as JSON, whether Ray Serve runs
  on the cluster, its applications (name -> status) and the cluster's live nodes;
- ``python -m tests.replicas.serve_probe other ADDRESS HOST PORT``: starts Ray Serve with its
  proxies on HOST:PORT (as another user of the cluster would) and runs a small application,
  ``other``, on ``/other`` that answers ``other``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import ray
from ray import serve
from ray.serve.context import _get_global_client

OTHER_APP = "other"
OTHER_ROUTE = "/other"


def status(address: str) -> dict[str, Any]:
    ray.init(address=address, log_to_driver=False)
    try:
        running = _get_global_client(raise_if_no_controller_running=False) is not None
        apps = serve.status().applications if running else {}
        return {
            "serve": running,
            "applications": {name: str(getattr(a.status, "value", a.status)) for name, a in apps.items()},
            "nodes": sum(1 for node in ray.nodes() if node["Alive"]),
        }
    finally:
        ray.shutdown()


def run_other(address: str, host: str, port: int) -> None:
    @serve.deployment(name="Other", num_replicas=1, ray_actor_options={"num_cpus": 0})
    class Other:  # defined here: Ray pickles it by value, the workers need no import of this module
        async def __call__(self, request: Any) -> str:
            return OTHER_APP

    ray.init(address=address, log_to_driver=False)
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(Other.bind(), name=OTHER_APP, route_prefix=OTHER_ROUTE, blocking=False)
    finally:
        ray.shutdown()


def main(argv: list[str]) -> int:
    command, address, *rest = argv
    if command == "status":
        print(json.dumps(status(address)))
    elif command == "other":
        host, port = rest
        run_other(address, host, int(port))
    else:
        raise SystemExit(f"unknown command {command!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
