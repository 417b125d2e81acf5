"""The diffusion runtime: a ``BATCH`` :class:`~omnirt.stages.pipeline.Pipeline` over any
:class:`~.denoiser.Denoiser` (Z-Image images, Wan videos).

Each :meth:`DiffusionPipeline.step` runs ONE model call, or one piece of a long transformer call,
so the scheduler can put a realtime tick between any two of them. The work of the next step is
picked in this order:

0. ``piece``: the next piece of a transformer call under way (see *Long calls* below);
1. ``uncond``: the negative-prompt branch of the group whose ``cond`` branch ran last step (only
   the rows whose scale the denoiser guides: Z-Image above 0, Wan above 1); that step then
   combines the branches (``guide``), steps each request's sampler and sends
   :class:`~.types.Progress`;
2. ``preview``: a VAE decode of the clean-sample estimate of one request, when its partial images
   are due (:class:`~.types.ImagePreview`);
3. ``decode``: the VAE decode of requests done denoising (same shape, up to ``max_decode_rows``
   rows), then one :class:`~.types.GeneratedImage` per image (or a :class:`~.types.GeneratedVideo`)
   and :class:`~omnirt.stages.types.Finished`;
4. ``encode``: the text encoder over the prompts (and negative prompts) of every newly admitted
   request; its noise and sampler are made then;
5. ``cond``: the prompt branch of the transformer over one batch group: every request at the same
   step index of the same shape, step count and timesteps (the group of the oldest request first,
   so requests finish in arrival order). Without guidance that step completes the denoising step.

Long calls: a transformer call at real size takes longer than one realtime frame (a Z-Image call
100-150 ms on an H200, a Wan 1.3B one about 600 ms, a 14B one seconds). When the denoiser splits
its calls (:class:`~.denoiser.SplitDenoiser`) and splitting is on (by default on CUDA devices), a
call runs as a sequence of steps, each a piece of about ``max_step_seconds``: the call's start,
then groups of its transformer blocks, then its finish, the hidden states kept in between. How
many blocks go in a piece follows the measured cost of the start, of one block and of the finish
(moving averages per shape and row count; a part never measured runs alone first, so it is
measured before it is grouped; :mod:`.pieces` keeps those costs and plans the pieces);
:meth:`DiffusionPipeline.step_cost` is the next piece's estimate.
The scheduler may ask for a shorter piece (:meth:`DiffusionPipeline.fit`: the time left before
the next realtime deadline, at most its batch slice), so pieces fill the gaps between realtime
steps. The pieces give bitwise the prediction of the whole call.

Long decodes: a video VAE decode at real size takes seconds (Wan 1.3B at 832x480, 81 frames:
about 2.9 s on an H200). When the denoiser also splits its decode
(:class:`~.denoiser.SplitDecoder`) and splitting is on, the decode runs as pieces the same way:
its start with the first part, then groups of parts (a part: one stage of a latent frame's
decoder call, e.g. one up block; the decoder's feature cache and the frame's activations kept in
the decode's own state), then its finish (the pixels, then the results); a decode under way is
continued before any other work but the pieces of a transformer call. The pixels are bitwise
those of the whole decode (a latent frame at 480p on an H200 took about 92 ms whole, over one
80 ms realtime frame; its stages split it). The finish also encodes the results (PNG, MP4) on the
CPU.

Rows: a request of ``n`` images has ``n`` rows, seeded ``seed, seed + 1, ...`` (one CPU
``torch.Generator`` each: diffusers' results for ``generator=[Generator().manual_seed(seed + i)
for i in range(n)]``). A request without a seed gets a random one. ``remove`` frees a request's
rows at once: a transformer call under way drops its rows from the hidden states it holds (all of
them when no other request is in it), a decode under way its rows of the decoder's caches and frames;
a branch already computed for it is dropped at the next step.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from ..pipeline import CallCounter, Priority, RequestRejected, StepTimer
from ..types import Finished, ModelInfo, Usage
from .cache.calibration import default_store
from .cache.state import CachedCall, CachePlan, JobCache, Member, StepCaches
from .denoiser import Denoiser, Sampler, Shape, split_blocks, split_decode
from .encoding import MediaEncoder
from .media import png
from .pieces import PartsKey, Piece, PieceCosts
from .types import (
    DiffusionOutput,
    DiffusionRequest,
    GeneratedImage,
    GeneratedVideo,
    ImagePreview,
    ImageRequest,
    Progress,
    VideoRequest,
)
from .video_io import encode_mp4

log = logging.getLogger(__name__)

MAX_IMAGES = 10
MAX_PARTIAL_IMAGES = 3
MAX_GUIDANCE = 30.0
#: Seeds of ``torch.Generator.manual_seed`` (unsigned 64-bit); the rows of a request take ``seed + i``
#: modulo 2**64, so any seed in range serves any ``n``.
MAX_SEED = 2**64 - 1
#: A long request logs its progress at INFO this often (seconds).
LOG_EVERY = 5.0

Call = Literal["cond", "uncond", "piece", "settle", "preview", "decode", "encode"]
Branch = Literal["cond", "uncond"]
#: The default target duration of one piece of a split transformer call (seconds): with a
#: realtime frame every 80 ms, a piece and the frame's own step fit between two frames.
MAX_STEP_SECONDS = 0.05


@dataclass(frozen=True)
class PreparedDiffusion:
    """A validated request with every default filled in (``prepare``'s result)."""

    shape: Shape
    steps: int
    guidance_scale: float
    #: One per row (image).
    seeds: tuple[int, ...]
    prompt: str
    negative_prompt: str
    partial_images: int = 0
    fps: int | None = None
    #: Whether the rows run the ``uncond`` branch (the denoiser's rule for this scale).
    guided: bool = False
    #: The step cache (None: every step computed).
    cache: CachePlan | None = None

    @property
    def rows(self) -> int:
        return len(self.seeds)


@dataclass(eq=False)
class _Job:
    """One admitted request."""

    request_id: str
    prep: PreparedDiffusion
    order: int
    admitted: float
    stage: Literal["encode", "denoise", "decode"] = "encode"
    conditions: list[Any] = field(default_factory=list)  # per row
    negatives: list[Any] = field(default_factory=list)  # per row, guided requests only
    latents: torch.Tensor | None = None
    sampler: Sampler | None = None
    index: int = 0  # denoising steps done
    previews_at: tuple[int, ...] = ()
    previews_sent: int = 0
    logged: float = 0.0
    cache: JobCache | None = None
    #: The prompt's tokens as the text encoder read them (the request's usage).
    prompt_tokens: int = 0

    @property
    def rows(self) -> int:
        return self.prep.rows

    def group_key(self) -> tuple[Any, ...]:
        assert self.sampler is not None
        timesteps = tuple(float(t) for t in self.sampler.timesteps.tolist())
        return (self.prep.shape, self.prep.steps, self.index, timesteps)


@dataclass(eq=False)
class _Branched:
    """A group whose ``cond`` branch ran: its rows' predictions, waiting for the ``uncond`` one."""

    jobs: list[tuple[_Job, int]]  # each job with the offset of its rows in ``cond``
    index: int
    cond: torch.Tensor


@dataclass(eq=False)
class _Call:
    """A split transformer call under way: the denoiser's state between two pieces."""

    branch: Branch
    jobs: list[tuple[_Job, int]]  # each job with the offset of its rows in the state
    index: int  # the denoising step
    shape: Shape
    rows: int
    blocks: int
    state: Any
    done: int = 0  # blocks run
    #: The step cache's decision for this call (None: no request in it has a cache).
    cache: CachedCall | None = None


@dataclass(eq=False)
class _Decoding:
    """A split VAE decode under way: the denoiser's decode state between two pieces. Its "blocks"
    are the parts after the first (the start piece runs the first, with the decode's start)."""

    jobs: list[tuple[_Job, int]]  # each job with the offset of its rows in the state
    shape: Shape
    rows: int
    blocks: int
    state: Any
    done: int = 0  # frames run after the first


@dataclass(eq=False)
class _Work:
    call: Call
    jobs: list[_Job]
    rows: int
    shape: Shape | None = None
    #: A split transformer call's next piece (None: the whole call, or not a transformer call).
    piece: Piece | None = None
    #: The piece's estimated seconds (None: a part of it was never measured).
    cost: float | None = None


def preview_steps(steps: int, partial_images: int) -> tuple[int, ...]:
    """After which denoising steps (1-based counts) the previews of a request are made: spread
    evenly, never after the last step (the final image follows it)."""
    if partial_images <= 0:
        return ()
    at = {round(steps * (k + 1) / (partial_images + 1)) for k in range(partial_images)}
    return tuple(sorted(s for s in at if 0 < s < steps))


class DiffusionPipeline:
    """Serves :class:`~.types.ImageRequest`\\ s (or :class:`~.types.VideoRequest`\\ s, by the
    denoiser's ``output``) with one model call per step; see the module docstring."""

    priority = Priority.BATCH

    def __init__(
        self,
        denoiser: Denoiser,
        *,
        max_rows: int = 8,
        max_images: int = MAX_IMAGES,
        max_decode_rows: int = 4,
        clock: Callable[[], float] = time.perf_counter,
        split_calls: bool | None = None,
        max_step_seconds: float = MAX_STEP_SECONDS,
        media_workers: int = 0,
        step_cache: StepCaches | None = None,
    ) -> None:
        """``max_rows``: rows (images) admitted at once; a request is admitted while fewer are in
        use, so one of ``n`` images may take the total to ``max_rows + n - 1``. ``max_images``:
        the most images one request may ask for. ``max_decode_rows``: rows per VAE decode call.
        ``clock`` times the steps for :meth:`step_cost` (tests pass a simulated one).
        ``split_calls``: run transformer calls in pieces when the denoiser can split them (None:
        on CUDA devices only; on CPU the steps are not synchronised with any accelerator and the
        models served there are toys). ``max_step_seconds``: the target duration of one piece.
        ``media_workers``: threads encoding PNGs and MP4s beside the engine thread (the server
        runs 2: :mod:`.factory`); 0 encodes inline, within the decode step. ``step_cache``: the
        step caches' server defaults and calibrations (None: no default backend, the shipped
        calibrations and those in the model folder's ``omnirt-calibration/``)."""
        if max_rows < 1 or max_images < 1 or max_decode_rows < 1:
            raise ValueError("max_rows, max_images and max_decode_rows must be positive")
        if not max_step_seconds > 0:
            raise ValueError(f"max_step_seconds must be positive, got {max_step_seconds}")
        self.denoiser = denoiser
        self.kind: str = denoiser.output
        self.info: ModelInfo = denoiser.info
        self.max_rows = max_rows
        self.max_images = min(max_images, max_rows)
        self.max_decode_rows = max_decode_rows
        self.calls: CallCounter = collections.Counter()
        self.clock = clock
        self._jobs: dict[str, _Job] = {}
        self._branched: _Branched | None = None
        self._previews: collections.deque[tuple[_Job, int, torch.Tensor]] = collections.deque()
        self._admitted = 0
        self._timers: dict[tuple[Any, ...], StepTimer] = {}
        self._request_type = VideoRequest if self.kind == "video" else ImageRequest
        cuda = denoiser.device.type == "cuda"
        self.split_calls = cuda if split_calls is None else split_calls
        self.max_step_seconds = max_step_seconds
        self._fit: float | None = None  # see fit()
        #: Steps of split transformer calls, by rows (``calls`` counts each call once).
        self.pieces: CallCounter = collections.Counter()
        self._call: _Call | None = None
        self._decoding: _Decoding | None = None
        #: Measured seconds of the start, one block and the finish of a call (or of a decode: its
        #: start with its first part, one part, its finish), and the pieces planned from them.
        kinds = getattr(denoiser, "decode_part_kinds", None)
        self._part_costs = PieceCosts(kinds if callable(kinds) else None)
        self._sync = cuda  # steps are timed to the end of their GPU work
        #: Set by the engine: wakes its thread (an encoded output is ready to be released).
        self.wake: Callable[[], None] | None = None
        self.media = MediaEncoder(media_workers, on_ready=self._ready)
        if step_cache is None:
            step_cache = StepCaches(
                denoiser,
                store=default_store(getattr(self.info, "source", None)),
                can_split=split_blocks(denoiser) > 0,
            )
        self.step_cache = step_cache

    # -- requests (any thread) ----------------------------------------------------------------
    def accepts(self, request: object) -> bool:
        """Requests of this pipeline's output type naming its model, or no model."""
        model = getattr(request, "model", None)
        return isinstance(request, self._request_type) and model in (None, self.info.id)

    def prepare(self, request: DiffusionRequest) -> PreparedDiffusion:
        if not isinstance(request, self._request_type):
            raise RequestRejected(f"{self.info.id} makes {self.kind}s: cannot serve {type(request).__name__}")
        if not isinstance(request.prompt, str) or not request.prompt.strip():
            raise RequestRejected("prompt must be a non-empty string")
        negative = request.negative_prompt
        if negative is not None and not isinstance(negative, str):
            raise RequestRejected("negative_prompt must be a string")
        n = getattr(request, "n", 1)
        if not isinstance(n, int) or not 1 <= n <= self.max_images:
            raise RequestRejected(f"n must be from 1 to {self.max_images}, got {n}")
        partial = getattr(request, "partial_images", 0)
        if not isinstance(partial, int) or not 0 <= partial <= MAX_PARTIAL_IMAGES:
            raise RequestRejected(f"partial_images must be from 0 to {MAX_PARTIAL_IMAGES}, got {partial}")
        d = self.denoiser.defaults
        scale = d.guidance_scale if request.guidance_scale is None else request.guidance_scale
        if not isinstance(scale, int | float) or not math.isfinite(scale) or not 0 <= scale <= MAX_GUIDANCE:
            raise RequestRejected(f"guidance_scale must be from 0 to {MAX_GUIDANCE:g}, got {scale}")
        seed = request.seed
        if seed is None:
            seed = random.randrange(2**31)
        elif not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
            raise RequestRejected(f"seed must be an integer from 0 to {MAX_SEED}, got {seed}")
        fps = None
        if isinstance(request, VideoRequest):
            fps = request.fps or d.fps or 16
            if not isinstance(fps, int) or not 1 <= fps <= 60:
                raise RequestRejected(f"fps must be an integer from 1 to 60, got {fps}")
            if request.seconds is not None:
                if request.num_frames is not None:
                    raise RequestRejected("give seconds or num_frames, not both")
                seconds = request.seconds
                if not isinstance(seconds, int | float) or not math.isfinite(seconds) or seconds <= 0:
                    raise RequestRejected(f"seconds must be a positive number, got {seconds}")
                # The model's own frame rule (Wan: 4k + 1) applies in check().
                request = dataclasses.replace(request, num_frames=max(1, round(seconds * fps)), seconds=None)
        shape = self.denoiser.check(request)  # sizes, frames, steps
        steps = d.num_inference_steps if request.num_inference_steps is None else request.num_inference_steps
        cache = self.step_cache.plan(
            getattr(request, "cache_backend", None), getattr(request, "cache_config", None), steps
        )
        return PreparedDiffusion(
            shape=shape,
            steps=steps,
            guidance_scale=float(scale),
            seeds=tuple((seed + i) % (MAX_SEED + 1) for i in range(n)),
            prompt=request.prompt,
            negative_prompt=negative or "",
            partial_images=partial if self.kind == "image" else 0,
            fps=fps,
            guided=self.denoiser.uses_guidance(float(scale)),
            cache=cache,
        )

    # -- admission (engine thread) ------------------------------------------------------------
    def warm_up(self, steps: int = 2) -> float:
        """Runs one request of the model's default shape through every kind of call (text
        encoder, both CFG branches when its default guides, the pieces, the VAE decode, the
        encoding) and discards it, so the first real request does not pay the lazy initialisation
        (at real size on the H200 the first image took 1.3x the second). Needs an idle pipeline;
        returns the seconds it took."""
        if self._jobs or self.media.busy():
            raise RuntimeError("warm_up() needs an idle pipeline")
        start = time.perf_counter()
        request = self._request_type(request_id="__warm_up__", prompt="warm up", seed=0)
        prepared = dataclasses.replace(self.prepare(request), steps=max(1, steps))
        self.add(request, prepared)
        deadline = time.monotonic() + 600
        while self._jobs or self.media.busy():
            if time.monotonic() > deadline:
                self.remove(request.request_id)
                raise RuntimeError("warm-up did not finish in 10 minutes")
            if not self.has_work():
                time.sleep(0.001)  # the encoding threads
                continue
            self.step()
        seconds = time.perf_counter() - start
        log.info("%s: warmed up in %.2f s", self.info.id, seconds)
        return seconds

    def rows_in_use(self) -> int:
        return sum(job.rows for job in self._jobs.values())

    def can_add(self) -> bool:
        return self.rows_in_use() < self.max_rows

    def add(self, request: DiffusionRequest, prepared: PreparedDiffusion) -> None:
        rid = request.request_id
        if rid in self._jobs:
            raise RequestRejected(f"request id {rid!r} is already in flight")
        now = time.monotonic()
        self._jobs[rid] = _Job(
            rid,
            prepared,
            order=self._admitted,
            admitted=now,
            previews_at=preview_steps(prepared.steps, prepared.partial_images),
            logged=now,
        )
        if prepared.cache is not None:
            self._jobs[rid].cache = self.step_cache.job(rid, prepared.cache, prepared.rows, prepared.steps)
        self._admitted += 1
        p = prepared
        log.debug(
            "%s: admitted %s (%d rows, %dx%d, %d steps, guidance %g, seed %d)",
            self.kind,
            rid,
            p.rows,
            p.shape.width,
            p.shape.height,
            p.steps,
            p.guidance_scale,
            p.seeds[0],
        )

    def has_work(self) -> bool:
        return bool(self._jobs) or self.media.ready()

    def _ready(self) -> None:
        if self.wake is not None:
            self.wake()

    def next_deadline(self) -> float | None:
        return None

    def steps_done(self, request_id: str) -> float | None:
        """A request's denoising steps done, with the part of the step under way: its ``cond``
        call if that has run, and the blocks run so far of its split call, over the step's calls
        (two when guided). None for a request this pipeline does not hold. (Benchmarks count
        steps in a time window with it: a Wan step is seconds.)"""
        job = self._jobs.get(request_id)
        if job is None:
            return None
        if job.stage != "denoise":
            return float(job.index)
        part = 0.0
        if self._branched is not None and any(j is job for j, _ in self._branched.jobs):
            part += 1.0
        call = self._call
        if call is not None and call.blocks and any(j is job for j, _ in call.jobs):
            part += call.done / call.blocks
        return job.index + part / (2 if job.prep.guided else 1)

    def remove(self, request_id: str) -> Usage | None:
        encoding = self.media.drop(request_id)
        job = self._jobs.pop(request_id, None)
        if job is None:
            return Usage() if encoding else None
        self._previews = collections.deque(p for p in self._previews if p[0] is not job)
        if self._branched is not None and not self._live(self._branched):
            self._branched = None
        if self._call is not None:
            if not self._keep_live_rows(self._call, "keep_rows"):
                self._call = None
        if self._decoding is not None:
            if not self._keep_live_rows(self._decoding, "decode_keep_rows"):
                self._decoding = None  # its caches freed
        log.debug("%s: removed %s at step %d/%d", self.kind, request_id, job.index, job.prep.steps)
        return Usage()

    # -- the step -----------------------------------------------------------------------------
    def fit(self, seconds: float | None) -> None:
        """Sizes the next step to at most ``seconds`` (None: ``max_step_seconds``) where it is a
        piece of a split call or decode: it then groups only the parts that fit (at least one);
        a whole call keeps its size. Holds until the next :meth:`step` or ``fit``; the scheduler
        fits each step to the time before the next realtime deadline."""
        self._fit = seconds

    def step_cost(self) -> float:
        """The measured time (moving average) of the next step's call: for that call, shape and
        rows; else that call at any size; else the costliest call measured so far."""
        work = self._plan()
        if work is None:
            return 0.0
        if work.piece is not None and work.cost is not None:
            return work.cost
        for key in (self._cost_key(work), (work.call,)):
            timer = self._timers.get(key)
            if timer is not None:
                return timer.seconds
        # A call never measured yet: assume the costliest seen so far (0 before the first step).
        return max((t.seconds for t in self._timers.values()), default=0.0)

    def next_call(self) -> tuple[Call, int] | None:
        """The call the next :meth:`step` runs and its rows (``encode``: texts), or None when there
        is no work (stats and benchmarks; no side effects)."""
        work = self._plan()
        return None if work is None else (work.call, work.rows)

    def step(self) -> list[tuple[str, DiffusionOutput | Finished]]:
        out: list[tuple[str, DiffusionOutput | Finished]] = self.media.drain()  # encoded since
        work = self._plan()
        self._fit = None
        if work is None:
            return out
        start = self.clock()
        run = (
            (self._decode_piece if work.call == "decode" else self._piece)
            if work.piece is not None
            else {
                "cond": self._cond,
                "uncond": self._uncond,
                "settle": self._settle,
                "preview": self._preview,
                "decode": self._decode,
                "encode": self._encode,
            }[work.call]
        )
        run(work, out)
        if self._sync:
            torch.cuda.synchronize(self.denoiser.device)
        seconds = self.clock() - start
        out += self.media.drain()  # inline encoding: this step's images; threaded: what is done
        for key in (self._cost_key(work), (self._cost_key(work)[0],)):
            self._timers.setdefault(key, StepTimer()).record(seconds)
        if work.piece is not None:
            assert work.shape is not None
            self._part_costs.record(self._parts_key(work), work.piece, seconds)
        return out

    def _cost_key(self, work: _Work) -> tuple[Any, ...]:
        if work.piece is None:
            return (work.call, work.shape, work.rows)
        return ("decode_piece" if work.call == "decode" else "piece", work.shape, work.rows)

    def _parts_key(self, work: _Work) -> PartsKey:
        assert work.shape is not None
        return ("vae" if work.call == "decode" else "transformer", work.shape, work.rows)

    def _live(self, branched: _Branched) -> list[tuple[_Job, int]]:
        return [(job, at) for job, at in branched.jobs if self._jobs.get(job.request_id) is job]

    def _plan(self) -> _Work | None:
        """The next step's work (no side effects: ``step_cost`` asks too)."""
        if self._call is not None:
            call = self._call
            key = ("transformer", call.shape, call.rows)
            done = call.done
            if call.cache is not None and done == 0 and call.cache.known():
                done = call.blocks  # skipped: straight to the finish
            piece, cost = self._next_piece(key, call.blocks, done, started=True)
            return _Work("piece", [job for job, _ in call.jobs], call.rows, call.shape, piece, cost)
        if self._decoding is not None:  # finished first: it holds the rows' decoder caches
            dec = self._decoding
            piece, cost = self._next_piece(("vae", dec.shape, dec.rows), dec.blocks, dec.done, started=True)
            return _Work("decode", [job for job, _ in dec.jobs], dec.rows, dec.shape, piece, cost)
        if self._branched is not None:
            live = [job for job, _ in self._live(self._branched)]
            guided = [job for job in live if job.prep.guided]
            if guided:
                return self._transformer_work("uncond", guided)
            if live:
                return _Work("settle", live, 0)
        if self._previews:
            job = self._previews[0][0]
            return _Work("preview", [job], job.rows, job.prep.shape)
        jobs = sorted(self._jobs.values(), key=lambda j: j.order)
        done = [j for j in jobs if j.stage == "decode"]
        if done:
            shape = done[0].prep.shape
            batch: list[_Job] = []
            rows = 0
            for job in done:
                if job.prep.shape == shape and (not batch or rows + job.rows <= self.max_decode_rows):
                    batch.append(job)
                    rows += job.rows
            if self.split_calls and split_decode(self.denoiser):
                blocks = self.denoiser.decode_parts_total(shape) - 1  # type: ignore[attr-defined]
                piece, cost = self._next_piece(("vae", shape, rows), blocks, 0, started=False)
                return _Work("decode", batch, rows, shape, piece, cost)
            return _Work("decode", batch, rows, shape)
        new = [j for j in jobs if j.stage == "encode"]
        if new:
            return _Work("encode", new, sum(1 + j.prep.guided for j in new))
        denoising = [j for j in jobs if j.stage == "denoise"]
        if not denoising:
            return None
        key = denoising[0].group_key()
        group = [j for j in denoising if j.group_key() == key]
        return self._transformer_work("cond", group)

    def _transformer_work(self, branch: Branch, jobs: list[_Job]) -> _Work:
        """A new transformer call over ``jobs``: whole, or its first piece."""
        rows, shape = sum(j.rows for j in jobs), jobs[0].prep.shape
        blocks = split_blocks(self.denoiser) if self.split_calls else 0
        if blocks <= 0:
            return _Work(branch, jobs, rows, shape)
        key = ("transformer", shape, rows)
        piece, cost = self._next_piece(key, blocks, 0, started=False)
        if any(j.cache is not None for j in jobs) and piece.blocks:
            # The cache decides after the start, from flags read at the next piece (no host sync).
            piece = Piece(True, 0, 0, False)
            cost = self._part_costs.start_cost(key)
        return _Work(branch, jobs, rows, shape, piece, cost)

    # -- split transformer calls ----------------------------------------------------------------
    def _next_piece(
        self, key: PartsKey, blocks: int, done: int, *, started: bool
    ) -> tuple[Piece, float | None]:
        """The next piece at ``key`` (:meth:`.PieceCosts.next_piece`) within ``max_step_seconds``,
        or the smaller time :meth:`fit` gave."""
        budget = self.max_step_seconds if self._fit is None else min(self.max_step_seconds, self._fit)
        return self._part_costs.next_piece(key, blocks, done, started=started, budget=budget)

    def _piece(self, work: _Work, out: list) -> None:
        piece = work.piece
        assert piece is not None
        if piece.start:
            assert work.call in ("cond", "uncond") and self._call is None
            branch: Branch = "cond" if work.call == "cond" else "uncond"
            latents, conditions, offsets = self._inputs(work.jobs, branch)
            first = work.jobs[0]
            assert first.sampler is not None and work.shape is not None
            self.calls["transformer", work.rows] += 1
            state = self.denoiser.start(  # type: ignore[attr-defined]
                latents, first.index, first.sampler, conditions, branch
            )
            blocks = split_blocks(self.denoiser)
            self._call = _Call(branch, offsets, first.index, work.shape, work.rows, blocks, state)
            self._call.cache = self._begin_cache(offsets, branch, first.index, state)
        call = self._call
        assert call is not None
        self.pieces["transformer", call.rows] += 1
        if call.cache is not None and not piece.start and call.done == 0 and call.cache.resolve():
            if piece.first != call.blocks or not piece.finish:  # planned before the flags were read
                piece = work.piece = Piece(False, call.blocks, call.blocks, True)
            if call.done < call.blocks:
                self._skip_blocks(call)
        if piece.blocks:
            call.state = self.denoiser.run_blocks(call.state, piece.first, piece.stop)  # type: ignore[attr-defined]
            call.done = piece.stop
        if piece.finish:
            self._call = None
            self._finish_call(call, out)

    def _begin_cache(
        self, offsets: list[tuple[_Job, int]], branch: Branch, index: int, state: Any
    ) -> CachedCall | None:
        if all(job.cache is None for job, _ in offsets):
            return None
        members = [Member(job.cache, at, job.rows) for job, at in offsets]
        return self.step_cache.begin(members, branch, index, state)

    def _skip_blocks(self, call: _Call) -> None:
        """A call its cache skips: the cached residuals applied, no block run."""
        assert call.cache is not None
        call.cache.apply(call.state)
        call.done = call.blocks
        self.calls["transformer_skipped", call.rows] += 1

    def _finish_call(self, call: _Call, out: list) -> None:
        cache = call.cache
        if cache is not None and not cache.resolve():
            cache.store(call.state)
        prediction = self.denoiser.finish(call.state)  # type: ignore[attr-defined]
        call.state = None
        call.cache = None
        self._called(call.branch, call.jobs, call.index, prediction, out)

    def _keep_live_rows(self, held: _Call | _Decoding, keep_rows_name: str) -> bool:
        """Drops the rows of removed requests from a transformer call or VAE decode under way, so
        their states are freed now rather than when it ends (through the denoiser's
        ``keep_rows_name`` when it has one; else the rows stay and the result is cut at the end).
        False when no request is left in it: the caller drops it whole."""
        live = [(job, at) for job, at in held.jobs if self._jobs.get(job.request_id) is job]
        if len(live) == len(held.jobs):
            return True
        if not live:
            return False
        keep_rows = getattr(self.denoiser, keep_rows_name, None)
        if keep_rows is None:
            held.jobs = live
            return True
        rows = [r for job, at in live for r in range(at, at + job.rows)]
        held.state = keep_rows(held.state, rows)
        if isinstance(held, _Call) and held.cache is not None:
            alive = {id(job) for job, _ in live}
            held.cache.keep([i for i, (job, _) in enumerate(held.jobs) if id(job) in alive])
        held.jobs, at = [], 0
        for job, _ in live:
            held.jobs.append((job, at))
            at += job.rows
        held.rows = at
        return True

    # -- split VAE decodes ------------------------------------------------------------------------
    def _decode_piece(self, work: _Work, out: list) -> None:
        piece = work.piece
        assert piece is not None and work.shape is not None
        den: Any = self.denoiser
        if piece.start:
            assert self._decoding is None
            latents, offsets = self._decode_inputs(work.jobs)
            self.calls["vae", work.rows] += 1
            state = den.decode_parts(den.start_decode(latents), 1)
            blocks = den.decode_parts_total(work.shape) - 1
            self._decoding = _Decoding(offsets, work.shape, work.rows, blocks, state)
        dec = self._decoding
        assert dec is not None
        self.pieces["vae", dec.rows] += 1
        if piece.blocks:
            dec.state = den.decode_parts(dec.state, piece.blocks)
            dec.done = piece.stop
        if piece.finish:
            self._decoding = None
            pixels: np.ndarray = den.finish_decode(dec.state).numpy()
            dec.state = None
            self._decoded(dec.jobs, pixels, out)

    # -- the calls ------------------------------------------------------------------------------
    def _encode(self, work: _Work, out: list) -> None:
        texts: list[str] = []
        for job in work.jobs:
            texts.append(job.prep.prompt)
            if job.prep.guided:
                texts.append(job.prep.negative_prompt)
        unique = list(dict.fromkeys(texts))
        encoded = dict(zip(unique, self.denoiser.encode(unique), strict=True))
        self.calls["text_encoder", len(unique)] += 1
        prompts = list(dict.fromkeys(job.prep.prompt for job in work.jobs))
        tokens = dict(zip(prompts, self.denoiser.count_tokens(prompts), strict=True))
        for job in work.jobs:
            p = job.prep
            job.prompt_tokens = tokens[p.prompt]
            job.conditions = [encoded[p.prompt]] * p.rows
            if p.guided:
                job.negatives = [encoded[p.negative_prompt]] * p.rows
            generators = [torch.Generator("cpu").manual_seed(s) for s in p.seeds]
            job.latents = self.denoiser.init_latents(p.shape, generators)
            job.sampler = self.denoiser.sampler(p.shape, p.steps)
            job.stage = "denoise"

    def _inputs(
        self, jobs: Sequence[_Job], branch: Branch
    ) -> tuple[torch.Tensor, list[Any], list[tuple[_Job, int]]]:
        """A call's latents and conditions over ``jobs``, and each job's row offset in them."""
        latents = torch.cat([j.latents for j in jobs if j.latents is not None])
        conditions = [c for j in jobs for c in (j.conditions if branch == "cond" else j.negatives)]
        offsets, at = [], 0
        for job in jobs:
            offsets.append((job, at))
            at += job.rows
        return latents, conditions, offsets

    def _whole_call(self, work: _Work, branch: Branch, out: list) -> None:
        latents, conditions, offsets = self._inputs(work.jobs, branch)
        first = work.jobs[0]
        assert first.sampler is not None
        self.calls["transformer", latents.shape[0]] += 1
        if any(job.cache is not None for job in work.jobs):
            # The pieces in one step: the cache's flags are read right after the start.
            den: Any = self.denoiser
            state = den.start(latents, first.index, first.sampler, conditions, branch)
            blocks = split_blocks(den)
            shape = work.shape or first.prep.shape
            call = _Call(branch, offsets, first.index, shape, len(latents), blocks, state)
            call.cache = self._begin_cache(offsets, branch, first.index, state)
            assert call.cache is not None
            if call.cache.resolve():
                self._skip_blocks(call)
            else:
                call.state = den.run_blocks(call.state, 0, blocks)
            self._finish_call(call, out)
            return
        prediction = self.denoiser.predict(latents, first.index, first.sampler, conditions, branch)
        self._called(branch, offsets, first.index, prediction, out)

    def _cond(self, work: _Work, out: list) -> None:
        self._whole_call(work, "cond", out)

    def _uncond(self, work: _Work, out: list) -> None:
        self._whole_call(work, "uncond", out)

    def _called(
        self, branch: Branch, offsets: list[tuple[_Job, int]], index: int, prediction: torch.Tensor, out: list
    ) -> None:
        """A transformer call's prediction (rows at ``offsets``) goes on: a ``cond`` one waits for
        its group's ``uncond`` call, or completes the step when none of its rows is guided; an
        ``uncond`` one completes the step of the group whose ``cond`` call ran."""
        live = [(job, at) for job, at in offsets if self._jobs.get(job.request_id) is job]
        if branch == "cond":
            branched = _Branched(live, index, prediction)
            if any(job.prep.guided for job, _ in live):
                self._branched = branched
            elif live:
                self._finish_step(branched, None, out)
            return
        if self._branched is None:  # every request of the group was removed
            return
        branched, self._branched = self._branched, None
        if sum(job.rows for job, _ in live) != prediction.shape[0]:
            prediction = torch.cat([prediction[at : at + job.rows] for job, at in live])
        self._finish_step(branched, prediction, out)

    def _settle(self, work: _Work, out: list) -> None:
        assert self._branched is not None
        branched, self._branched = self._branched, None
        self._finish_step(branched, None, out)

    def _finish_step(self, branched: _Branched, uncond: torch.Tensor | None, out: list) -> None:
        """Guidance combine, sampler step and progress for the live rows of a group. ``uncond``
        holds the rows of its live guided requests, in order (None: none is guided)."""
        live = self._live(branched)
        guided_jobs = [(job, at) for job, at in live if job.prep.guided]
        predictions: dict[int, torch.Tensor] = {}
        if guided_jobs:
            assert uncond is not None
            cond = torch.cat([branched.cond[at : at + job.rows] for job, at in guided_jobs])
            scale = torch.tensor(
                [job.prep.guidance_scale for job, _ in guided_jobs for _ in range(job.rows)],
                dtype=torch.float32,
            )
            guided = self.denoiser.guide(cond, uncond, scale)
            row = 0
            for job, _ in guided_jobs:
                predictions[id(job)] = guided[row : row + job.rows]
                row += job.rows
        now = time.monotonic()
        for job, at in live:
            prediction = predictions.get(id(job), branched.cond[at : at + job.rows])
            assert job.sampler is not None and job.latents is not None
            before = job.latents
            job.latents = job.sampler.step(prediction, branched.index, before)
            job.index += 1
            p = job.prep
            out.append((job.request_id, Progress(job.index, p.steps)))
            if job.index in job.previews_at:
                denoised = getattr(job.sampler, "denoised", None)
                estimate = denoised(prediction, branched.index, before) if denoised else job.latents
                self._previews.append((job, job.previews_sent, estimate))
                job.previews_sent += 1
            if job.index == p.steps:
                job.stage = "decode"
                job.sampler = None
                job.conditions = job.negatives = []
            if now - job.logged >= LOG_EVERY:
                job.logged = now
                log.info(
                    "%s %s: step %d/%d (%d rows, %.2f s/step)",
                    self.kind,
                    job.request_id,
                    job.index,
                    p.steps,
                    job.rows,
                    (now - job.admitted) / job.index,
                )

    def _preview(self, work: _Work, out: list) -> None:
        job, partial_index, estimate = self._previews.popleft()
        pixels = self.denoiser.preview(estimate).numpy()
        self.calls["vae_preview", job.rows] += 1
        for i in range(job.rows):
            build = functools.partial(ImagePreview, i, partial_index)
            self.media.submit(job.request_id, build, png, pixels[i, 0])

    def _decode_inputs(self, jobs: Sequence[_Job]) -> tuple[torch.Tensor, list[tuple[_Job, int]]]:
        latents = torch.cat([j.latents for j in jobs if j.latents is not None])
        offsets, at = [], 0
        for job in jobs:
            offsets.append((job, at))
            at += job.rows
        return latents, offsets

    def _decode(self, work: _Work, out: list) -> None:
        latents, offsets = self._decode_inputs(work.jobs)
        pixels: np.ndarray = self.denoiser.decode(latents).numpy()
        self.calls["vae", latents.shape[0]] += 1
        self._decoded(offsets, pixels, out)

    def _decoded(self, offsets: list[tuple[_Job, int]], pixels: np.ndarray, out: list) -> None:
        """The results of decoded jobs (each job's rows at its offset in ``pixels``); they finish."""
        for job, row in offsets:
            p = job.prep
            for i in range(job.rows):
                frames = pixels[row + i]
                if self.kind == "video":
                    assert p.fps is not None
                    video = functools.partial(
                        _video, width=p.shape.width, height=p.shape.height, frames=frames.shape[0], fps=p.fps
                    )
                    self.media.submit(job.request_id, video, encode_mp4, frames, p.fps)
                else:
                    image = functools.partial(_image, i, width=p.shape.width, height=p.shape.height)
                    self.media.submit(job.request_id, image, png, frames[0])
            del self._jobs[job.request_id]
            self.media.put(job.request_id, Finished("stop", Usage(input_text_tokens=job.prompt_tokens)))
            log.info(
                "%s %s: done, %d rows %dx%d, %d steps in %.2f s",
                self.kind,
                job.request_id,
                job.rows,
                p.shape.width,
                p.shape.height,
                p.steps,
                time.monotonic() - job.admitted,
            )


def _image(index: int, png_bytes: bytes, *, width: int, height: int) -> GeneratedImage:
    return GeneratedImage(index, png_bytes, width, height)


def _video(mp4: bytes, *, width: int, height: int, frames: int, fps: int) -> GeneratedVideo:
    return GeneratedVideo(mp4, width, height, frames, fps)
