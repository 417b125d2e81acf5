"""How a replica learns that Ray Serve is removing it (scale-down, redeploy, ``serve.shutdown``).

Ray Serve 2.60 tells the user code of a replica nothing when it starts to remove it: it stops
routing to it, waits up to ``graceful_shutdown_timeout_s`` for its ongoing requests (a realtime
session is one, for its whole life) and then kills it; ``__del__`` only runs once every request
has ended. So the replica asks Ray Serve's controller, every ``poll_seconds``, for the state of
its own replica (the controller's deployment details, as the dashboard reads them): once it is
``STOPPING`` the replica drains (``RealtimeService.drain``), so its live sessions end cleanly
(1001) within the timeout instead of being cut by the kill. The controller's handle is looked up
once, on a thread (``ray.get_actor`` blocks, and the replica's app runs on Ray's main event loop:
``SERVE_ENV``), and again only after a poll failed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import ray

log = logging.getLogger(__name__)

#: Replica states in which a replica is on its way out.
LEAVING = frozenset({"STOPPING", "STOPPED"})


def serve_controller() -> Any:
    """The handle of Ray Serve's controller actor (a blocking lookup)."""
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    return ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)


async def own_state(controller: Any, app_name: str, deployment: str, replica_id: str) -> str | None:
    """This replica's state as Ray Serve's controller has it (None: not listed)."""
    details = await controller.get_deployment_details.remote(app_name, deployment)
    for replica in details.replicas:
        if replica.replica_id == replica_id:
            return str(getattr(replica.state, "value", replica.state))
    return None


async def watch_for_removal(
    app_name: str,
    deployment: str,
    replica_id: str,
    on_removal: Callable[[], Awaitable[None]],
    *,
    poll_seconds: float = 1.0,
) -> None:
    """Poll until this replica is being removed, then await ``on_removal()`` (once)."""
    controller = None
    while True:
        await asyncio.sleep(poll_seconds)
        try:
            if controller is None:
                controller = await asyncio.to_thread(serve_controller)
            state = await own_state(controller, app_name, deployment, replica_id)
        except Exception as exc:  # the controller restarting: look it up and ask again
            log.debug("cannot read the replica's state: %s", exc)
            controller = None
            continue
        if state in LEAVING:
            log.info("replica %s is being removed (%s): draining", replica_id, state)
            await on_removal()
            return
