"""``/v1/videos`` jobs across the replicas: each replica shares its jobs' cards with the fleet, and
``GET /v1/videos`` on any replica lists every replica's jobs.

A job lives in the memory of the replica that took its ``POST`` (its id names that replica, so the
router sends the job's own requests there: :mod:`.video_ids`). What the others need for the list
is its public card: each replica sends the cards of all its jobs (:class:`SharedJobs`, numbered so
an older one arriving late never replaces a newer) to the ``OmnirtFleet`` deployment
(:class:`~.fleet.FleetStats`)

- at once, and awaited, on a create and a delete (the answer comes once the fleet has it: a list
  right after, on any replica, shows the new job and no longer the deleted one);
- at once on a status change (started, completed, failed), within ``throttle_seconds`` on progress;
- with every report (``report_seconds``): a job that expired or was dropped for room leaves then,
  and a restarted fleet deployment gets everything back.

The replica a list request reaches merges the fleet's cards with its own jobs taken fresh
(:func:`merge_jobs`), in creation order across the fleet, and pages them as one process pages its
store (:func:`~omnirt.realtime.http.video_jobs.page_of`). A replica that stops reporting (killed)
drops out after ``stale_seconds``; one being removed withdraws its jobs at once (they can no
longer be reached). A card in the list may lag the job's own ``GET`` by up to ``throttle_seconds``.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..http.video_jobs import Order, VideoJobStore, page_of
from ..ids import new_id
from .video_ids import PREFIX, fits, job_id

log = logging.getLogger(__name__)

#: A job as the fleet keeps it: when it was made (``VideoJob.created``) and its public card.
Shared = tuple[float, dict[str, Any]]


@dataclass
class SharedJobs:
    """The jobs of one replica, oldest first, as it last sent them."""

    replica: str
    #: Grows with every snapshot of the replica: the fleet keeps the highest.
    seq: int
    jobs: list[Shared] = field(default_factory=list)


def merge_jobs(
    own: SharedJobs, others: Iterable[SharedJobs], *, now: float | None = None
) -> list[dict[str, Any]]:
    """Every replica's cards, oldest first (``own`` in place of what the fleet holds for it): by
    creation time across replicas, each replica's in its own store's order. Cards past their
    ``expires_at`` are left out (their replica forgets them at its next look)."""
    now = time.time() if now is None else now
    replicas = {s.replica: s for s in others}
    replicas[own.replica] = own
    streams = [
        [(created, name, card) for created, card in shared.jobs]
        for name, shared in sorted(replicas.items())
    ]
    merged = heapq.merge(*streams, key=lambda entry: (entry[0], entry[1]))
    return [card for _, _, card in merged if card.get("expires_at") is None or card["expires_at"] > now]


class FleetVideoJobs:
    """One replica's side (``Videos.sharing``; :class:`~omnirt.realtime.http.videos.JobSharing`)."""

    def __init__(
        self,
        store: VideoJobStore,
        fleet: Any,
        replica: str,
        *,
        throttle_seconds: float = 0.5,
        timeout_seconds: float = 2.0,
    ) -> None:
        self.store = store
        #: The ``OmnirtFleet`` deployment's ``DeploymentHandle`` (``share_videos``, ``videos``).
        self.fleet = fleet
        self.replica = replica
        self.throttle_seconds = throttle_seconds
        self.timeout_seconds = timeout_seconds
        self.pinned = fits(replica)
        if not self.pinned:
            log.warning(
                "replica tag %r cannot go into video ids: this replica's video jobs are routed like "
                "any request (their GET may reach another replica and answer 404)",
                replica,
            )
        self._seq = 0
        self._withdrawn = False
        self._last_sent = 0.0
        self._later: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Task[None]] = set()

    def new_id(self) -> str:
        return job_id(self.replica) if self.pinned else new_id(PREFIX)

    def snapshot(self) -> SharedJobs:
        """This replica's jobs now (none once withdrawn), numbered."""
        self._seq += 1
        jobs = [] if self._withdrawn else [(job.created, job.card()) for job in self.store.jobs()]
        return SharedJobs(self.replica, self._seq, jobs)

    async def shared(self) -> None:
        await self._send()

    def changed(self, *, now: bool) -> None:
        if now:
            self._spawn()
            return
        if self._later is not None:
            return  # a send is already due
        wait = self._last_sent + self.throttle_seconds - time.monotonic()
        if wait <= 0:
            self._spawn()
        else:
            self._later = asyncio.get_running_loop().call_later(wait, self._spawn)

    async def withdraw(self) -> None:
        """The replica is being removed: its jobs leave the fleet's list (they cannot be reached)."""
        self._withdrawn = True
        await self._send()

    async def page(self, *, after: str | None, limit: int, order: Order) -> tuple[list[dict[str, Any]], bool]:
        own = self.snapshot()
        try:
            others = await asyncio.wait_for(self.fleet.videos.remote(), self.timeout_seconds)
        except Exception as exc:
            log.warning(
                "the fleet's video jobs are unavailable (%s): replica %s lists its own", exc, self.replica
            )
            others = []
        cards = merge_jobs(own, others)
        return page_of(cards, lambda card: card["id"], after=after, limit=limit, order=order)

    def close(self) -> None:
        if self._later is not None:
            self._later.cancel()
        for task in self._sending:
            task.cancel()

    def _spawn(self) -> None:
        self._later = None
        task = asyncio.get_running_loop().create_task(self._send(), name="omnirt share video jobs")
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self) -> None:
        self._last_sent = time.monotonic()
        try:
            await asyncio.wait_for(self.fleet.share_videos.remote(self.snapshot()), self.timeout_seconds)
        except Exception as exc:  # the fleet deployment restarting: the next report carries them
            log.warning("sharing video jobs with the fleet failed (%s); the next report retries", exc)
