"""omnirt on Ray Serve: N replicas behind Ray Serve's HTTP proxy (or its HAProxy), with
session-aware routing.

``omnirt serve --replicas N`` (or :func:`serve_replicas` / :func:`deploy` from Python) runs N
omnirt servers as one Ray Serve deployment; docs/replicas.md explains the design. Needs the
``ray`` extra (``pip install 'omnirt[ray]'``); importing this package imports no Ray.
"""

from __future__ import annotations

from .launch import ReplicaOptions, deploy, serve_replicas

__all__ = ["ReplicaOptions", "deploy", "serve_replicas"]
