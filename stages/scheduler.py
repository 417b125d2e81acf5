"""Which pipeline steps run, in what order: the engine thread's tick.

The :class:`Scheduler` owns the engine's pipelines by kind (``{"speech": ..., "diffusion": ...}``),
routes each request to the pipeline that accepts it and keeps one waiting queue per pipeline, so a
full pipeline never holds up admission to another. Each :meth:`Scheduler.tick`:

1. admits waiting requests into every pipeline with free slots, in arrival order, background
   requests (input transcription) after every other;
2. runs the realtime pipelines whose step is due (no deadline, or a deadline already reached):
   those with firm deadlines first (they may not run early: duplex frames), then earliest
   deadline first; with no batch work waiting, also those that may run early (see
   ``Pipeline.next_deadline``), but an early step only when its ``step_cost()`` fits before the
   next deadline of the realtime pipelines that may not run early (duplex frames on their 80 ms
   clock: a late one is an audible glitch, so they come first). An early step that does not fit
   waits for its own deadline;
3. runs batch pipelines' steps in the time left before the earliest realtime deadline, sharing
   the engine's time fairly between them: the pipeline that has run the least batch time goes
   first (a pipeline that gets work after idling starts level with the least served one that
   kept working, so idling earns no credit), whatever its steps cost, so an image pipeline's
   short steps and a video pipeline's long ones each get about half of the time (round robin by
   steps gave the one with the longer steps the larger share, and under realtime load the one
   with the shorter steps, which fit more gaps). A batch step starts only when its
   ``step_cost()`` fits before that deadline; when the step of the pipeline whose turn it is does
   not fit, the next one whose step fits runs, and the turn stays (an image's few-millisecond
   pieces fill a gap too short for a video's). A
   pipeline whose steps are pieces of longer work (``Pipeline.fit``: split diffusion calls) is
   first asked to size its next piece to that time and, while any realtime pipeline has work, to
   at most ``batch_slice`` when one is set: pieces fill the gaps between realtime steps, and
   realtime work that comes due without warning (a new turn's prompt) waits at most one piece
   behind them (without a slice, a piece of the pipeline's own size: 50 ms for diffusion). With no
   realtime deadline pending, one batch step runs per tick (so realtime work without deadlines,
   which runs every tick, alternates with batch steps). A batch pipeline that has not stepped for
   ``starvation_limit`` seconds gets one step even when it does not fit: a realtime step then
   waits at most one batch step.

``tick(deliver)`` (the engine's way) hands each step's outputs to ``deliver`` as soon as that step
ends, so a realtime step's audio goes out before the batch steps fitted after it run.

A step that raises fails only its own pipeline's active requests (each is removed from it and
ends with an ``internal`` error); the other pipelines and every waiting request go on.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .pipeline import (
    Pipeline,
    Priority,
    Request,
    RequestRejected,
    can_fit,
    can_hold,
    is_background,
    runs_early,
)
from .types import Finished, Usage

log = logging.getLogger(__name__)

#: Outputs of a tick, tagged by request id.
Outputs = list[tuple[str, Any]]

#: A step whose cost exceeds the time left by no more than this fits (a piece fitted to the time
#: left may exceed it by float rounding).
SLACK = 1e-9


@dataclass(eq=False)
class _Lane:
    """One pipeline and its queue."""

    pipeline: Pipeline[Any, Any]
    waiting: collections.deque[tuple[Request, Any]] = field(default_factory=collections.deque)
    active: set[str] = field(default_factory=set)
    #: When the pipeline last stepped, or last got work while idle (batch starvation clock).
    served_at: float = 0.0
    #: Seconds of steps run (``clock()`` time), levelled up when work returns after idling: the
    #: batch lanes' fair share (see :meth:`Scheduler._batch_order`).
    used: float = 0.0

    @property
    def kind(self) -> str:
        return self.pipeline.kind


class Scheduler:
    """Routes, queues, admits and steps the requests of several pipelines (engine thread only,
    except :meth:`route`, which any thread may call)."""

    def __init__(
        self,
        pipelines: Sequence[Pipeline[Any, Any]],
        *,
        max_waiting: int = 256,
        starvation_limit: float = 1.0,
        batch_slice: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_step: Callable[[str, float], None] | None = None,
    ) -> None:
        """``max_waiting``: queue length per pipeline; ``batch_slice``: the longest piece a
        pipeline that can size its steps is asked for while realtime work is active (None: its
        own size); ``on_step(kind, seconds)`` is called after every pipeline step (stats)."""
        if not pipelines:
            raise ValueError("the scheduler needs at least one pipeline")
        if batch_slice is not None and not batch_slice > 0:
            raise ValueError(f"batch_slice must be positive, got {batch_slice}")
        self._lanes: dict[str, _Lane] = {}
        for pipeline in pipelines:
            if pipeline.kind in self._lanes:
                raise ValueError(f"two pipelines of kind {pipeline.kind!r}")
            self._lanes[pipeline.kind] = _Lane(pipeline)
        self.max_waiting = max_waiting
        self.starvation_limit = starvation_limit
        self.batch_slice = batch_slice
        self.clock = clock
        self.on_step = on_step
        self._owner: dict[str, _Lane] = {}  # request id -> its lane, waiting or active
        self._held: set[str] = set()  # requests held (see hold), waiting or active
        #: The least ``used`` of the batch lanes with work when they were last ordered
        #: (:meth:`_batch_order`): where a lane that had none rejoins (never below it, so idle
        #: time is not owed back).
        self._used_floor = 0.0

    @property
    def pipelines(self) -> dict[str, Pipeline[Any, Any]]:
        return {kind: lane.pipeline for kind, lane in self._lanes.items()}

    # -- requests ------------------------------------------------------------------------------
    def route(self, request: Request) -> str:
        """The kind of the pipeline that serves ``request``; :class:`RequestRejected` if none."""
        for kind, lane in self._lanes.items():
            if lane.pipeline.accepts(request):
                return kind
        raise RequestRejected(f"no loaded model serves {type(request).__name__} requests")

    def enqueue(self, kind: str, request: Request, prepared: Any) -> bool:
        """Queue a prepared request for its pipeline; False when that pipeline's queue is full."""
        lane = self._lanes[kind]
        if request.request_id in self._owner:
            raise RequestRejected(f"request id {request.request_id!r} is already in flight")
        if len(lane.waiting) >= self.max_waiting:
            return False
        at = len(lane.waiting)
        if not is_background(request):  # ahead of the background requests already waiting
            at = next((i for i, (r, _) in enumerate(lane.waiting) if is_background(r)), at)
        lane.waiting.insert(at, (request, prepared))
        self._owner[request.request_id] = lane
        return True

    def cancel(self, request_id: str) -> Usage | None:
        """Drop a waiting or active request; its usage so far, or None if it is not here."""
        lane = self._owner.pop(request_id, None)
        self._held.discard(request_id)
        if lane is None:
            return None
        if request_id in lane.active:
            lane.active.discard(request_id)
            return lane.pipeline.remove(request_id) or Usage()
        for i, (request, _) in enumerate(lane.waiting):
            if request.request_id == request_id:
                del lane.waiting[i]
                break
        return Usage()

    def hold(self, request_id: str, held: bool) -> None:
        """Hold (or release) a request: while held it takes no steps in a pipeline that can hold
        (``Pipeline.hold``); a request still waiting is held from its admission on."""
        lane = self._owner.get(request_id)
        if lane is None:
            return
        if held:
            self._held.add(request_id)
        else:
            self._held.discard(request_id)
        if request_id in lane.active and can_hold(lane.pipeline):
            lane.pipeline.hold(request_id, held)  # type: ignore[attr-defined]

    def remove_all(self) -> None:
        """Drop every waiting and active request (shutdown)."""
        for lane in self._lanes.values():
            for request_id in lane.active:
                self._remove_quietly(lane, request_id)
            lane.active.clear()
            lane.waiting.clear()
        self._owner.clear()
        self._held.clear()

    def counts(self) -> tuple[int, int]:
        """(active, waiting) requests over all pipelines."""
        lanes = self._lanes.values()
        return sum(len(lane.active) for lane in lanes), sum(len(lane.waiting) for lane in lanes)

    # -- the tick ------------------------------------------------------------------------------
    def next_due(self) -> float | None:
        """When the next tick has something to do (``clock()`` time; past or now: at once), or
        None when there is no work at all."""
        now = self.clock()
        due: list[float] = []
        for lane in self._lanes.values():
            p = lane.pipeline
            if lane.waiting and p.can_add():
                return now
            if not p.has_work():
                continue
            if p.priority is Priority.REALTIME:
                deadline = p.next_deadline()
                due.append(now if deadline is None or self._early(p) else deadline)
        horizon = self._horizon()
        for lane in self._batch_lanes_with_work():
            if horizon is None or self._batch_cost(lane, horizon - now) <= horizon - now + SLACK:
                return now
            due.append(min(horizon, lane.served_at + self.starvation_limit))
        return min(due) if due else None

    def tick(self, deliver: Callable[[str, Any], None] | None = None) -> Outputs:
        """One tick (see the module's docstring); returns its outputs. With ``deliver``, each
        step's outputs go to it as soon as that step ends, so a realtime step's audio never
        waits for the batch steps that run after it in the same tick, and the tick returns
        none."""
        out: Outputs = []

        def flush() -> None:
            if deliver is not None:
                for request_id, output in out:
                    deliver(request_id, output)
                out.clear()

        for lane in self._lanes.values():
            self._admit(lane, out)
        flush()
        now = self.clock()
        due = []
        for lane in self._lanes.values():
            p = lane.pipeline
            if p.priority is Priority.REALTIME and p.has_work():
                deadline = p.next_deadline()
                if deadline is None or deadline <= now or self._early(p):
                    due.append((now if deadline is None else deadline, lane))
        # Firm-deadline pipelines (duplex frames) first, then earliest deadline first; stable:
        # registration order among equals.
        due.sort(key=lambda item: (runs_early(item[1].pipeline), item[0]))
        for _, lane in due:
            self._step(lane, out)
            flush()
        self._batch_steps(out, flush)
        return out

    def _batch_steps(self, out: Outputs, flush: Callable[[], None]) -> None:
        stepped = False
        while True:
            lanes = self._batch_order()
            if not lanes:
                return
            lane = lanes[0]  # the lane whose turn it is: the least served
            now = self.clock()
            horizon = self._horizon()
            if horizon is None:
                if stepped:  # one per tick: the engine reads its inbox between batch steps
                    return
                self._batch_cost(lane, None)
            elif self._batch_cost(lane, horizon - now) > horizon - now + SLACK:
                if not stepped and now - lane.served_at >= self.starvation_limit:
                    log.debug("%s: a batch step runs past a realtime deadline (starved)", lane.kind)
                    self._batch_cost(lane, None)  # one slice, however late
                    self._step(lane, out)
                    flush()
                    return
                # the next least served lane whose step fits the time left (an image's few-ms
                # pieces in a gap too short for a video's): the lane whose turn it was keeps it
                room = horizon - now
                lane = next((o for o in lanes[1:] if self._batch_cost(o, room) <= room + SLACK), None)
                if lane is None:
                    return
                self._step(lane, out)
                flush()
                stepped = True
                continue
            self._step(lane, out)
            flush()
            stepped = True

    def _batch_order(self) -> list[_Lane]:
        """The batch lanes with work, the least served first (registration order among equals):
        a lane whose ``used`` fell behind the floor while it had no work rejoins at the floor."""
        lanes = self._batch_lanes_with_work()
        for lane in lanes:
            lane.used = max(lane.used, self._used_floor)
        lanes.sort(key=lambda lane: lane.used)  # stable
        if lanes:
            self._used_floor = lanes[0].used
        return lanes

    def _batch_cost(self, lane: _Lane, room: float | None) -> float:
        """The cost of ``lane``'s next step, sized first (if its pipeline can: ``fit``) to
        ``room`` seconds (None: no limit) and, while realtime work is active, to the batch slice."""
        p = lane.pipeline
        if can_fit(p):
            limit = room
            if self.batch_slice is not None and self._realtime_active():
                limit = self.batch_slice if limit is None else min(limit, self.batch_slice)
            p.fit(limit)  # type: ignore[attr-defined]
        return p.step_cost()

    def _realtime_active(self) -> bool:
        return any(
            lane.pipeline.priority is Priority.REALTIME and lane.pipeline.has_work()
            for lane in self._lanes.values()
        )

    def _batch_lanes_with_work(self) -> list[_Lane]:
        return [
            lane
            for lane in self._lanes.values()
            if lane.pipeline.priority is Priority.BATCH and lane.pipeline.has_work()
        ]

    def _early(self, pipeline: Pipeline[Any, Any]) -> bool:
        """A realtime pipeline that may run before its deadline, with no batch work to fit in,
        whose step ends before the next firm deadline (see :meth:`_firm_horizon`)."""
        if not runs_early(pipeline) or self._batch_lanes_with_work():
            return False
        firm = self._firm_horizon()
        return firm is None or self.clock() + pipeline.step_cost() <= firm

    def _firm_horizon(self) -> float | None:
        """The earliest deadline of realtime work that may not run early (duplex frames)."""
        deadlines = [
            d
            for lane in self._lanes.values()
            if lane.pipeline.priority is Priority.REALTIME and not runs_early(lane.pipeline)
            if lane.pipeline.has_work() and (d := lane.pipeline.next_deadline()) is not None
        ]
        return min(deadlines, default=None)

    def _horizon(self) -> float | None:
        """The earliest deadline of realtime work (None: there is none with a deadline)."""
        deadlines = [
            d
            for lane in self._lanes.values()
            if lane.pipeline.priority is Priority.REALTIME and lane.pipeline.has_work()
            if (d := lane.pipeline.next_deadline()) is not None
        ]
        return min(deadlines, default=None)

    def _admit(self, lane: _Lane, out: Outputs) -> None:
        p = lane.pipeline
        if lane.waiting and not p.has_work():
            lane.served_at = self.clock()
        while lane.waiting and p.can_add():
            request, prepared = lane.waiting.popleft()
            rid = request.request_id
            try:
                p.add(request, prepared)
            except RequestRejected as exc:
                self._forget(rid)
                out.append((rid, Finished("error", Usage(), str(exc), "rejected")))
                continue
            except Exception as exc:  # a model bug must not take the engine down
                log.exception("%s: add failed for %s", lane.kind, rid)
                self._forget(rid)
                out.append((rid, Finished("error", Usage(), f"internal error: {exc}", "internal")))
                continue
            lane.active.add(rid)
            if rid in self._held and can_hold(p):
                p.hold(rid, True)  # type: ignore[attr-defined]

    def _step(self, lane: _Lane, out: Outputs) -> None:
        t0 = time.perf_counter()
        started = self.clock()
        try:
            outputs = lane.pipeline.step()
        except Exception as exc:
            log.exception("%s step failed; failing its %d active requests", lane.kind, len(lane.active))
            for rid in lane.active:
                usage = self._remove_quietly(lane, rid)
                self._forget(rid)
                out.append((rid, Finished("error", usage or Usage(), f"internal error: {exc}", "internal")))
            lane.active.clear()
            return
        finally:
            lane.served_at = self.clock()
            lane.used += lane.served_at - started
            if self.on_step is not None:
                self.on_step(lane.kind, time.perf_counter() - t0)
        for rid, output in outputs:
            if rid not in lane.active:
                continue  # removed earlier (cancelled): nothing of it goes out any more
            if isinstance(output, Finished):
                lane.active.discard(rid)
                self._forget(rid)
            out.append((rid, output))

    def _forget(self, request_id: str) -> None:
        """A request has ended: it is no longer owned (nor held)."""
        del self._owner[request_id]
        self._held.discard(request_id)

    def _remove_quietly(self, lane: _Lane, request_id: str) -> Usage | None:
        try:
            return lane.pipeline.remove(request_id)
        except Exception:
            log.exception("%s: remove(%s) failed", lane.kind, request_id)
            return None
