"""Time of each stage of a speech tick, alone, at each batch size: where a frame's time goes.

Builds the speech pipeline (``--model DIR --load-format dummy`` for the real-size model with
random weights) and times, with ``torch.cuda.synchronize()`` around each call:

* **prefill**: one prompt of ``--audio-seconds`` of audio + a short text, thinker prefill (the
  audio encoder and one HF forward) then talker prefill, as a new turn's first tick pays them;
* **long prompt** (``--long-prompt`` tokens of text, when given): read in pieces of
  ``--prefill-chunk`` tokens, each piece timed alone: the most a long prompt adds to one tick;
* **next turn** (with ``--long-prompt``): a conversation's next turn (``--audio-seconds`` of new
  audio + text) after a turn of the long prompt and its reply: the prefill read whole and read
  after the cached prefix (the previous turn's prompt and reply, still in the slot pool), all
  pieces summed, and the ticks each takes;
* for each batch size B, the decode steps of B busy slots (each with ``--cached`` tokens of
  KV): the thinker token step and the talker frame step (code predictor's 15 groups, talker
  decode, sampling), graphed and eager (``use_graphs(False)``) in the same run, and one
  code2wav vocoder step for B streams, of one frame each and of a chunk each (the vocoder decodes
  a chunk a step: ``code2wav`` is that step's share of a tick, its time over the chunk's frames);
  the thinker, talker and that share sum to the floor of a tick in which B sessions speak (no
  prefill, no host work).

Prints a markdown table (median of ``--iters`` calls; eager: of ``--eager-iters``) and the
start-up time (load + graph capture; ``--compile-report``: the start-up's Triton compiles by
kernel, which a cold Triton cache pays). ``--profile-steps B`` adds the kernels of one thinker step
and one talker step of B busy slots (run eagerly under ``torch.profiler``: calls and GPU time a
step by kernel name), which says whether a graphed step is bound by its kernels' count.

On the H200 at real size::

    python benchmarks/speech_steps.py --load-format dummy \
        --model benchmarks/models/qwen3-omni-30b-a3b-instruct/config.json --batches 1 8 32 64 128

Checked on CPU with the demo model::

    python benchmarks/speech_steps.py --device cpu --batches 1 4 --iters 3 --eager-iters 1
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, iters: int) -> float:
    """Median milliseconds of ``iters`` calls (after one untimed call)."""
    fn()
    times = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def _measure(
    pipe,
    batch: int,
    args: argparse.Namespace,
    device: torch.device,
    modes: tuple[str, ...] = ("graphs", "eager"),
) -> dict:
    """The decode steps of ``batch`` busy slots, graphed and eager (``modes``), and a code2wav step."""
    busy = list(range(batch))
    bucket = pipe._bucket(batch)
    text = [(0, 100 + i) for i in busy]
    row: dict = {"batch": batch, "bucket": bucket}

    def rewind(kv) -> None:  # keep every slot at the same cached length
        kv.lengths[:batch] = args.cached
        kv.host_lengths[:batch] = [args.cached] * batch

    def thinker() -> None:
        pipe.thinker.decode(busy, bucket)
        rewind(pipe.thinker.kv)

    def talker() -> None:
        pipe.talker.step(busy, text, bucket)
        rewind(pipe.talker.kv)

    for mode in modes:
        pipe.use_graphs(mode == "graphs")
        iters = args.iters if mode == "graphs" else args.eager_iters
        row[f"thinker {mode}"] = _timed(thinker, device, iters)
        row[f"talker {mode}"] = _timed(talker, device, iters)
    pipe.use_graphs(True)
    row.update(_vocoder_steps(pipe, busy, device, args.iters))
    row["tick floor graphs"] = row["thinker graphs"] + row["talker graphs"] + row["code2wav"]
    return row


def _vocoder_steps(pipe, busy: list[int], device: torch.device, iters: int) -> dict[str, float]:
    """The code2wav step of ``busy`` streams: one frame each (what the vocoder ran every tick
    before 2026-12-05; its graphs captured here as the baseline) and a chunk each (what it runs
    now, once a chunk); ``code2wav``: a tick's share, the chunk's step over its frames."""
    from omnirt.stages.speech.code2wav import capture_step_graphs

    vocoder = pipe.vocoder
    streamer = getattr(vocoder, "streamer", None)
    if streamer is None:  # the chunked vocoder: no steps of its own to time
        return {"code2wav 1 frame": float("nan"), "code2wav chunk": float("nan"), "code2wav": float("nan")}
    keys = [f"v{i}" for i in busy]
    for k in keys:
        vocoder.open(k)
    slots = [vocoder._slot[k] for k in keys]
    step_buckets, runners = list(streamer.step_buckets), dict(streamer.runners)
    if runners and 1 not in runners:  # graphed: the one-frame step's graphs too
        streamer.runners[1] = capture_step_graphs(streamer, 1)
    streamer.step_buckets = sorted({1, *step_buckets})
    chunk = vocoder.chunk
    out = {}
    for name, n in (("code2wav 1 frame", 1), ("code2wav chunk", chunk)):
        codes = torch.zeros(n, pipe.talker.num_groups, dtype=torch.long)
        out[name] = _timed(lambda codes=codes: streamer.step(dict.fromkeys(slots, codes)), device, iters)
    out["code2wav"] = out["code2wav chunk"] / chunk
    streamer.step_buckets, streamer.runners = step_buckets, runners
    for k in keys:
        vocoder.close(k)
    return out


def _profile_steps(pipe, batch: int, device: torch.device, top: int) -> str:
    """The kernels of one thinker step and one talker frame step of ``batch`` busy slots, run
    eagerly under ``torch.profiler`` (the graphs replay the same kernels): calls and GPU time per
    step by kernel name, and the launches per step. Where a graphed step's time is far above its
    kernels' sum, it is bound by the launches, not the work."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    busy = list(range(batch))
    bucket = pipe._bucket(batch)
    text = [(0, 100 + i) for i in busy]
    steps = {
        "thinker": lambda: pipe.thinker.decode(busy, bucket),
        "talker": lambda: pipe.talker.step(busy, text, bucket),
    }
    lines = []
    pipe.use_graphs(False)
    try:
        for name, fn in steps.items():
            kv = pipe.thinker.kv if name == "thinker" else pipe.talker.kv
            lengths, host = kv.lengths.clone(), list(kv.host_lengths)
            fn()
            _sync(device)
            calls = 3
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    fn()
                _sync(device)
            kv.lengths.copy_(lengths)
            kv.host_lengths = host
            kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
            totals: dict[str, list[float]] = {}
            for e in kernels:
                entry = totals.setdefault(e.name, [0, 0.0])
                entry[0] += 1
                entry[1] += e.time_range.end - e.time_range.start
            work = sum(us for _, us in totals.values()) / calls / 1e3
            launches = len(kernels) / calls
            lines.append(f"\n{name} step, batch {batch} (eager, profiled): {launches:.0f} kernels and copies "
                         f"a step, {work:.2f} ms of GPU work\n")
            lines.append("| kernel | calls a step | GPU ms a step |\n|---|---|---|")
            ranked = sorted(totals.items(), key=lambda kv: kv[1][0], reverse=True)[:top]
            for kernel, (n, us) in ranked:
                lines.append(f"| `{kernel[:100]}` | {n / calls:.0f} | {us / calls / 1e3:.3f} |")
    finally:
        pipe.use_graphs(True)
    return "\n".join(lines)


def _kernels_off(pipe, rows: list[dict], args: argparse.Namespace, device: torch.device) -> None:
    """The baseline of the decoders' kernels (``--fused-kernels off``: q/k norm + RoPE, residual add
    + RMSNorm; and the eager decode attention): the decode graphs recaptured without them and
    timed again at each batch."""
    from omnirt.kernels import settings

    before = settings.FUSED
    settings.set_fused("off")
    decoders = (pipe.thinker.kv, pipe.talker.kv, pipe.talker.predictor)
    for kv in decoders:
        kv.attention_kernel = False
    try:
        for runner in (pipe.thinker.runner, pipe.talker.runner):
            runner.drop()
            runner.capture(sorted({pipe._bucket(r["batch"]) for r in rows}))
        for row in rows:
            off = _measure(pipe, row["batch"], args, device, modes=("graphs",))
            row["thinker graphs, kernels off"] = off["thinker graphs"]
            row["talker graphs, kernels off"] = off["talker graphs"]
    finally:
        settings.set_fused(before)
        for kv in decoders:
            kv.attention_kernel = True


class _Compiles:
    """The Triton compiles made while it is entered: each kernel's count and seconds, from Triton's
    JIT hooks (``triton.knobs.runtime.jit_cache_hook`` runs before a compile,
    ``jit_post_compile_hook`` after; a kernel found in Triton's on-disk cache is a short compile)."""

    def __init__(self) -> None:
        self.began: dict[str, float] = {}
        self.seconds: dict[str, list[float]] = {}

    def __enter__(self) -> _Compiles:
        from triton import knobs

        self.hooks = knobs.runtime
        self.saved = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._before, self._after
        return self

    def __exit__(self, *exc: object) -> None:
        self.hooks.jit_cache_hook, self.hooks.jit_post_compile_hook = self.saved

    def _before(self, *, key: object, fn: object, **_: object) -> bool:
        self.began[repr(key)] = time.perf_counter()
        return False  # compile as usual

    def _after(self, *, key: object, fn: object, **_: object) -> None:
        began = self.began.pop(repr(key), None)
        if began is not None:
            self.seconds.setdefault(getattr(fn, "name", str(fn)), []).append(time.perf_counter() - began)

    def table(self) -> str:
        rows = sorted(self.seconds.items(), key=lambda item: -sum(item[1]))
        total = sum(sum(v) for v in self.seconds.values())
        lines = [f"Triton compiles of the start-up: {sum(len(v) for v in self.seconds.values())}, "
                 f"{total:.1f} s\n", "| kernel | compiles | seconds | longest (s) |", "|---|---|---|---|"]
        lines += [f"| `{name}` | {len(v)} | {sum(v):.1f} | {max(v):.1f} |" for name, v in rows]
        return "\n".join(lines)


class _Phases:
    """Wall time of each phase of a prefill: when its Python returned (``enqueue``: the host's
    share) and when the GPU finished it (``done``, after a sync). Installed by wrapping the
    functions a prefill calls, on the pipeline only (no change to the serving code)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rows: dict[str, list[tuple[float, float]]] = {}

    def _record(self, name: str, t0: float) -> None:
        enqueued = time.perf_counter()
        _sync(self.device)
        self.rows.setdefault(name, []).append(((enqueued - t0) * 1000, (time.perf_counter() - t0) * 1000))

    def call(self, name: str, fn):
        def timed(*args, **kwargs):
            _sync(self.device)
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self._record(name, t0)
            return out

        return timed

    def generator(self, name: str, fn):
        def timed(*args, **kwargs):
            _sync(self.device)
            t0 = time.perf_counter()
            out = yield from fn(*args, **kwargs)
            self._record(name, t0)
            return out

        return timed

    def install(self, pipe) -> None:
        from omnirt.stages.speech import prefill, thinker

        rope = thinker.thinker_rope_index
        thinker.thinker_rope_index = lambda model: self.call("thinker RoPE index", rope(model))
        pipe.reader.prefiller.talker_rope = self.call("talker RoPE index", pipe.reader.prefiller.talker_rope)
        prefill.build_talker_prompt = self.call("talker prompt", prefill.build_talker_prompt)
        pipe.thinker.audio.execute = self.call("audio encoder", pipe.thinker.audio.execute)
        pipe.thinker._prompt_embeds = self.call("thinker embeds", pipe.thinker._prompt_embeds)
        pipe.thinker.prompt.run = self.generator("thinker pass (graphs)", pipe.thinker.prompt.run)
        pipe.talker.prompt.run = self.generator("talker pass (graphs)", pipe.talker.prompt.run)
        pipe.talker.prefill_inputs = self.call("talker inputs", pipe.talker.prefill_inputs)


def _prefill_phases(pipe, prefill, device: torch.device, iters: int) -> tuple[list[tuple], float]:
    """Each phase of ``prefill()`` (one new turn): [(phase, enqueue ms, done ms)] medians, and the
    host's time to enqueue a whole prefill without a sync (median)."""
    enqueue = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        prefill()
        enqueue.append((time.perf_counter() - t0) * 1000)
        _sync(device)
    phases = _Phases(device)
    phases.install(pipe)
    for _ in range(iters):
        prefill()
    rows = [
        (name, statistics.median(e for e, _ in v), statistics.median(d for _, d in v))
        for name, v in phases.rows.items()
    ]
    return rows, statistics.median(enqueue)


def _words(pipe, tokens: int) -> str:
    """The longest text of words ``w0 w1 ...`` whose one-message prompt fits ``tokens``."""
    from omnirt.stages.types import ContextMessage, TextPart

    def text(count: int) -> str:
        return " ".join(f"w{i}" for i in range(count))

    low, high = 1, tokens
    while low < high:
        mid = (low + high + 1) // 2
        if pipe.prompts.build([ContextMessage("user", (TextPart(text(mid)),))]).length <= tokens:
            low = mid
        else:
            high = mid - 1
    return text(low)


def _long_prompt(pipe, args: argparse.Namespace, device: torch.device) -> tuple[int, list[float]]:
    """A ``--long-prompt``-token text turn's prefill, a piece at a time (the second of two runs):
    its length in tokens and each piece's milliseconds."""
    from omnirt.stages.types import ContextMessage, GenerationRequest, TextPart

    words = _words(pipe, args.long_prompt)
    request = GenerationRequest("long", [ContextMessage("user", (TextPart(words),))], max_output_tokens=8)
    prepared = pipe.prepare(request)
    pieces: list[float] = []
    for _ in range(2):
        pipe.add(request, prepared)
        active = pipe._active["long"]
        pipe.reader.start(active, pipe._active.values())
        job = active.job
        pieces = []
        while not job.done():
            _sync(device)
            t0 = time.perf_counter()
            job.advance()
            _sync(device)
            pieces.append((time.perf_counter() - t0) * 1000)
        job.result()
        pipe.remove("long")
    return prepared.prompt.length, pieces


def _next_turn(
    pipe, args: argparse.Namespace, device: torch.device, audio
) -> dict[str, tuple[float, int, int]]:
    """A conversation's next turn after a ``--long-prompt``-token turn and its reply: its prefill
    read whole, then after the reused prefix: {mode: (ms of all pieces, pieces, cached tokens)}."""
    from omnirt.stages.types import ContextMessage, GenerationRequest, TextDelta, TextPart

    history = [ContextMessage("user", (TextPart(_words(pipe, args.long_prompt - 200)),))]
    pipe.add(GenerationRequest("h", history, max_output_tokens=8))
    outs = []
    while pipe.has_work():
        outs += pipe.step()
    reply = "".join(o.text for rid, o in outs if rid == "h" and isinstance(o, TextDelta))
    messages = [*history, ContextMessage("assistant", (TextPart(reply),)), ContextMessage("user", audio)]
    request = GenerationRequest("n", messages, max_output_tokens=8)
    prepared = pipe.prepare(request)
    result = {}
    for mode in ("prefix cache", "whole"):
        pipe.use_prefix_cache(mode != "whole")
        pipe.add(request, prepared)
        active = pipe._active["n"]
        _sync(device)
        t0 = time.perf_counter()
        pipe.reader.start(active, pipe._active.values())  # the copy of a reused prefix included
        job = active.job
        pieces = 0
        while not job.done():
            job.advance()
            pieces += 1
        job.result()
        _sync(device)
        result[mode] = ((time.perf_counter() - t0) * 1000, pieces, active.usage.cached_tokens)
        pipe.remove("n")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint folder or config (default: the demo)")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--cached", type=int, default=200, help="KV entries per busy slot")
    ap.add_argument("--audio-seconds", type=float, default=1.0)
    ap.add_argument("--long-prompt", type=int, default=0, help="tokens of a long prompt to read in pieces")
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--eager-iters", type=int, default=3)
    ap.add_argument(
        "--prefill-phases", action="store_true",
        help="time each phase of a prefill (host enqueue and GPU done), at the end of the run",
    )
    ap.add_argument(
        "--kernels-baseline", action="store_true",
        help="also time the decode graphs with the fused kernels off (recaptured), in the same run",
    )
    ap.add_argument(
        "--profile-steps", type=int, default=0, metavar="B",
        help="list the kernels of one thinker and one talker step of B busy slots (eager, profiled)",
    )
    ap.add_argument("--profile-top", type=int, default=30, help="rows of each kernel table")
    ap.add_argument(
        "--compile-report", action="store_true",
        help="list the Triton compiles of the start-up (kernel, compiles, seconds), from Triton's JIT hooks",
    )
    ap.add_argument(
        "--compile-workers", type=int, default=None,
        help="threads making the steps' first calls before the capture (their Triton compiles side by "
        "side; default: as the server, stages.graphs.default_compile_workers(); 0: none)",
    )
    args = ap.parse_args()

    from omnirt.stages.speech.demo import ensure_demo_checkpoint
    from omnirt.stages.speech.loader import load_speech_pipeline
    from omnirt.stages.types import SAMPLE_RATE, AudioPart, ContextMessage, GenerationRequest, TextPart

    device = torch.device(args.device)
    slots = max(args.batches)
    compiles = _Compiles() if args.compile_report else contextlib.nullcontext()
    t0 = time.perf_counter()
    with compiles:
        pipe = load_speech_pipeline(
            args.model or ensure_demo_checkpoint(),
            device=device,
            load_format=args.load_format,
            max_slots=slots,
            max_context=args.max_context,
            max_audio_frames=64,
            prefill_chunk=args.prefill_chunk,
            compile_workers=args.compile_workers,
        )
        _sync(device)
    startup = time.perf_counter() - t0
    graphs = sum(r.graphs for r in pipe.runners)
    # at once too: a run cut short (a time limit) still says what its start-up took
    print(f"(start-up {startup:.1f} s, {graphs} decode graphs)", file=sys.stderr, flush=True)
    if args.compile_report:
        print(compiles.table(), file=sys.stderr, flush=True)
    params = sum(p.numel() for p in pipe.model.parameters()) / 1e9

    # -- prefill: a new turn's first tick ------------------------------------------------------------
    n = int(SAMPLE_RATE * args.audio_seconds)
    t = np.arange(n) / SAMPLE_RATE
    pcm = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    parts = (AudioPart(pcm), TextPart("hi"))
    request = GenerationRequest("p", [ContextMessage("user", parts)], max_output_tokens=8)
    prepared = pipe.prepare(request)

    def prefill() -> None:  # the prefill of one new turn (thinker, then talker), then loaded
        pipe.add(request, prepared)
        active = pipe._active["p"]
        pipe.reader.start(active, pipe._active.values())
        active.job.run()
        pipe._load_prefill(active, [])
        pipe.remove("p")

    pipe.use_prefix_cache(False)  # prompts read whole: the same prompt is timed again and again
    prefill_ms = _timed(prefill, device, max(3, args.iters // 4))
    other = GenerationRequest("q", [ContextMessage("user", (AudioPart(pcm[::-1].copy()), TextPart("yes?")))],
                              max_output_tokens=8)
    other_prepared = pipe.prepare(other)

    def prefill_two() -> None:  # two new turns of one tick: their passes batched
        for req, prep in ((request, prepared), (other, other_prepared)):
            pipe.add(req, prep)
        actives = [pipe._active["p"], pipe._active["q"]]
        for active in actives:
            pipe.reader.start(active, pipe._active.values())
        while not all(a.job.done() for a in actives):
            pipe.reader.prefiller.advance([a.job for a in actives])
        for active in actives:
            pipe._load_prefill(active, [])
        pipe.remove("p")
        pipe.remove("q")

    prefill_two_ms = _timed(prefill_two, device, max(3, args.iters // 4)) if pipe.free_slots >= 2 else None
    long = _long_prompt(pipe, args, device) if args.long_prompt else None
    pipe.use_prefix_cache(True)
    following = _next_turn(pipe, args, device, parts) if args.long_prompt else None

    # -- decode steps at each batch ------------------------------------------------------------------
    vocab = int(pipe.model.config.thinker_config.text_config.vocab_size)
    for kv in (pipe.thinker.kv, pipe.talker.kv):
        kv.lengths.fill_(args.cached)
        kv.host_lengths = [args.cached] * slots
    pipe.thinker.next_token.copy_(torch.randint(0, vocab, (slots,), device=device))
    pipe.talker.hidden.normal_()
    rows = []
    for batch in args.batches:
        row = _measure(pipe, batch, args, device)
        rows.append(row)
        print(f"batch {batch}: {row}", file=sys.stderr, flush=True)

    if args.kernels_baseline:
        _kernels_off(pipe, rows, args, device)
    phases = _prefill_phases(pipe, prefill, device, max(3, args.iters // 2)) if args.prefill_phases else None
    profiled = None
    if args.profile_steps:
        profiled = _profile_steps(pipe, args.profile_steps, device, args.profile_top)

    mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    print(f"# Speech steps: {pipe.info.id} ({params:.2f} B parameters), {device}, {pipe.dtype}\n")
    print(f"- start-up (build/load + capture of {graphs} decode graphs): {startup:.1f} s; "
          f"peak GPU memory {mem:.1f} GiB; {slots} slots x {args.max_context} context tokens")
    two = f"{prefill_two_ms:.1f} ms" if prefill_two_ms is not None else "- (one slot)"
    print(f"- prefill of one turn ({args.audio_seconds:.1f} s audio + text; thinker with audio encoder, "
          f"then talker): {prefill_ms:.1f} ms; of two turns at once (their audio, thinker and talker "
          f"passes batched): {two}")
    if args.compile_report:
        print("\n" + compiles.table() + "\n")
    if long is not None:
        tokens, pieces = long
        print(f"- a long prompt of {tokens} tokens read in {len(pieces)} pieces of at most "
              f"{args.prefill_chunk} tokens (thinker, then talker): longest piece {max(pieces):.1f} ms, "
              f"median {statistics.median(pieces):.1f} ms, all {sum(pieces):.1f} ms")
    if following is not None:
        (whole, n_whole, _), (reused, n_reused, cached) = following["whole"], following["prefix cache"]
        print(f"- the next turn of that conversation ({args.audio_seconds:.1f} s audio + text after the long "
              f"turn and its reply): read whole {whole:.1f} ms in {n_whole} ticks; after the cached prefix "
              f"of {cached} tokens {reused:.1f} ms in {n_reused} ticks ({whole / reused:.1f}x less)")
    if phases is not None:
        table, enqueue = phases
        print(f"- its phases (median; each timed alone, with a sync before and after; a whole prefill "
              f"takes the host {enqueue:.1f} ms to enqueue without a sync):\n")
        print("| phase | host returns (ms) | GPU done (ms) |\n|---|---|---|")
        for name, host, done in table:
            print(f"| {name} | {host:.2f} | {done:.2f} |")
        print()
    print(f"- decode steps with {args.cached} cached tokens per slot; median of {args.iters} (eager: "
          f"{args.eager_iters}) calls\n")
    cols = ["thinker graphs", "thinker eager", "talker graphs", "talker eager", "code2wav 1 frame",
            "code2wav chunk", "code2wav"]
    cols.append("tick floor graphs")
    if args.kernels_baseline:
        cols += ["thinker graphs, kernels off", "talker graphs, kernels off"]
    print("| batch | bucket | " + " | ".join(f"{c} (ms)" for c in cols) + " | graphs speed-up |")
    print("|---|---|" + "---|" * (len(cols) + 1))
    for r in rows:
        speedup = (r["thinker eager"] + r["talker eager"]) / (r["thinker graphs"] + r["talker graphs"])
        cells = " | ".join(f"{r[c]:.2f}" for c in cols)
        print(f"| {r['batch']} | {r['bucket']} | {cells} | {speedup:.1f}x |")
    if profiled is not None:
        print(profiled)


if __name__ == "__main__":
    main()
