"""The request router of the omnirt deployment (a Ray Serve ``RequestRouter``; it runs in each
Ray Serve proxy and deployment handle, beside Ray's own routing loop).

Ray Serve asks it to rank the replicas for each request; its routing loop then checks that the
chosen one has room (``max_ongoing_requests``) and sends the request there. What is omnirt's:

- a realtime session (a WebSocket: the whole connection is one streaming request to one replica,
  so the replica chosen here serves every event of the session, for its life: that is the
  pinning) goes to the replica with the most free session slots; full replicas are skipped while
  another has room; when all are full it goes to one anyway, which refuses it with
  ``resource_exhausted`` (the single-process limit, ``--max-sessions``);
- a request on one video job (``/v1/videos/{id}`` and its ``/content``, any method) goes to the
  replica that holds the job, which its id names (:mod:`.video_ids`); only there (Ray Serve's loop
  waits while it has no room). When that replica is gone, to any (as below): the job died with
  it, and the replica answers 404 ``video_not_found``;
- any other request (chat, images, video creation and list, models, health, ...) goes to the
  least-loaded replica: the smallest engine queue (requests admitted or waiting) plus the requests
  this router has in flight there;
- replicas that drain come last.

Free slots come from what each replica reports (:class:`~.load.ReplicaLoad`, refreshed every
``request_routing_stats_period_s``), corrected by what this router itself saw since the report (a
report is up to a period old): sessions it opened count at once, sessions of its own that ended
after the report are taken off. Ties are broken in turn: each ranking starts one replica further
along (by replica id), so a burst of requests ranked before any of them is reported routed still
alternates between equally loaded replicas.
"""

from __future__ import annotations

import itertools
import logging
import pickle
import time
from collections import OrderedDict, defaultdict, deque
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from .load import ReplicaLoad
from .video_ids import owner_of, route_path

log = logging.getLogger(__name__)

#: Sessions' ends remembered per replica (seconds): a report older than this is stale anyway.
_ENDS_KEPT_SECONDS = 30.0
#: Request kinds remembered (by internal request id) between ranking and the routing callbacks;
#: past this many (requests that were never sent), the memory is cleared.
_MAX_REMEMBERED = 10_000


@dataclass(frozen=True)
class RequestKind:
    #: A WebSocket connection (a realtime session).
    websocket: bool = False
    #: The tag of the replica holding the video job the request is on (None: no such job).
    video_owner: str | None = None


OTHER = RequestKind()


def request_kind(request: PendingRequest) -> RequestKind:
    """What ``request`` is, from the ASGI scope inside it (Ray Serve's HTTP proxy sends each request
    to an ASGI ingress as a pickled ``StreamingHTTPRequest`` holding the scope); a request of
    another shape (a handle call) is :data:`OTHER`."""
    if not request.args:
        return OTHER
    arg: Any = request.args[0]
    if isinstance(arg, bytes | bytearray):
        try:
            arg = pickle.loads(arg)  # made by the proxy this router runs in
        except Exception:
            return OTHER
    scope = getattr(arg, "asgi_scope", None)
    if not isinstance(scope, dict):
        return OTHER
    if scope.get("type") == "websocket":
        return RequestKind(websocket=True)
    if scope.get("type") == "http":
        owner = owner_of(route_path(scope))
        if owner is not None:
            return RequestKind(video_owner=owner)
    return OTHER


class SessionAwareRouter(RequestRouter):
    """Realtime sessions to the most free session slots, a video job's requests to its replica,
    other requests to the least loaded.

    Not FIFO (``FIFOMixin``): a replica chosen for one request goes to that very request (a
    session's choice must not be handed to an earlier chat request)."""

    def initialize_state(self, session_capacity: int = 32, **kwargs: Any) -> None:
        #: Slots assumed for a replica that has not reported yet (``--max-sessions``).
        self.session_capacity = session_capacity
        #: Per replica, the realtime sessions / other requests this router sent there, not yet ended.
        self.sessions: defaultdict[ReplicaID, set[str]] = defaultdict(set)
        self.in_flight: defaultdict[ReplicaID, set[str]] = defaultdict(set)
        #: Per replica, when sessions this router sent there ended (``time.time()``).
        self.ended: defaultdict[ReplicaID, deque[float]] = defaultdict(deque)
        self._kinds: dict[str, RequestKind] = {}
        #: Requests whose end came before Ray Serve reported them routed (it reports the end from
        #: the result's done-callback, scheduled on the loop, and the routing once the replica's
        #: acceptance is read: a quick request's end can come first). Not counted when routed.
        self._ended_first: OrderedDict[tuple[ReplicaID, str], None] = OrderedDict()
        self._turns = itertools.count()

    # -- what a replica has ------------------------------------------------------------------
    def load(self, replica: RunningReplica) -> ReplicaLoad:
        """The replica's last report, corrected by what this router saw since: its sessions that
        ended after the report are taken off, and it has at least the sessions this router
        opened there and has not seen end."""
        rid = replica.replica_id
        reported = ReplicaLoad.from_stats(replica.routing_stats)
        mine = len(self.sessions.get(rid, ()))
        if reported is None:
            return ReplicaLoad(self.session_capacity, mine, len(self.in_flight.get(rid, ())))
        ended_since = sum(1 for t in self.ended.get(rid, ()) if t > reported.at)
        return ReplicaLoad(
            reported.session_capacity,
            max(reported.sessions_active - ended_since, mine),
            reported.engine_queue_depth,
            reported.draining,
            reported.engine_running,
            reported.at,
        )

    def _kind(self, request: PendingRequest) -> RequestKind:
        """The request's kind, its scope decoded once per request."""
        rid = request.metadata.internal_request_id
        known = self._kinds.get(rid)
        if known is None:
            if len(self._kinds) >= _MAX_REMEMBERED:
                self._kinds.clear()
            known = self._kinds[rid] = request_kind(request)
        return known

    # -- Ray Serve's RequestRouter interface -------------------------------------------------
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        kind = OTHER if pending_request is None else self._kind(pending_request)
        if kind.video_owner is not None:
            owner = [r for r in candidate_replicas if r.replica_id.unique_id == kind.video_owner]
            if owner:
                # Only the replica holding the job can answer for it. While it has no room, Ray
                # Serve's loop asks again after a backoff (without this flag, at once: a busy loop).
                pending_request.routing_context.should_backoff = True  # type: ignore[union-attr]
                return [owner]
        # Ties in turn: the candidates by id, rotated one further each ranking (the sorts below
        # are stable).
        order = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        turn = next(self._turns) % len(order)
        order = order[turn:] + order[:turn]
        loads = {r.replica_id: self.load(r) for r in order}
        if kind.websocket:
            ranked = sorted(
                order,
                key=lambda r: (loads[r.replica_id].draining, -loads[r.replica_id].free_session_slots),
            )
            with_room = [r for r in ranked if loads[r.replica_id].free_session_slots > 0]
            # All full: to the first anyway, which answers resource_exhausted.
            return [[r] for r in with_room] if with_room else [ranked[:1]]
        ranked = sorted(
            order,
            key=lambda r: (
                loads[r.replica_id].draining,
                loads[r.replica_id].engine_queue_depth + len(self.in_flight.get(r.replica_id, ())),
            ),
        )
        return [[r] for r in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        rid = pending_request.metadata.internal_request_id
        if (replica_id, rid) in self._ended_first:
            del self._ended_first[(replica_id, rid)]  # over already
            return
        if self._kind(pending_request).websocket:
            self.sessions[replica_id].add(rid)
        else:
            self.in_flight[replica_id].add(rid)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._kinds.pop(internal_request_id, None)
        sessions = self.sessions.get(replica_id)
        if sessions is not None and internal_request_id in sessions:
            sessions.discard(internal_request_id)
            if not sessions:
                del self.sessions[replica_id]
            now = time.time()
            ends = self.ended[replica_id]
            ends.append(now)
            while ends and ends[0] < now - _ENDS_KEPT_SECONDS:
                ends.popleft()
            return
        held = self.in_flight.get(replica_id)
        if held is not None and internal_request_id in held:
            held.discard(internal_request_id)
            if not held:
                del self.in_flight[replica_id]
            return
        # Not routed yet (or never: a request the replica rejected, retried elsewhere).
        self._ended_first[(replica_id, internal_request_id)] = None
        if len(self._ended_first) > _MAX_REMEMBERED:
            self._ended_first.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        for table in (self.sessions, self.in_flight, self.ended):
            table.pop(replica_id, None)
