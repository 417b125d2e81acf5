"""Step caches (TeaCache, MagCache): steps skipped, speed-up and fidelity against uncached.

For each backend and a sweep of thresholds, the same fixed prompts (one request at a time, so
each request's own decisions apply) run uncached and cached in the same process; the table gives
the transformer calls skipped, the wall time ratio against uncached, and PSNR / SSIM of the
cached images (or video frames) against the uncached ones. It also times the cache's own work
per call (probe, decision, residual) against a whole transformer call.

    # CPU, the embedded demo models (their shipped calibrations):
    python benchmarks/step_cache.py --device cpu [--video]
    # H200, real-size architectures with DUMMY (random) weights, calibrated first on 2 prompts:
    python benchmarks/step_cache.py --device cuda \\
        --model-config benchmarks/models/z-image-turbo/z-image-turbo.components.json \\
        --size 1024x1024 --steps 50 [--video-config benchmarks/models/wan2.1-t2v/wan2.1-t2v.components.json \\
        --video-variant 1.3b --video-size 480x320 --video-frames 17 --video-steps 20]

Random weights say nothing about quality: PSNR and SSIM of dummy models only show that the
cache does what its thresholds say; speed-ups and overheads hold for the architecture.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = (ROOT / "stages/diffusion/cache/calibrations/prompts.txt").read_text().splitlines()


# -- fidelity -------------------------------------------------------------------------------------------


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """Mean SSIM of two uint8 ``[..., H, W, 3]`` arrays on luma (Gaussian window 11, sigma 1.5)."""
    weights = torch.tensor([0.299, 0.587, 0.114], dtype=torch.float64)
    x = (torch.from_numpy(a).double() @ weights).reshape(-1, 1, *a.shape[-3:-1])
    y = (torch.from_numpy(b).double() @ weights).reshape(-1, 1, *b.shape[-3:-1])
    g = torch.exp(-((torch.arange(11, dtype=torch.float64) - 5) ** 2) / (2 * 1.5**2))
    g = g / g.sum()
    window = (g[:, None] * g[None, :])[None, None]

    def blur(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.conv2d(t, window)

    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    mx, my = blur(x), blur(y)
    vx, vy, cov = blur(x * x) - mx**2, blur(y * y) - my**2, blur(x * y) - mx * my
    s = ((2 * mx * my + c1) * (2 * cov + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2))
    return float(s.mean())


# -- runs -----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    seconds: float
    calls: int
    skipped: int
    pixels: dict[str, np.ndarray]


def run(pipeline: Any, requests: Sequence[Any]) -> Run:
    """``requests`` one after the other to completion; the time, calls, skips and raw pixels."""
    captured: dict[str, np.ndarray] = {}
    decoded = pipeline._decoded

    def capture(offsets: Any, pixels: np.ndarray, out: list) -> None:
        for job, row in offsets:
            captured[job.request_id] = pixels[row : row + job.rows].copy()
        decoded(offsets, pixels, out)

    pipeline._decoded = capture
    before = dict(pipeline.calls)
    start = time.perf_counter()
    try:
        for request in requests:
            pipeline.add(request, pipeline.prepare(request))
            while pipeline.has_work() or pipeline.media.busy():
                if pipeline.has_work():
                    pipeline.step()
                else:
                    time.sleep(0.0005)
    finally:
        pipeline._decoded = decoded
    seconds = time.perf_counter() - start
    diff = {k: v - before.get(k, 0) for k, v in pipeline.calls.items()}
    calls = sum(v for (name, _), v in diff.items() if name == "transformer")
    skipped = sum(v for (name, _), v in diff.items() if name == "transformer_skipped")
    return Run(seconds, calls, skipped, captured)


def requests_for(
    pipeline: Any, args: argparse.Namespace, video: bool, backend: str | None, config: dict | None
) -> list:
    kind = pipeline._request_type
    out = []
    size = args.video_size if video else args.size
    for i in range(args.prompts):
        fields: dict[str, Any] = dict(
            request_id=f"{backend or 'none'}-{config}-{i}",
            prompt=PROMPTS[i % len(PROMPTS)],
            num_inference_steps=args.video_steps if video else args.steps,
            seed=1000 + i,
            cache_backend=backend,
            cache_config=config,
        )
        if size:
            fields["width"], fields["height"] = size
        if args.guidance is not None:
            fields["guidance_scale"] = args.guidance
        if video and args.video_frames:
            fields["num_frames"] = args.video_frames
        out.append(kind(**fields))
    return out


def overhead(pipeline: Any, backend: str, steps: int, shape: Any, reps: int = 10) -> tuple[float, float]:
    """Seconds of the cache's work per call (begin, resolve, store) and of a whole call, at ``shape``."""
    from omnirt.stages.diffusion.cache.state import Member

    den, caches = pipeline.denoiser, pipeline.step_cache
    plan = caches.plan(backend, None, steps)
    sampler = den.sampler(shape, steps)
    latents = den.init_latents(shape, [torch.Generator().manual_seed(0)])
    cond = den.encode([PROMPTS[0]])
    sync = torch.cuda.synchronize if den.device.type == "cuda" else (lambda: None)

    def call() -> None:
        state = den.start(latents, 1, sampler, cond, "cond")
        den.finish(den.run_blocks(state, 0, den.num_blocks))

    call()
    sync()
    start = time.perf_counter()
    for _ in range(reps):
        call()
    sync()
    whole = (time.perf_counter() - start) / reps
    state = den.start(latents, 1, sampler, cond, "cond")
    job = caches.job("overhead", plan, latents.shape[0], steps)
    first = caches.begin([Member(job, 0, latents.shape[0])], "cond", 0, state)
    first.resolve()
    first.store(state)
    sync()
    start = time.perf_counter()
    for i in range(reps):
        c = caches.begin([Member(job, 0, latents.shape[0])], "cond", 1 + i % max(steps - 2, 1), state)
        if not c.resolve():
            c.store(state)
    sync()
    return (time.perf_counter() - start) / reps, whole


# -- models ---------------------------------------------------------------------------------------------


def build(args: argparse.Namespace, video: bool) -> Any:
    from omnirt.stages.diffusion.pipeline import DiffusionPipeline

    config = args.video_config if video else args.model_config
    if config is None:
        from omnirt.stages.diffusion.cache.calibrate import DEMO_IMAGE, DEMO_VIDEO, load_pipeline

        return load_pipeline(DEMO_VIDEO if video else DEMO_IMAGE, device=args.device)
    if video:
        from omnirt.stages.diffusion.wan_loader import load_wan

        den = load_wan(Path(config), device=args.device, load_format="dummy", variant=args.video_variant)
    else:
        from omnirt.stages.diffusion.zimage_loader import load_zimage

        den = load_zimage(Path(config), device=args.device, load_format="dummy")
    return DiffusionPipeline(den, max_rows=4)


def ensure_calibrated(pipeline: Any, args: argparse.Namespace, video: bool) -> list[str]:
    """Calibrations for both backends (a dummy real-size model has none: made here, on
    ``--calibration-prompts`` prompts at the run's step count)."""
    from omnirt.stages.diffusion.cache.calibrate import calibrate, describe

    caches, notes = pipeline.step_cache, []
    steps = args.video_steps if video else args.steps
    size = args.video_size if video else args.size
    for backend in ("teacache", "magcache"):
        if caches.store.find(backend, caches.family, caches.fingerprint) is None:
            start = time.perf_counter()
            cal = calibrate(
                backend,
                pipeline,
                PROMPTS[: args.calibration_prompts],
                [steps],
                size=size,
                frames=args.video_frames if video else None,
                guidance_scale=args.guidance,
            )
            caches.store.add(cal)
            notes.append(f"calibrated here in {time.perf_counter() - start:.0f} s: {describe(cal)}")
        else:
            notes.append(f"{backend}: calibration found ({caches.family} {caches.fingerprint})")
    return notes


def bench(args: argparse.Namespace, video: bool) -> list[str]:
    pipeline = build(args, video)
    den = pipeline.denoiser
    dummy = den.info.random_weights
    notes = ensure_calibrated(pipeline, args, video)
    warm = requests_for(pipeline, args, video, None, None)[:1]
    for r in warm:
        r.request_id, r.num_inference_steps = "warm", 2
    run(pipeline, warm)
    base = run(pipeline, requests_for(pipeline, args, video, "none", None))
    again = run(pipeline, requests_for(pipeline, args, video, "none", None))
    base_seconds = min(base.seconds, again.seconds)  # the faster of two uncached runs
    caches = pipeline.step_cache
    tea = caches.store.find("teacache", caches.family, caches.fingerprint)
    # Threshold 0 never skips but does all of the cache's work: its wall time against uncached is
    # the cache's overhead in place.
    sweeps = [("teacache", 0.0)] + [("teacache", round(tea.threshold * m, 6)) for m in args.tea_scales]
    sweeps += [("magcache", 0.0)] + [("magcache", t) for t in args.mag_thresholds]
    prep = pipeline.prepare(requests_for(pipeline, args, video, None, None)[0])
    shape, branches = prep.shape, "cond + uncond" if prep.guided else "cond"
    lines = [
        f"### {den.info.id} ({den.family}, {den.dtype}, {args.device}): {shape.width}x{shape.height}"
        + (f", {shape.frames} frames" if video else "")
        + f", {prep.steps} steps, guidance {prep.guidance_scale:g} ({branches}),"
        f" {args.prompts} prompts one at a time",
        "",
        *(f"- {n}" for n in notes),
    ]
    if dummy:
        lines.append(
            "- DUMMY (random) WEIGHTS: PSNR and SSIM say nothing about quality, only skips and speed hold."
        )
    lines += [
        "",
        f"uncached: {base.seconds:.2f} s and {again.seconds:.2f} s, {base.calls} transformer calls",
        "",
        "| backend | threshold | calls skipped | wall s | speed-up | PSNR dB | SSIM |",
        "|---|---|---|---|---|---|---|",
    ]
    for backend, threshold in sweeps:
        r = run(pipeline, requests_for(pipeline, args, video, backend, {"threshold": threshold}))
        ps, ss = [], []
        for i in range(args.prompts):
            a = base.pixels[f"none-None-{i}"]
            b = r.pixels[f"{backend}-{{'threshold': {threshold}}}-{i}"]
            ps.append(psnr(a, b))
            ss.append(ssim(a, b))
        lines.append(
            f"| {backend} | {threshold:g} | {r.skipped}/{r.calls} ({100 * r.skipped / max(r.calls, 1):.0f}%) "
            f"| {r.seconds:.2f} | {base_seconds / r.seconds:.2f}x | {np.mean(ps):.1f} | {np.mean(ss):.3f} |"
        )
    lines.append("")
    for backend in ("teacache", "magcache"):
        own, whole = overhead(pipeline, backend, prep.steps, prep.shape)
        lines.append(
            f"- {backend} overhead per call (probe, decision, residual): {own * 1e3:.3f} ms vs "
            f"{whole * 1e3:.1f} ms for a whole transformer call ({100 * own / whole:.2f}%)"
        )
    return lines


def parse_size(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    w, _, h = text.partition("x")
    return int(w), int(h)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--model-config", default=None, help="Z-Image components JSON (dummy weights); default: embedded"
    )
    p.add_argument("--size", type=parse_size, default=None, help="WxH (default: the model's)")
    p.add_argument("--steps", type=int, default=None, help="default: 50 with --model-config, else 25")
    p.add_argument(
        "--video", action="store_true", help="also the video model (embedded unless --video-config)"
    )
    p.add_argument("--no-image", action="store_true")
    p.add_argument("--video-config", default=None, help="Wan components JSON (dummy weights)")
    p.add_argument("--video-variant", default=None)
    p.add_argument("--video-size", type=parse_size, default=None)
    p.add_argument("--video-frames", type=int, default=None)
    p.add_argument("--video-steps", type=int, default=25)
    p.add_argument("--guidance", type=float, default=None, help="default: the model's")
    p.add_argument("--prompts", type=int, default=None, help="default: 2 on CUDA, 4 on CPU")
    p.add_argument("--calibration-prompts", type=int, default=2)
    p.add_argument(
        "--tea-scales",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[0.25, 0.5, 1.0, 2.0],
        help="TeaCache thresholds as multiples of the calibrated default",
    )
    p.add_argument(
        "--mag-thresholds", type=lambda s: [float(x) for x in s.split(",")], default=[0.03, 0.06, 0.12, 0.24]
    )
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 50 if args.model_config else 25
    if args.prompts is None:
        args.prompts = 2 if args.device.startswith("cuda") else 4
    if args.video_config:
        args.video = True
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    lines = [f"## Step caches ({args.device}, torch {torch.__version__})", ""]
    for video in ([False] if not args.no_image else []) + ([True] if args.video else []):
        lines += bench(args, video)
        lines.append("")
        print("\n".join(lines), flush=True)
        lines = []
    return 0


if __name__ == "__main__":
    sys.exit(main())
