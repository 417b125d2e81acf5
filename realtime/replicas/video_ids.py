"""Video job ids that name their replica, and the replica a request's path names.

A ``/v1/videos`` job lives in the memory of the replica that took its ``POST``. Under replicas its
id carries that replica's tag (Ray Serve's ``replica_context.replica_tag``, which is the router's
``RunningReplica.replica_id.unique_id``; 8 lower-case letters and digits in Ray 2.60):
``video_<tag>_<random>``, 32 characters as one process's ``video_<random>``. The router reads the
tag back from ``/v1/videos/{id}`` and ``/v1/videos/{id}/content`` (:func:`owner_of`) and sends the
request to that replica. One process's ids (``video_`` + 20 letters and digits) name no replica.
"""

from __future__ import annotations

import re

from ..ids import MAX_ID_LENGTH, new_id

PREFIX = "video"
#: A tag that fits an id (and leaves at least 15 random characters: over 89 bits).
_TAG = re.compile(r"[A-Za-z0-9]{1,10}")
#: ``/v1/videos/{id}`` and ``/v1/videos/{id}/content`` for an id that names a replica.
_PATH = re.compile(rf"/v1/videos/{PREFIX}_([A-Za-z0-9]{{1,10}})_[A-Za-z0-9]+(?:/content)?/?")


def fits(tag: str) -> bool:
    """Whether ``tag`` can go into job ids (else the replica's jobs are not pinned)."""
    return _TAG.fullmatch(tag) is not None


def job_id(tag: str) -> str:
    """A new job id naming the replica ``tag`` (one that :func:`fits`)."""
    if not fits(tag):
        raise ValueError(f"replica tag {tag!r} cannot go into a video id")
    prefix = f"{PREFIX}_{tag}"
    return new_id(prefix, random_chars=MAX_ID_LENGTH - len(prefix) - 1)


def owner_of(path: str) -> str | None:
    """The replica tag of the video job that ``path`` (the app's route path) names, if any."""
    match = _PATH.fullmatch(path)
    return match.group(1) if match else None


def route_path(scope: dict[str, object]) -> str:
    """The path the app routes on: the ASGI ``path`` less its ``root_path`` (Ray Serve's proxy sets
    ``root_path`` to a route prefix other than ``/``, and to its ``http_options.root_path``)."""
    path = str(scope.get("path", ""))
    root = str(scope.get("root_path", "") or "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("", "/"):
        return path[len(root) :]
    return path
