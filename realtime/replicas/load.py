"""What a replica reports to the router: its session slots, engine queue and whether it drains.

A replica's :meth:`~.deployment.OmnirtReplica.record_routing_stats` returns
:meth:`ReplicaLoad.to_stats` (a plain dict: Ray Serve carries it from the replica to every router
as ``RunningReplica.routing_stats``); the router reads it back with :meth:`ReplicaLoad.from_stats`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class ReplicaLoad:
    #: The replica's realtime session limit (``--max-sessions``) and its open sessions.
    session_capacity: int
    sessions_active: int
    #: Engine requests admitted to a pipeline plus those waiting for a slot (all kinds).
    engine_queue_depth: int
    #: The replica is being removed: it admits no new sessions.
    draining: bool = False
    #: Whether its engine thread runs.
    engine_running: bool = True
    #: When the replica took these numbers (``time.time()``; 0: unknown).
    at: float = 0.0

    @property
    def free_session_slots(self) -> int:
        return 0 if self.draining else max(0, self.session_capacity - self.sessions_active)

    def to_stats(self) -> dict[str, Any]:
        return {**asdict(self), "free_session_slots": self.free_session_slots}

    @classmethod
    def from_stats(cls, stats: dict[str, Any] | None) -> ReplicaLoad | None:
        """The load in ``stats``; None when the replica has not reported yet (or reports other keys)."""
        if not stats:
            return None
        try:
            return cls(**{f.name: stats[f.name] for f in fields(cls)})
        except (KeyError, TypeError):
            return None
