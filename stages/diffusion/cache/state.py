"""Step-cache state of the runtime: per request (:class:`JobCache`), per CFG branch
(:class:`BranchCache`, each row its own accumulator and residual), and the decision of one
transformer call (:class:`CachedCall`).

How a call runs with caches (the runtime, :mod:`..pipeline`, drives it):

1. the denoiser's ``start``; then :meth:`StepCaches.begin` over the call's members (each request
   in it, with its rows): MagCache members decide on the host from their precomputed ratios;
   TeaCache members compute the probe, the distance, the rescale and the accumulation on the
   device, and their per-row flags (may skip, input outside the calibrated range) are copied to
   pinned host memory with ``non_blocking=True`` behind a recorded CUDA event. Nothing reads the
   device.
2. At the call's next piece :meth:`CachedCall.resolve` reads the flags (``event.query()``, else
   ``event.synchronize()``): the call skips only when every member may (a batch computes a step if
   any member needs it; then every member's state is updated as computed, on the device too).
3. A skipped call applies each row's cached residual of the block stack to the hidden states and
   goes straight to ``finish``; a computed one runs the blocks and :meth:`CachedCall.store`\\ s the
   new residual (output hidden minus input hidden) per row and branch.

The first step of each branch is always computed, the last by default.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ...pipeline import RequestRejected
from .calibration import CalibrationStore, MagCacheCalibration, TeaCacheCalibration, fingerprint
from .config import StepCacheOptions, choose
from .magcache import MagCacheBranch, MagCacheParams, magcache_schedule
from .probes import Probe, probe_for
from .teacache import TeaCacheParams, accumulate, rel_l1, rescale

log = logging.getLogger(__name__)

PlanBackend = Literal["teacache", "magcache", "record"]


class Recorder:
    """Full-compute trajectories for calibration: per call and row, the probe's relative L1
    distance to the previous step's, the residual's, and the mean per-token ratio of the residual's
    norm to the previous one's (MagCache's), all computed on the device; read back once at the end."""

    def __init__(self) -> None:
        #: (request id, branch, step index, steps, first row, values [rows, 3] on the device)
        self.entries: list[tuple[str, str, int, int, int, torch.Tensor]] = []

    def rows(self) -> list[tuple[str, str, int, int, int, float, float, float]]:
        """Per recorded (request, row, branch, step): ``(request, branch, step, steps, row, x, y,
        ratio)``; one read of the device for all of them."""
        if not self.entries:
            return []
        values = torch.cat([e[5].float() for e in self.entries]).cpu().tolist()
        out, at = [], 0
        for rid, branch, index, steps, first, v in self.entries:
            for r in range(v.shape[0]):
                x, y, ratio = values[at]
                out.append((rid, branch, index, steps, first + r, x, y, ratio))
                at += 1
        return out


@dataclass(frozen=True)
class CachePlan:
    """A request's step cache, decided at ``prepare``."""

    backend: PlanBackend
    tea: TeaCacheParams | None = None
    mag: MagCacheParams | None = None
    mag_calibration: MagCacheCalibration | None = None
    recorder: Recorder | None = field(default=None, compare=False)

    def schedule(self, steps: int, branch: str = "cond") -> list[bool] | None:
        """MagCache: per step, whether a request alone skips it (host arithmetic on the ratios)."""
        if self.mag is None or self.mag_calibration is None:
            return None
        ratios, _ = self.mag_calibration.ratios_for(branch, steps)
        return magcache_schedule(ratios, steps, self.mag)


@dataclass(eq=False)
class BranchCache:
    """One CFG branch of one request, its rows' state."""

    residual: torch.Tensor | None = None  # [rows, tokens, dim]
    prev: torch.Tensor | None = None  # TeaCache / recording: the last probe [rows, tokens, dim]
    acc: torch.Tensor | None = None  # TeaCache: [rows] float32 on the device
    threshold: torch.Tensor | None = None  # TeaCache: [rows]
    mag: MagCacheBranch | None = None


@dataclass(eq=False)
class JobCache:
    request_id: str
    plan: CachePlan
    rows: int
    steps: int
    branches: dict[str, BranchCache] = field(default_factory=dict)
    warned: bool = False
    #: Calls skipped and computed, per branch.
    skipped: dict[str, int] = field(default_factory=dict)
    computed: dict[str, int] = field(default_factory=dict)

    def branch(self, name: str, device: torch.device) -> BranchCache:
        b = self.branches.get(name)
        if b is None:
            b = self.branches[name] = BranchCache()
            p = self.plan
            if p.tea is not None:
                b.acc = torch.zeros(self.rows, dtype=torch.float32, device=device)
                b.threshold = torch.full((self.rows,), p.tea.threshold, dtype=torch.float32, device=device)
            if p.mag is not None and p.mag_calibration is not None:
                ratios, _ = p.mag_calibration.ratios_for(name, self.steps)
                b.mag = MagCacheBranch(ratios, self.steps, p.mag)
        return b


@dataclass(eq=False)
class Member:
    job: JobCache | None  # None: a request without a cache in the call (it needs every step)
    at: int  # its rows' offset in the call's state
    rows: int
    flag_at: int = -1  # TeaCache: its rows' offset in the flags


class CachedCall:
    """The cache's part of one transformer call (see the module docstring)."""

    def __init__(
        self,
        members: list[Member],
        branch: str,
        index: int,
        hidden_in: torch.Tensor,
        force: bool,
        flags: torch.Tensor | None,
        event: Any,
        recorded: dict[int, torch.Tensor],
    ) -> None:
        self.members = members
        self.branch = branch
        self.index = index
        self.hidden_in = hidden_in
        self.force = force
        self._flags = flags
        self._event = event
        self._recorded = recorded  # id(job) -> probe distance per row (recording)
        self._host: list[int] | None = None
        #: Known on the host: forced computes, and calls without TeaCache members (all may skip).
        self._skip: bool | None = False if force else (None if flags is not None else True)
        self._resolved = False

    def _read(self) -> list[int]:
        if self._host is None:
            assert self._flags is not None
            if self._event is not None and not self._event.query():
                self._event.synchronize()
            self._host = self._flags.tolist()  # a CPU tensor (pinned on CUDA): no device read
        return self._host

    def known(self) -> bool | None:
        """Whether the call skips, when that is known without waiting (None: flags in flight)."""
        if self._skip is None:
            if self._event is not None and not self._event.query():
                return None
            host = self._read()
            self._skip = all(host[: len(host) // 2])
        return self._skip

    def resolve(self) -> bool:
        """Whether the call skips its blocks (waits for the flags if they are not there yet); commits
        the decision to every member's state. Idempotent."""
        if self._resolved:
            assert self._skip is not None
            return self._skip
        host = self._read() if self._flags is not None else []
        n = len(host) // 2
        if self._skip is None:
            self._skip = all(host[:n])
        skip = self._skip
        self._resolved = True
        for m in self.members:
            if m.job is None:
                continue
            b = m.job.branches[self.branch]
            if b.mag is not None:
                b.mag.commit(skip)
            counts = m.job.skipped if skip else m.job.computed
            counts[self.branch] = counts.get(self.branch, 0) + 1
            if m.flag_at >= 0 and not m.job.warned and any(host[n + m.flag_at : n + m.flag_at + m.rows]):
                m.job.warned = True
                tea = m.job.plan.tea
                assert tea is not None
                log.warning(
                    "%s: TeaCache input outside the calibrated range [%g, %g] at step %d (%s branch); "
                    "the rescaled distance is clamped there. The calibration may not suit this model, "
                    "size or step count: recalibrate with `omnirt calibrate teacache`.",
                    m.job.request_id,
                    tea.low,
                    tea.high,
                    self.index,
                    self.branch,
                )
        return skip

    def apply(self, state: Any) -> None:
        """A skipped call: each row's hidden states plus its cached residual (``state.hidden``)."""
        hidden = self.hidden_in
        if len(self.members) == 1:
            b = self._branch(self.members[0])
            assert b.residual is not None
            if b.residual.shape == hidden.shape:
                state.hidden = hidden + b.residual
                return
        out = hidden.clone()
        for m in self.members:
            res = self._branch(m).residual
            assert res is not None
            n = min(res.shape[1], hidden.shape[1])
            out[m.at : m.at + m.rows, :n] += res[:, :n]
        state.hidden = out

    def store(self, state: Any) -> None:
        """A computed call: the block stack's residual of each row, kept per request and branch."""
        residual = state.hidden - self.hidden_in
        for m in self.members:
            if m.job is None:
                continue
            b = self._branch(m)
            mine = residual[m.at : m.at + m.rows]
            rec = m.job.plan.recorder
            if rec is not None and id(m.job) in self._recorded and b.residual is not None:
                prev = b.residual
                n = min(prev.shape[1], mine.shape[1])
                y = rel_l1(mine[:, :n], prev[:, :n])
                ratio = (
                    torch.linalg.vector_norm(mine[:, :n].float(), dim=-1)
                    / (torch.linalg.vector_norm(prev[:, :n].float(), dim=-1) + 1e-8)
                ).mean(dim=1)
                values = torch.stack([self._recorded[id(m.job)], y, ratio], dim=1)
                rec.entries.append((m.job.request_id, self.branch, self.index, m.job.steps, 0, values))
            b.residual = mine

    def keep(self, kept: Sequence[int]) -> None:
        """Only the members at indices ``kept`` (in order) remain, their rows of the call's state
        cut out of it (slices: no index tensor is copied to the device)."""
        members = [self.members[i] for i in kept]
        self.hidden_in = torch.cat([self.hidden_in[m.at : m.at + m.rows] for m in members])
        self.members, at = [], 0
        for m in members:
            self.members.append(Member(m.job, at, m.rows, m.flag_at))
            at += m.rows

    def _branch(self, m: Member) -> BranchCache:
        assert m.job is not None
        return m.job.branches[self.branch]


class StepCaches:
    """A pipeline's step caches: the server's defaults, the calibrations, the model's probe."""

    def __init__(
        self,
        denoiser: Any,
        *,
        defaults: StepCacheOptions | None = None,
        store: CalibrationStore | None = None,
        can_split: bool = True,
    ) -> None:
        self.denoiser = denoiser
        self.defaults = defaults or StepCacheOptions()
        self.store = store if store is not None else CalibrationStore()
        self.family = str(getattr(denoiser, "family", "?"))
        transformer = getattr(denoiser, "transformer", None)
        self.fingerprint = fingerprint(transformer) if transformer is not None else None
        self.probe: Probe | None = probe_for(denoiser)
        self.can_split = can_split
        self.model = denoiser.info.id
        self.source = denoiser.info.source

    def check_defaults(self) -> None:
        """The server's defaults work for this model (``ValueError`` otherwise): what every request
        that leaves the options out gets."""
        try:
            self.plan(None, None, 1)
        except RequestRejected as exc:
            raise ValueError(f"--step-cache for {self.model}: {exc}") from None

    def plan(
        self, backend: Any, config: Any, steps: int, recorder: Recorder | None = None
    ) -> CachePlan | None:
        """A request's cache (None: none), its options over the server's; ``RequestRejected`` for
        invalid options, a model that cannot run them, or one without a calibration."""
        if recorder is not None:
            self._require_split("calibration")
            return CachePlan("record", recorder=recorder)
        try:
            opts = choose(backend, config, self.defaults)
        except ValueError as exc:
            raise RequestRejected(str(exc)) from None
        if opts.backend == "none":
            return None
        self._require_split(opts.backend)
        assert self.fingerprint is not None
        cal = self.store.require(opts.backend, self.family, self.fingerprint, self.model, self.source)
        cfg = opts.config
        last = bool(cfg.get("compute_last_step", True))
        if isinstance(cal, TeaCacheCalibration):
            low, high = cal.input_range
            tea = TeaCacheParams(
                cal.coefficients, low, high, float(cfg.get("threshold", cal.threshold)), last
            )
            return CachePlan("teacache", tea=tea)
        assert isinstance(cal, MagCacheCalibration)
        mag = MagCacheParams(
            float(cfg.get("threshold", cal.threshold)),
            int(cfg.get("max_skip_steps", cal.max_skip_steps)),
            float(cfg.get("retention_ratio", cal.retention_ratio)),
            last,
        )
        return CachePlan("magcache", mag=mag, mag_calibration=cal)

    def _require_split(self, what: str) -> None:
        if self.probe is None or self.fingerprint is None:
            raise RequestRejected(f"model {self.model!r} ({self.family}) has no step caches ({what})")
        if not self.can_split:
            raise RequestRejected(
                f"model {self.model!r} cannot run {what}: its transformer calls do not split "
                "(a hook wraps the transformer's whole forward)"
            )

    def job(self, request_id: str, plan: CachePlan, rows: int, steps: int) -> JobCache:
        job = JobCache(request_id, plan, rows, steps)
        if plan.mag is not None:
            skips = plan.schedule(steps) or []
            log.debug("%s: magcache skips steps %s", request_id, [i for i, s in enumerate(skips) if s])
        return job

    @torch.no_grad()
    def begin(self, members: list[Member], branch: str, index: int, state: Any) -> CachedCall:
        """The cache's decision for a call whose ``start`` gave ``state`` (see the module docstring)."""
        hidden = state.hidden
        device = hidden.device
        force = False
        tea: list[tuple[int, Member, BranchCache]] = []
        recording: list[tuple[int, Member, BranchCache]] = []
        for i, m in enumerate(members):
            if m.job is None:
                force = True
                continue
            b = m.job.branch(branch, device)
            p = m.job.plan
            last = index >= m.job.steps - 1
            if p.backend == "record":
                force = True
                recording.append((i, m, b))
            elif p.tea is not None:
                if (
                    b.prev is None
                    or b.residual is None
                    or p.tea.threshold <= 0
                    or (last and p.tea.compute_last_step)
                ):
                    force = True
                tea.append((i, m, b))
            else:
                assert b.mag is not None
                if not b.mag.propose(index):
                    force = True
        probe = self.probe(state) if (tea or recording) and self.probe is not None else None
        recorded: dict[int, torch.Tensor] = {}
        for _, m, b in recording:
            assert probe is not None
            mine = probe[m.at : m.at + m.rows]
            if b.prev is not None:
                recorded[id(m.job)] = rel_l1(mine, b.prev)
            b.prev = mine
        flags = event = None
        if tea:
            assert probe is not None
            skips, outside = [], []
            candidates: list[torch.Tensor | None] = []
            at = 0
            for _, m, b in tea:
                t = m.job.plan.tea  # type: ignore[union-attr]
                assert t is not None and b.acc is not None and b.threshold is not None
                mine = probe[m.at : m.at + m.rows]
                if b.prev is None:
                    skips.append(torch.zeros(m.rows, dtype=torch.bool, device=device))
                    outside.append(torch.zeros(m.rows, dtype=torch.bool, device=device))
                    candidates.append(None)
                else:
                    distance, out = rescale(rel_l1(mine, b.prev), t.coefficients, t.low, t.high)
                    candidate, may_skip = accumulate(b.acc, distance, b.threshold)
                    skips.append(may_skip)
                    outside.append(out)
                    candidates.append(candidate)
                b.prev = mine
                m.flag_at = at
                at += m.rows
            every_skip = torch.cat(skips).all()
            compute = torch.ones((), dtype=torch.bool, device=device) if force else ~every_skip
            for (_, _, b), candidate in zip(tea, candidates, strict=True):
                assert b.acc is not None
                b.acc = (
                    torch.zeros_like(b.acc)
                    if candidate is None
                    else torch.where(compute, torch.zeros_like(candidate), candidate)
                )
            packed = torch.cat([torch.cat(skips), torch.cat(outside)]).to(torch.uint8)
            if device.type == "cuda":
                flags = torch.empty(packed.shape, dtype=torch.uint8, pin_memory=True)
                flags.copy_(packed, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            else:
                flags = packed
        return CachedCall(members, branch, index, hidden, force, flags, event, recorded)
