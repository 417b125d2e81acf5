"""W8A8 DiTs (``--quantization``) and the Wan VAE decoder's fast path (``--vae-fast``) at real size.

- **Transformer steps**: one step of Z-Image (6.15 B, 1024x1024) and optionally Wan (1.3 B or 14 B,
  480p or 720p, 81 frames) in bf16, int8, fp8 and fp8 with fp8 attention (``--fp8-attention on``:
  cuDNN's fp8 flash attention, ``kernels/fp8_attention.py``; its output in e4m3 into the fp8
  ``to_out`` as the server runs it, and in bf16 for comparison), from the published configs with
  random bf16 weights; the weights' memory and the step output's SNR against bf16 on the same
  weights and inputs (a copy of the bf16 model is quantized, so both stay loaded), with the fused
  kernels of ``stages/diffusion/fused.py`` installed as the server installs them. Milliseconds are
  the median of ``triton.testing.do_bench`` (launched from Python: the host's pace counts) and of
  the step replayed from one CUDA graph (the GPU's time alone). ``--gemms library,triton`` gives
  each quantized row once per W8A8 GEMM (``kernels/w8a8.py``'s ``GEMM``: the library's products, or
  ``kernels/w8a8_gemm.py``'s Triton GEMM with the scales and bias in its epilogue);
  ``--gated-epilogue on,off`` once with Z-Image's gated unit in the ``w13`` GEMM's epilogue and once
  apart (``kernels/swiglu.py``'s ``GATED_EPILOGUE``); ``--hold-rows on,off`` every row, bf16's too,
  once with the rows of the norms and of the per-token quantization held in registers and once read
  again for each pass (``kernels/settings.py``'s ``HOLD_ROWS``); ``--v-peak on,off`` each quantized
  row with V's peak for the fp8 attention found in the ``to_qkv`` GEMM's epilogue and in a pass of
  its own (``stages/diffusion/fused.py``'s ``V_PEAK_IN_PRODUCT``); ``--paired-norms on,off`` every
  row with the residual update after the attention and the feed-forward's norm as one kernel and as
  two (``fused.PAIRED_NORMS``).
- **Final images** (``--final``): Z-Image's 8 Euler steps (the pipeline's flow-matching schedule,
  shift 3, random caption features in place of the text encoder) then its VAE, per weight format,
  from the same noise: the PSNR of the decoded pixels against bf16's. With ``--wan``, also Wan's
  video: ``--final-steps`` UniPC steps (flow shift 3, no guidance, random text features), then
  its VAE at ``exact``, 81 frames.
- **Conv inputs** (``--conv-input``): the kernel of ``kernels/conv_input.py`` alone at the Wan
  decoder's top level, against the eager chain, with the bandwidth of the bytes it moves.
- **Conv layouts** (``--conv-layouts``): whether cuDNN's convolutions at the decoder's shapes (each
  kind: 3x3x3, the shortcuts' 1x1x1, the upsamplers' 3x1x1 and 2D 3x3) give the same bits for
  NCDHW and channels-last inputs.
- **Norm orders** (``--norm-orders``): candidate summation orders for the channel norms of
  channels-last frames, against ATen's norms of NCDHW frames (elements that differ).
- **VAE decodes** (``--vae 480p,720p``): the Wan 2.1 VAE decoding 81 frames (21 latent frames) in
  ``--vae-dtype``, with diffusers' decoder (``off``) and the ``exact`` and ``fast`` levels on the
  same latents: time per decode (the median of ``--repeats``), peak memory, and whether the pixels
  are bitwise diffusers' (else their PSNR). ``--vae-profile`` adds the top CUDA kernels per level;
  ``--tiled`` runs the levels with the tiled kernels for channels-last frames in place of the flat
  ones (``conv_input.FLAT_CHANNELS_LAST``), for comparison. ``--fast-convs`` runs the ``fast``
  level once per form of its 3x3x3 convolutions (``wan_vae_fast.FAST_CONV``: ``3d``, ``summed``,
  ``stacked``; ``-all``: at every 3x3x3 convolution instead of ``FAST_CONV_SHAPES``' only).
- **Conv speed** (``--conv-speed``): each decoder convolution's time and TFLOP/s as the levels run
  it, against the 2D forms of a 3x3x3 one (see ``conv_speed_rows``).
- **Fused epilogues** (``--conv-cudnn``): each decoder convolution with its bias and a residual add
  after it in ATen, against a cuDNN graph that adds them in the convolution's epilogue (see
  ``conv_cudnn_rows``). ``--fast-ablations`` adds ``fast`` decodes without and with the fused
  epilogues at ``FAST_CONV_SHAPES``' convolutions (``wan_vae_fast.FUSED_EPILOGUE``: ``off``,
  ``shapes``; ``all`` costs each shape's plans at its first call), in their default form and the
  stacked one.
  ``exact`` runs twice: its convolutions all in ATen, and those of
  ``wan_vae_fast.GRAPH_CONV_SHAPES`` as cuDNN graphs (ATen's bits; the default).

    python benchmarks/quant_vae.py [--wan 1.3b|14b] [--wan-size 480p|720p] [--final [--final-steps N]]
        [--vae 480p,720p] [--vae-dtype bf16|fp32] [--fast-convs summed,stacked-all,...] [--tiled]
        [--conv-input] [--conv-layouts] [--conv-speed] [--conv-cudnn] [--fast-ablations]
        [--norm-orders] [--skip-zimage] [--dit-profile] [--gemms library,triton] [--gated-epilogue on,off]
        [--hold-rows on,off] [--v-peak on,off] [--paired-norms on,off] [--gemm-tiles 8,14]
        [--formats "fp8, fp8 attention"]
        [--attention-plans N]

- **DiT profile** (``--dit-profile``): one Z-Image step's (with ``--wan``, one Wan step's, in
  place of the Wan rows of the steps table) time under each SDPA backend; for bf16 and fp8 its
  wall time, the host's time to queue it and its replay from one CUDA graph, and its CUDA kernel
  time by kind (GEMMs, attention, Triton kernels, ATen's elementwise) and top kernels.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"480p": (60, 104), "720p": (90, 160)}


def bench(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=2, rep=20, return_mode="median"))


def replay_ms(fn) -> float | None:
    """Milliseconds of ``fn`` replayed from one CUDA graph (the GPU's time, whatever the host's
    pace), or None where it cannot be captured."""
    import triton.testing

    try:
        return float(triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median"))
    except Exception:  # a host sync in the forward: not capturable as it is
        torch.cuda.synchronize()
        return None


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def snr_db(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    return float(10 * torch.log10(want.pow(2).mean() / (got - want).pow(2).mean()))


#: The formats each table compares with bf16: (label, W8A8 kind, attention: ``off``; ``e4m3
#: out``, fp8 attention as the server runs it, its output in e4m3 into the fp8 ``to_out``; ``wide
#: out``, its output in bf16, quantized for ``to_out`` in a pass of its own).
FORMATS = (
    ("int8", "int8", "off"),
    ("fp8", "fp8", "off"),
    ("fp8, fp8 attention", "fp8", "e4m3 out"),
    ("fp8, fp8 attention, bf16 output", "fp8", "wide out"),
)


@contextlib.contextmanager
def attention_in_fp8(attention: str):
    """``kernels.settings.FP8_ATTENTION`` (``--fp8-attention``) and
    ``fused.FP8_ATTENTION_E4M3_OUT`` as ``attention`` (:data:`FORMATS`) says, for the block."""
    from omnirt.kernels import settings
    from omnirt.stages.diffusion import fused

    before = settings.FP8_ATTENTION, fused.FP8_ATTENTION_E4M3_OUT
    settings.set_fp8_attention("off" if attention == "off" else "on")
    fused.FP8_ATTENTION_E4M3_OUT = attention == "e4m3 out"
    try:
        yield
    finally:
        settings.set_fp8_attention(before[0])
        fused.FP8_ATTENTION_E4M3_OUT = before[1]


#: The W8A8 GEMMs each quantized row runs with (``--gemms``; ``kernels.w8a8.GEMMS``), one row each.
GEMMS: tuple[str, ...] = ("auto",)


#: The quantized rows measured (``--formats``: labels of :data:`FORMATS`; empty: all).
FORMAT_LABELS: tuple[str, ...] = ()


def _default_tiles():
    from omnirt.kernels import w8a8_gemm

    return w8a8_gemm.DEFAULT


#: The Triton GEMM's default tiles in each quantized row (``--gemm-tiles``: indices of
#: ``w8a8_gemm.CONFIGS``), one row each; set at start-up to the module's default.
TILES: tuple[Any, ...] = ()


@contextlib.contextmanager
def gemm_tiles(config):
    """``kernels.w8a8_gemm.DEFAULT`` (the Triton GEMM's tiles for many rows) for the block."""
    from omnirt.kernels import w8a8_gemm

    before, w8a8_gemm.DEFAULT = w8a8_gemm.DEFAULT, config
    try:
        yield
    finally:
        w8a8_gemm.DEFAULT = before


#: ``kernels.swiglu.GATED_EPILOGUE`` in each quantized row (``--gated-epilogue``), one row each;
#: None: as it is.
GATED_EPILOGUE: tuple[bool | None, ...] = (None,)
#: ``kernels.settings.HOLD_ROWS`` in each row, bf16's included (``--hold-rows``), one row each;
#: None: the module's own setting.
HOLD_ROWS: tuple[bool | None, ...] = (None,)


#: ``stages.diffusion.fused.V_PEAK_IN_PRODUCT`` in each quantized row (``--v-peak``), one row each;
#: None: as it is.
V_PEAK: tuple[bool | None, ...] = (None,)


#: ``stages.diffusion.fused.PAIRED_NORMS`` in each row, bf16's too (``--paired-norms``); None: as it is.
PAIRED: tuple[bool | None, ...] = (None,)


@contextlib.contextmanager
def module_flag(module: Any, name: str, on: bool | None):
    """``module.name`` set to ``on`` for the block (None: as it is)."""
    before = getattr(module, name)
    setattr(module, name, before if on is None else on)
    try:
        yield
    finally:
        setattr(module, name, before)


def _gemm_note(gemm: str) -> str:
    return {"triton": ", Triton GEMM", "library": ", library GEMM"}.get(gemm, "")


def _attention_note(attention: str) -> str:
    """What the fp8 attention did in the rows so far: cuDNN's plans built, shapes it declined."""
    from omnirt.kernels import fp8_attention

    if attention == "off":
        return ""
    if not fp8_attention._plans:
        return " (not applied: bf16 attention)"
    refused = fp8_attention._plans.declined
    declined = f", {len(refused)} shapes declined" if refused else ""
    return f" ({len(fp8_attention._plans)} cuDNN plans{declined})"


def quantized_copies(model: torch.nn.Module):
    """``(label, model, layers, weight bytes, attention)`` per :data:`FORMATS` (those of
    :data:`FORMAT_LABELS` where it names some; no copy for a kind none of them asks): a quantized copy
    of ``model`` per W8A8 kind, with the fused paths installed (merging the layers that read one
    input, as the server does), each dropped before the next is made (the caller drops its name
    for it at the end of each turn: ``del``). The copy shares the linear layers' weights and biases
    with ``model`` until they are quantized (read, not changed), so the bf16 weights are never held
    twice: Wan 14B's 26.7 GiB and its quantized copy fit an 80 GB card."""
    current, quantized, done = None, None, None
    for label, kind, attention in FORMATS:
        if FORMAT_LABELS and label not in FORMAT_LABELS:
            continue
        if kind != current:
            del quantized
            torch.cuda.empty_cache()
            quantized, done = quantized_copy(model, kind)
            current = kind
        yield label, quantized, done.layers, done.bytes_after, attention
    del quantized
    torch.cuda.empty_cache()


def quantized_copy(model: torch.nn.Module, kind: str) -> tuple[torch.nn.Module, Any]:
    """A copy of ``model`` with its linear layers quantized to ``kind`` and the fused paths
    installed, and ``quantize_model``'s report. The copy shares the linear layers' weights and
    biases with ``model`` until they are quantized (read, not changed)."""
    from omnirt.stages.diffusion import fused
    from omnirt.stages.diffusion.quant import quantize_model

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    shared = {id(t): t for m in linears for t in (m.weight, m.bias) if t is not None}
    quantized = copy.deepcopy(model, shared)
    done = quantize_model(quantized, kind)
    fused.install(quantized)
    return quantized, done


def rows_for(name: str, model: torch.nn.Module, call) -> list[str]:
    """The step's table rows, bf16 then each quantized copy (and W8A8 GEMM), each printed as it is
    measured."""
    from omnirt.kernels import settings, swiglu, w8a8
    from omnirt.stages.diffusion import fused

    fused.install(model)  # as the server runs it on CUDA (issue 13's kernels), in every row

    with torch.no_grad():
        ref = call(model)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        base, rows = {}, []
        for hold, paired in itertools.product(HOLD_ROWS, PAIRED):
            with module_flag(settings, "HOLD_ROWS", hold), module_flag(fused, "PAIRED_NORMS", paired):
                ms = bench(lambda: call(model))
                base[hold, paired] = ms, replay_ms(lambda: call(model))
            gib = weights / 2**30
            notes = _note(hold, "norms' rows held", "norms' rows read again") + _note(paired, *PAIRED_NOTES)
            replay = _ms(base[hold, paired][1])
            rows.append(f"| {name} | bf16{notes} | {ms:.1f} | {replay} | 1.00x | 1.00x | {gib:.2f} | - |")
            print(rows[-1], flush=True)  # each row as it comes: a call cut short keeps the rows before
        for label, quantized, layers, size, attention in quantized_copies(model):
            combos = itertools.product(GEMMS, GATED_EPILOGUE, TILES, HOLD_ROWS, V_PEAK, PAIRED)
            for gemm, gated, tiles, hold, v_peak, paired in combos:
                with contextlib.ExitStack() as stack:
                    stack.enter_context(attention_in_fp8(attention))
                    stack.enter_context(w8a8.gemm_as(gemm))
                    stack.enter_context(module_flag(swiglu, "GATED_EPILOGUE", gated))
                    stack.enter_context(gemm_tiles(tiles))
                    stack.enter_context(module_flag(settings, "HOLD_ROWS", hold))
                    stack.enter_context(module_flag(fused, "V_PEAK_IN_PRODUCT", v_peak))
                    stack.enter_context(module_flag(fused, "PAIRED_NORMS", paired))
                    out = call(quantized)
                    ms = bench(lambda q=quantized: call(q))
                    replay = replay_ms(lambda q=quantized: call(q))
                notes = _attention_note(attention) + _gemm_note(gemm)
                notes += _note(gated, "gated in w13", "gated apart")
                notes += f", tiles {tiles.name()}" if len(TILES) > 1 or tiles != _default_tiles() else ""
                notes += _note(hold, "norms' rows held", "norms' rows read again")
                notes += _note(v_peak, "V's peak in to_qkv", "V's peak apart") + _note(paired, *PAIRED_NOTES)
                bf16_ms, bf16_replay = base[hold, paired]
                replayed = "-" if None in (replay, bf16_replay) else f"{bf16_replay / replay:.2f}x"
                rows.append(
                    f"| {name} | {label} ({layers} layers){notes} | {ms:.1f} | {_ms(replay)} "
                    f"| {bf16_ms / ms:.2f}x | {replayed} | {size / 2**30:.2f} | {snr_db(out, ref):.1f} |"
                )
                print(rows[-1], flush=True)
                del out
            del quantized
    return rows


#: The notes of a row with the norms paired and apart.
PAIRED_NOTES = ("norms paired", "norms apart")


def _note(setting: bool | None, on: str, off: str) -> str:
    """A row's note for a setting it ran with: nothing where it ran as it is (None)."""
    return "" if setting is None else f", {on if setting else off}"


def _zimage() -> tuple[torch.nn.Module, object]:
    """The Z-Image DiT (random bf16 weights, published config) and a call of one 1024x1024 step."""
    from diffusers import ZImageTransformer2DModel

    cfg = json.loads((ROOT / "benchmarks/models/z-image-turbo/z-image-turbo.components.json").read_text())
    cfg = {k: v for k, v in cfg["transformer"].items() if not k.startswith("_")}
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.device("cuda"):
        torch.manual_seed(0)
        model = ZImageTransformer2DModel.from_config(cfg).to(torch.bfloat16).eval()
    latents = [torch.randn(16, 1, 128, 128, device="cuda", dtype=torch.bfloat16, generator=g)]
    caption = [torch.randn(32, cfg["cap_feat_dim"], device="cuda", dtype=torch.bfloat16, generator=g)]
    t = torch.tensor([0.5], device="cuda", dtype=torch.bfloat16)
    return model, lambda m: m(latents, t, caption, return_dict=False)[0][0]


def zimage_rows() -> list[str]:
    model, call = _zimage()
    return rows_for("Z-Image 6.15B 1024x1024", model, call)


#: Kernel name fragments -> the category a DiT step's GPU time is reported under.
CATEGORIES = (
    ("attention", ("flash", "fmha", "sdpa", "attention", "cudnn_generated")),
    ("gemm", ("gemm", "xmma", "cutlass", "nvjet", "scaled_mm", "wgmma", "sm90", "Kernel2")),
    ("ATen elementwise, copies, reductions", ("at::native",)),
)


def _category(name: str) -> str:
    low = name.lower()
    for category, keys in CATEGORIES:
        if any(k.lower() in low for k in keys):
            return category
    return "Triton (omnirt's kernels)" if name.startswith("_") else "other"


def dit_profile(wan: tuple[str, str] | None = None, top: int = 16) -> None:
    """Where one Z-Image step's time goes (or, with ``wan`` = (variant, size), one Wan step's):
    per SDPA backend (bf16); per weight format its wall time, how long the host takes to queue
    it, its replay from one CUDA graph, and its kernels' time by kind and the top kernels."""
    from omnirt.stages.diffusion import fused
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model, call = _zimage() if wan is None else _wan(*wan)
    name = "Z-Image 1024x1024" if wan is None else f"Wan {wan[0]} {wan[1]} 81 frames"
    fused.install(model)
    backends = {
        "default": None, "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }  # fmt: skip
    print(f"\n| {name} step | SDPA backend | ms |\n|---|---|---|")
    table = [
        f"| {name} step | weights | wall ms | host enqueue ms | CUDA graph replay ms |",
        "|---|---|---|---|---|",
    ]
    with torch.no_grad():
        for label, backend in backends.items():
            try:
                with contextlib.nullcontext() if backend is None else sdpa_kernel([backend]):
                    ms = bench(lambda: call(model))
                print(f"| bf16 | {label} | {ms:.1f} |", flush=True)
            except RuntimeError as e:
                print(f"| bf16 | {label} | refused: {str(e).splitlines()[0][:80]} |", flush=True)
        fp8, _ = quantized_copy(model, "fp8")
        runs = [("bf16", model, "off")] + [(label, fp8, a) for label, kind, a in FORMATS if kind == "fp8"]
        for kind, m, attention in runs:
            with attention_in_fp8(attention):
                table.append(f"| {name} | {kind} | {_step_timings(m, call)} |")
                _host_profile(functools.partial(call, m), kind)
                totals = kernel_times(lambda m=m: call(m))
            by_kind: dict[str, float] = {}
            for key, (t, _) in totals.items():
                by_kind[_category(key)] = by_kind.get(_category(key), 0.0) + t
            whole = sum(by_kind.values())
            print(f"\n{kind}: CUDA kernel time of one step {whole / 1000:.1f} ms")
            for cat, t in sorted(by_kind.items(), key=lambda kv: -kv[1]):
                print(f"  {t / 1000:8.2f} ms {100 * t / whole:5.1f}% {cat}")
            print_top(totals, f"{kind}: the top kernels", top)
        del fp8
        torch.cuda.empty_cache()
    print("\n" + "\n".join(table), flush=True)


def _host_profile(fn, kind: str, steps: int = 3, top: int = 22) -> None:
    """Where the host's time goes while it queues ``steps`` steps (cProfile, by own time; the GPU
    is behind the host only if the step is host-bound, so nothing here waits on it)."""
    import cProfile
    import io
    import pstats

    fn()
    torch.cuda.synchronize()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        fn()
    profile.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(top)
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    print(f"\n{kind}: host time of {steps} steps, by function (own time)")
    print("\n".join(lines[:top + 8]), flush=True)


def _step_timings(m: torch.nn.Module, call) -> str:
    """A table row's cells: the step's wall time, host enqueue time (median of 5) and graph replay."""
    import triton.testing

    call(m)
    torch.cuda.synchronize()
    wall = bench(functools.partial(call, m))
    enqueue = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call(m)  # returns once every kernel is queued
        enqueue.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    try:
        graph = f"{triton.testing.do_bench_cudagraph(functools.partial(call, m), rep=100):.1f}"
    except Exception as e:  # a host sync in the forward: not capturable as it is
        graph = f"capture failed: {str(e).splitlines()[0][:60]}"
        torch.cuda.synchronize()
    return f"{wall:.1f} | {sorted(enqueue)[2]:.1f} | {graph}"


WAN_COMPONENTS = ROOT / "benchmarks/models/wan2.1-t2v/wan2.1-t2v.components.json"


def _wan_transformer(variant: str) -> torch.nn.Module:
    """The published Wan 2.1 T2V transformer config of ``variant`` with random bf16 weights (its
    fp32 parameters kept fp32, as the loader keeps them), on the GPU."""
    from diffusers import WanTransformer3DModel
    from omnirt.stages.diffusion.wan_loader import _cast_keeping_fp32

    cfg = json.loads(WAN_COMPONENTS.read_text())
    cfg = {k: v for k, v in cfg[f"transformer_{variant}"].items() if not k.startswith("_")}
    with torch.device("cuda"):
        torch.manual_seed(0)
        model = WanTransformer3DModel.from_config(cfg)
        _cast_keeping_fp32(model, torch.bfloat16)
    return model.eval()


def _wan(variant: str, size: str) -> tuple[torch.nn.Module, object]:
    """The Wan transformer of ``variant`` (:func:`_wan_transformer`) and a call of one step at
    ``size``, 81 frames, 512 random text features."""
    model = _wan_transformer(variant)
    g = torch.Generator(device="cuda").manual_seed(0)
    h, w = SIZES[size]
    video = torch.randn(1, 16, 21, h, w, device="cuda", dtype=torch.bfloat16, generator=g)
    text = torch.randn(1, 512, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    step = torch.tensor([500.0], device="cuda")
    return model, lambda m: m(video, step, text, return_dict=False)[0]


def wan_rows(variant: str, size: str) -> list[str]:
    return rows_for(f"Wan {variant} {size} 81 frames", *_wan(variant, size))


def wan_final_rows(variant: str, size: str, steps: int = 10) -> list[str]:
    """Wan's sampling loop (UniPC with the flow shift of Wan 2.1's scheduler, no guidance, random
    text features) then its VAE (``exact``), 81 frames, per weight format, from the same noise:
    the PSNR of the decoded frames against bf16's."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler
    from omnirt.stages.diffusion import fused, wan_vae_fast

    model = _wan_transformer(variant)
    vae_cfg = json.loads(WAN_COMPONENTS.read_text())["vae"]
    vae_cfg = {k: v for k, v in vae_cfg.items() if not k.startswith("_")}
    with torch.device("cuda"):
        torch.manual_seed(0)
        vae = AutoencoderKLWan.from_config(vae_cfg).to(torch.bfloat16).eval()
    wan_vae_fast.install(vae, "exact")
    g = torch.Generator(device="cuda").manual_seed(1)
    h, w = SIZES[size]
    noise = torch.randn(1, 16, 21, h, w, device="cuda", generator=g)
    text = torch.randn(1, 512, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    mean = torch.tensor(vae.config.latents_mean, device="cuda").view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, device="cuda").view(1, -1, 1, 1, 1)

    def sample(m: torch.nn.Module) -> torch.Tensor:
        scheduler = UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0, num_train_timesteps=1000
        )
        scheduler.set_timesteps(steps, device="cuda")
        latents = noise.clone()
        for t in scheduler.timesteps:
            out = m(latents.to(torch.bfloat16), t.expand(1), text, return_dict=False)[0]
            latents = scheduler.step(out.float(), t, latents, return_dict=False)[0]
        z = (latents * std + mean).to(torch.bfloat16)
        return vae.decode(z, return_dict=False)[0].clamp(-1, 1)

    fused.install(model)  # as the server runs it, in every row
    return final_rows(f"Wan {variant} {size} 81 frames, {steps} steps + VAE", model, sample)


def final_rows(name: str, model: torch.nn.Module, sample) -> list[str]:
    """One row per W8A8 format (:data:`FORMATS`): the PSNR of ``sample(quantized copy)``'s pixels
    against ``sample(model)``'s (each row printed as it comes)."""
    rows = []
    with torch.no_grad():
        ref = sample(model)
        for label, quantized, _, _, attention in quantized_copies(model):
            with attention_in_fp8(attention):
                psnr = psnr_db(sample(quantized), ref)
            rows.append(f"| {name} | {label}{_attention_note(attention)} | {psnr:.1f} |")
            print(rows[-1], flush=True)
            del quantized
    return rows


def psnr_db(got: torch.Tensor, want: torch.Tensor, peak: float = 2.0) -> float:
    """PSNR of pixels in [-1, 1] (peak-to-peak 2)."""
    mse = (got.float() - want.float()).pow(2).mean()
    return float("inf") if mse == 0 else float(10 * torch.log10(peak**2 / mse))


def zimage_final_rows(steps: int = 8) -> list[str]:
    """Z-Image's sampling loop (as ``ZImagePipeline``, no guidance) and its VAE, per weight format."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel

    comps = json.loads((ROOT / "benchmarks/models/z-image-turbo/z-image-turbo.components.json").read_text())
    strip = lambda d: {k: v for k, v in d.items() if not k.startswith("_")}  # noqa: E731
    with torch.device("cuda"):
        torch.manual_seed(0)
        model = ZImageTransformer2DModel.from_config(strip(comps["transformer"])).to(torch.bfloat16).eval()
        vae_cfg = strip(comps["vae"])  # the published config, with the block lists its 4 levels imply
        vae_cfg.update(down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4)
        vae_cfg.update(use_quant_conv=False, use_post_quant_conv=False)
        vae = AutoencoderKL.from_config(vae_cfg).to(torch.bfloat16).eval()
    g = torch.Generator(device="cuda").manual_seed(1)
    noise = torch.randn(1, 16, 128, 128, device="cuda", generator=g)
    caption = [torch.randn(32, model.config.cap_feat_dim, device="cuda", dtype=torch.bfloat16, generator=g)]

    def sample(m: torch.nn.Module) -> torch.Tensor:
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(strip(comps["scheduler"]))
        scheduler.set_timesteps(steps, device="cuda")
        latents = noise.clone()
        for t in scheduler.timesteps:
            timestep = (1000 - t.expand(1)) / 1000
            out = m(
                list(latents.to(torch.bfloat16).unsqueeze(2).unbind(0)), timestep, caption, return_dict=False
            )[0]
            latents = scheduler.step(-out[0].squeeze(1).float().unsqueeze(0), t, latents, return_dict=False)[
                0
            ]
        z = latents.to(torch.bfloat16) / vae.config.scaling_factor + vae.config.shift_factor
        return vae.decode(z, return_dict=False)[0].clamp(-1, 1)

    return final_rows(f"Z-Image 1024x1024, {steps} steps + VAE", model, sample)


def _time_decode(vae: torch.nn.Module, z: torch.Tensor, repeats: int) -> tuple[float, torch.Tensor]:
    vae.decode(z[:, :, :3], return_dict=False)  # warm: Triton compiles, cuDNN picks (chunks 0, 1, steady)
    times = []
    out = None
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = vae.decode(z, return_dict=False)[0]
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2], out


def kernel_times(fn) -> dict[str, tuple[float, int]]:
    """CUDA kernel time (microseconds) and launches of one ``fn()``, per kernel name."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    return {e.key: (e.self_device_time_total, e.count) for e in events if e.self_device_time_total}


def print_top(totals: dict[str, tuple[float, int]], label: str, top: int) -> None:
    """``label`` with the kernels' total, then the ``top`` kernels by time."""
    whole = sum(t for t, _ in totals.values())
    print(f"\n{label}, {whole / 1000:.1f} ms")
    for key, (t, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {t / 1000:8.2f} ms {100 * t / whole:5.1f}% x{n:<5d} {key[:110]}")


def _profile(vae: torch.nn.Module, z: torch.Tensor, label: str, top: int = 14) -> None:
    totals = kernel_times(lambda: vae.decode(z[:, :, :5], return_dict=False))
    print_top(totals, f"{label}: CUDA kernels of a 5-latent-frame decode", top)


def vae_rows(
    size: str, dtype: torch.dtype, repeats: int, profile_levels: bool, fast_convs: tuple[str, ...],
    ablations: bool = False,
) -> list[str]:  # fmt: skip
    from diffusers import AutoencoderKLWan
    from omnirt.stages.diffusion import wan_vae_fast

    cfg = json.loads((ROOT / "benchmarks/models/wan2.1-t2v/wan2.1-t2v.components.json").read_text())["vae"]
    with torch.device("cuda"):
        torch.manual_seed(0)
        vae = AutoencoderKLWan.from_config({k: v for k, v in cfg.items() if not k.startswith("_")})
    vae = vae.to(dtype).eval()
    h, w = SIZES[size]
    z = torch.randn(1, 16, 21, h, w, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    z = z.to(dtype)
    name = f"Wan VAE decode {size} 81 frames {str(dtype).removeprefix('torch.')}"
    default, epilogue = wan_vae_fast.FAST_CONV, wan_vae_fast.FUSED_EPILOGUE
    graphs = wan_vae_fast.GRAPH_CONV_SHAPES
    rows = []
    with torch.no_grad():
        base = ref = None
        shapes = wan_vae_fast.FAST_CONV_SHAPES
        # (level, label, form, the fused epilogues, the convolutions run as cuDNN graphs)
        runs = [
            ("off", "off", "3d", epilogue, graphs),
            ("exact", "exact, ATen's convolutions", "3d", epilogue, frozenset()),
            ("exact", f"exact, cuDNN graphs at {_pairs(graphs)}", "3d", epilogue, graphs),
        ]
        for form in fast_convs:
            at = None if form.endswith("-all") else shapes
            label = f"fast, {form.removesuffix('-all')} at {_pairs(at)}"
            runs.append(("fast", label, form, epilogue, graphs))
        if ablations:  # the default form and the stacked one, without and with the fused epilogues
            for form in dict.fromkeys((default, "stacked")):
                for fused in ("off", "shapes"):
                    where = "none" if fused == "off" else f"at {_pairs(shapes)}"
                    label = f"fast, {form} at {_pairs(shapes)}, fused epilogues {where}"
                    runs.append(("fast", label, form, fused, graphs))
        for level, label, form, fused, graph_shapes in runs:
            wan_vae_fast.GRAPH_CONV_SHAPES = graph_shapes
            wan_vae_fast.FUSED_EPILOGUE = fused
            wan_vae_fast.FAST_CONV = form.removesuffix("-all")
            wan_vae_fast.FAST_CONV_SHAPES = None if form.endswith("-all") else shapes
            wan_vae_fast.install(vae, level)
            torch.cuda.reset_peak_memory_stats()
            ms, out = _time_decode(vae, z, repeats)
            peak = torch.cuda.max_memory_allocated() / 2**30
            if level == "off":
                base, ref = ms, out
                same = "-"
            else:
                same = "bitwise" if torch.equal(out, ref) else f"PSNR {psnr_db(out, ref):.1f} dB"
            rows.append(f"| {name} | {label} | {ms:.0f} | {base / ms:.2f}x | {peak:.1f} | {same} |")
            print(rows[-1], flush=True)
            if profile_levels:
                _profile(vae, z, f"{name}, {label}")
            del out
        wan_vae_fast.uninstall(vae)
        wan_vae_fast.FAST_CONV, wan_vae_fast.FAST_CONV_SHAPES = default, shapes
        wan_vae_fast.FUSED_EPILOGUE, wan_vae_fast.GRAPH_CONV_SHAPES = epilogue, graphs
    return rows


def _pairs(shapes: frozenset[tuple[int, int]] | None) -> str:
    """``FAST_CONV_SHAPES`` as a label: "96 -> 96, ..." or "every 3x3x3"."""
    return "every 3x3x3" if shapes is None else ", ".join(f"{a} -> {b}" for a, b in sorted(shapes))


def conv_input_rows() -> list[str]:
    """The conv-input kernel alone at the decoder's top level (480p, 96 channels, 4 new frames, 2
    cached): time against the eager chain, and the bandwidth of the bytes it must move."""
    from omnirt.kernels.conv_input import causal_conv_input, causal_conv_input_reference

    g = torch.Generator(device="cuda").manual_seed(3)
    rows = []
    for layout in ("contiguous", "channels_last"):
        cl = layout == "channels_last"
        x = torch.randn(1, 96, 4, 480, 832, device="cuda", generator=g).to(torch.bfloat16)
        if cl:
            x = x.contiguous(memory_format=torch.channels_last_3d)
        cache = torch.randn(1, 96, 2, 480, 832, device="cuda", generator=g).to(torch.bfloat16)
        gamma = torch.rand(96, 1, 1, 1, device="cuda", generator=g).to(torch.bfloat16) + 0.5
        moved = (x.numel() + cache.numel() + 96 * 6 * 482 * 834) * 2 + 2 * 96 * 480 * 832 * 2
        for norm in (None, (gamma, 96**0.5)):
            args = (x, cache)
            kw = {"time_pad": 2, "spatial_pad": 1, "norm": norm}
            eager = functools.partial(causal_conv_input_reference, *args, **kw)
            kernel = functools.partial(causal_conv_input, *args, **kw, channels_last=cl)
            base, ms = bench(eager), bench(kernel)
            chain = "norm + SiLU" if norm else "copy"
            rows.append(
                f"| {layout} | {chain} | {base:.2f} | {ms:.2f} | {base / ms:.1f}x | {moved / ms / 1e6:.0f} |"
            )
    return rows


#: The Wan decoder's convolutions at 480p: kind, channels in and out, kernel (3D: frames, rows,
#: columns; 2D: rows, columns), input (padded frames or frames, rows, columns).
DECODER_CONVS = (
    ("causal", 96, 96, (3, 3, 3), (6, 482, 834)),
    ("causal", 192, 192, (3, 3, 3), (6, 242, 418)),
    ("causal", 384, 384, (3, 3, 3), (3, 62, 106)),
    ("causal", 96, 3, (3, 3, 3), (6, 482, 834)),
    ("causal", 16, 384, (3, 3, 3), (3, 62, 106)),
    ("shortcut", 192, 384, (1, 1, 1), (2, 120, 208)),
    ("time", 384, 768, (3, 1, 1), (3, 60, 104)),
    ("time", 384, 768, (3, 1, 1), (4, 120, 208)),
    ("resample", 384, 192, (3, 3), (2, 120, 208)),
    ("resample", 384, 192, (3, 3), (4, 240, 416)),
    ("resample", 192, 96, (3, 3), (4, 480, 832)),
)


def conv_layout_rows() -> list[str]:
    """Whether cuDNN's convolutions at the Wan decoder's shapes give the same bits for NCDHW inputs
    and for channels-last ones (the weight as the module holds it, contiguous: ATen copies it to
    the input's layout), as the ``exact`` level runs them."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for kind, c_in, c_out, kernel, (t, h, w) in DECODER_CONVS:
            weight = (torch.randn(c_out, c_in, *kernel, device="cuda") * 0.05).to(dtype)
            if len(kernel) == 3:
                x = torch.randn(1, c_in, t, h, w, device="cuda").to(dtype)
                ncdhw = F.conv3d(x, weight)
                ndhwc = F.conv3d(x.contiguous(memory_format=torch.channels_last_3d), weight)
            else:  # an upsampler's frames, each padded by one
                x = torch.randn(t, c_in, h, w, device="cuda").to(dtype)
                ncdhw = F.conv2d(x, weight, padding=1)
                ndhwc = F.conv2d(x.contiguous(memory_format=torch.channels_last), weight, padding=1)
            same = torch.equal(ncdhw, ndhwc.contiguous())
            size = "x".join(map(str, kernel))
            rows.append(
                f"| {str(dtype).removeprefix('torch.')} | {kind} {size}: {c_in} -> {c_out}, {t}x{h}x{w} "
                f"| {same} |"
            )
    return rows


def _rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def _conv_forms(kind: str, c_in: int, c_out: int, kernel: tuple, shape: tuple) -> list[str]:
    """One row of :func:`conv_speed_rows` per form of one decoder convolution."""
    import torch.nn.functional as F

    t, h, w = shape
    cl2, cl3 = torch.channels_last, torch.channels_last_3d
    weight = (torch.randn(c_out, c_in, *kernel, device="cuda") * 0.05).to(torch.bfloat16)
    if len(kernel) == 3:
        x = torch.randn(1, c_in, t, h, w, device="cuda").to(torch.bfloat16).contiguous(memory_format=cl3)
        as_run = functools.partial(F.conv3d, x, weight.contiguous(memory_format=cl3))
    else:
        x = torch.randn(t, c_in, h, w, device="cuda").to(torch.bfloat16).contiguous(memory_format=cl2)
        as_run = functools.partial(F.conv2d, x, weight.contiguous(memory_format=cl2), padding=1)
    ref = as_run()
    flops = 2 * ref.numel() * c_in * weight[0, 0].numel()
    base = bench(as_run)
    label = f"{kind} {'x'.join(map(str, kernel))}: {c_in} -> {c_out}, {t}x{h}x{w}"

    def row(form: str, ms: float, err: float | None, extra: float = 0.0) -> str:
        diff = "-" if err is None else f"{err:.1e}"
        speed = f"{flops / ms / 1e9:.0f} | {base / (ms + extra):.2f}x"
        return f"| {label} | {form} | {ms:.3f} | {speed} | {diff} |"

    rows = [row("as run", base, None)]
    if kind != "causal":
        return rows
    kt = kernel[0]
    frames = t - kt + 1
    thwc = x.permute(0, 2, 3, 4, 1)[0]  # the channels-last frames as [t, h, w, c]
    # One 2D convolution: output frame f reads input frames f..f+kt-1 stacked along the channels.
    w2 = weight.permute(0, 2, 1, 3, 4).reshape(c_out, kt * c_in, *kernel[1:]).contiguous(memory_format=cl2)

    def stack() -> torch.Tensor:
        return torch.cat([thwc[k : k + frames] for k in range(kt)], dim=-1).permute(0, 3, 1, 2)

    stacked = stack()
    one = functools.partial(F.conv2d, stacked, w2)
    copy_ms = bench(stack)
    err = _rel_diff(one().permute(1, 0, 2, 3).unsqueeze(0), ref)
    rows.append(row(f"2D over stacked frames (+ stack {copy_ms:.3f} ms)", bench(one), err, copy_ms))
    graph = _cudnn_conv(stacked, w2, [0, 0], None, None)  # the same, cuDNN's fastest of its first plans
    if isinstance(graph, str):
        rows.append(f"| {label} | 2D over stacked frames, cuDNN graph | {graph} | | | |")
    else:
        err = _rel_diff(graph().permute(1, 0, 2, 3).unsqueeze(0), ref)
        rows.append(row("2D over stacked frames, cuDNN graph (+ stack)", bench(graph), err, copy_ms))
    planes = [thwc[k : k + frames].permute(0, 3, 1, 2) for k in range(kt)]
    parts = [weight[:, :, k].contiguous(memory_format=cl2) for k in range(kt)]

    def summed() -> torch.Tensor:
        out = F.conv2d(planes[0], parts[0])
        for k in range(1, kt):
            out += F.conv2d(planes[k], parts[k])
        return out

    err = _rel_diff(summed().permute(1, 0, 2, 3).unsqueeze(0), ref)
    rows.append(row("three 2D summed", bench(summed), err))
    if c_out < 16:
        padded = torch.zeros(16, *weight.shape[1:], device="cuda", dtype=weight.dtype)
        padded[:c_out] = weight
        wide = functools.partial(F.conv3d, x, padded.contiguous(memory_format=cl3))
        rows.append(row("outputs padded to 16", bench(wide), _rel_diff(wide()[:, :c_out], ref)))
    return rows


def conv_speed_rows() -> list[str]:
    """Each decoder convolution's time (bf16, channels-last, as the ``exact`` level runs it) and its
    TFLOP/s, against the forms a ``fast`` level could take: a 3x3x3 one as one 2D convolution over
    its three frames stacked along the channels (the stacking copy timed apart, and counted in the
    speed-up), or as three 2D convolutions summed; the 96 -> 3 head with its output channels
    padded to 16. Last column: the largest difference from the convolution as run, relative to its
    largest value."""
    torch.manual_seed(0)
    return [row for conv in DECODER_CONVS for row in _conv_forms(*conv)]


def _cudnn_conv(x: torch.Tensor, weight: torch.Tensor, padding: list[int], bias: torch.Tensor | None,
                residual: torch.Tensor | None) -> Any:  # fmt: skip
    """``kernels/cudnn_conv.py``'s graph of one convolution with ``bias`` and ``residual`` (where
    given) in its epilogue, its plan chosen as the module chooses it (the fastest of the first
    ``AUTOTUNE_PLANS``, timed on these tensors). Returns a callable running it, or the reason cuDNN
    declined it."""
    import cudnn
    from omnirt.kernels import cudnn_conv

    addends = () if residual is None else (residual,)
    shape = cudnn_conv._shape(x, weight, tuple(padding), bias, addends)
    out = cudnn_conv._empty_out(x, weight, tuple(padding))
    pack = cudnn_conv._pack(x, weight, bias, addends, out)
    try:
        plan = cudnn_conv._build(cudnn, shape, lambda: pack)
    except Exception as error:  # a probe: report why and go on
        return f"declined: {str(error).splitlines()[0][:80]}"

    def run() -> torch.Tensor:
        plan.execute(pack)
        return out

    return run


def _conv_cudnn_forms(kind: str, c_in: int, c_out: int, kernel: tuple, shape: tuple) -> list[str]:
    """The rows of :func:`conv_cudnn_rows` for one decoder convolution."""
    import torch.nn.functional as F

    t, h, w = shape
    cl = torch.channels_last_3d if len(kernel) == 3 else torch.channels_last
    weight = (torch.randn(c_out, c_in, *kernel, device="cuda") * 0.05).to(torch.bfloat16)
    weight = weight.contiguous(memory_format=cl)
    if len(kernel) == 3:
        x = torch.randn(1, c_in, t, h, w, device="cuda").to(torch.bfloat16).contiguous(memory_format=cl)
        padding, conv = [0, 0, 0], F.conv3d
    else:
        x = torch.randn(t, c_in, h, w, device="cuda").to(torch.bfloat16).contiguous(memory_format=cl)
        padding, conv = [1, 1], F.conv2d
    bias = torch.randn(c_out, device="cuda").to(torch.bfloat16)
    plain = conv(x, weight, padding=padding)
    residual = torch.randn_like(plain)

    def aten() -> torch.Tensor:
        return conv(x, weight, bias, padding=padding).add_(residual)

    want = aten()
    flops = 2 * plain.numel() * c_in * weight[0, 0].numel()
    label = f"{kind} {'x'.join(map(str, kernel))}: {c_in} -> {c_out}, {t}x{h}x{w}"
    base_conv, base = bench(functools.partial(conv, x, weight, padding=padding)), bench(aten)

    def row(form: str, ms: float, err: float | None) -> str:
        diff = "-" if err is None else f"{err:.1e}"
        return f"| {label} | {form} | {ms:.3f} | {flops / ms / 1e9:.0f} | {base / ms:.2f}x | {diff} |"

    rows = [row("conv alone (ATen)", base_conv, None), row("conv + bias + add (ATen)", base, None)]
    for form, b, r, ref in (("cuDNN graph, conv alone", None, None, plain),
                            ("cuDNN bf16, bias + add fused", bias, residual, want)):  # fmt: skip
        fused = _cudnn_conv(x, weight, padding, b, r)
        if isinstance(fused, str):
            rows.append(f"| {label} | {form} | {fused} | | | |")
        else:
            rows.append(row(form, bench(fused), _rel_diff(fused(), ref)))
    return rows


def conv_cudnn_rows() -> list[str]:
    """Each decoder convolution (bf16, channels-last) as the levels run it, then followed by its
    bias and a residual add in ATen, against a cuDNN frontend graph that fuses that bias and add
    into the convolution's epilogue (``kernels/cudnn_conv.py``'s graph, here with the fastest of
    its first plans). Speed-ups against the convolution + bias + add in ATen; last column: the
    largest difference from that, relative to its largest value."""
    torch.manual_seed(0)
    rows = []
    for conv in DECODER_CONVS:
        try:
            rows += _conv_cudnn_forms(*conv)
        except Exception as error:  # a probe: report and go on
            rows.append(f"| {conv} | error {type(error).__name__}: {str(error)[:100]} | | | | |")
        torch.cuda.empty_cache()
    return rows


#: Frames whose channel norms the probe checks: the decoder's at 480p and 720p (channels,
#: frames, rows, columns) and shapes with tails.
NORM_SHAPES = (
    (384, 1, 60, 104), (384, 2, 120, 208), (192, 4, 240, 416), (96, 4, 480, 832),
    (384, 1, 90, 160), (96, 4, 720, 1280), (384, 1, 5, 7), (96, 1, 6, 7), (384, 2, 3, 7), (192, 1, 4, 4),
)  # fmt: skip


def norm_order_rows() -> list[str]:
    """Candidate orders for the channel norms of channels-last frames (``conv_input.channel_norms_cl``
    with ``S`` threads a pixel, each fold an FMA or a product and a sum) against ATen's norms of
    the same frames in NCDHW memory (what ``F.normalize(x.float(), dim=1)`` takes): elements that
    differ, per candidate; and ATen's own norms of the channels-last frames."""
    from omnirt.kernels.conv_input import channel_norms_cl
    from omnirt.kernels.reduce_order import aten_channel_splits

    g = torch.Generator(device="cuda").manual_seed(5)
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for c, t, h, w in NORM_SHAPES:
            for b in (1, 2) if h * w < 1000 else (1,):
                x = (torch.randn(b, c, t, h, w, device="cuda", generator=g) * 3).to(dtype)
                want = x.float().norm(2, 1, keepdim=True)
                cl = x.contiguous(memory_format=torch.channels_last_3d)
                cells = []
                for s in (1, 2, 4, 8, 16):
                    try:
                        counts = [int((channel_norms_cl(cl, splits=s, fma=f) != want).sum()) for f in (1, 0)]
                        cells.append(f"{counts[0]}/{counts[1]}")
                    except Exception as e:  # a probe: report and go on
                        cells.append(f"error {type(e).__name__}")
                aten_cl = int((cl.float().norm(2, 1, keepdim=True) != want).sum())
                rows.append(
                    f"| {str(dtype).removeprefix('torch.')} | {b}x{c}x{t}x{h}x{w} | {want.numel()} "
                    f"| {aten_channel_splits(c, t * h * w, b)} | {' | '.join(cells)} | {aten_cl} |"
                )
    return rows


def _on_off(p: argparse.ArgumentParser, flag: str, value: str) -> tuple[bool | None, ...]:
    """A setting's rows from ``on``, ``off`` or ``on,off`` (a row each); none given: one row, the
    setting as it is (None)."""
    settings = [v for v in value.split(",") if v]
    if any(v not in ("on", "off") for v in settings):
        p.error(f"{flag} takes on, off or both")
    return tuple(v == "on" for v in settings) or (None,)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wan", choices=("1.3b", "14b"), default=None, help="also a Wan transformer step")
    p.add_argument("--wan-size", choices=tuple(SIZES), default="480p")
    p.add_argument("--skip-zimage", action="store_true", help="no Z-Image transformer step")
    p.add_argument(
        "--final", action="store_true",
        help="also the final outputs per weight format: Z-Image's images, and with --wan its videos",
    )  # fmt: skip
    p.add_argument("--final-steps", type=int, default=10, help="--final with --wan: sampling steps")
    p.add_argument("--vae", default="", help="Wan VAE decodes at these sizes (comma-separated: 480p,720p)")
    p.add_argument("--vae-dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--repeats", type=int, default=3, help="timed decodes per VAE level (the median)")
    p.add_argument(
        "--fast-convs",
        default="stacked",
        help="VAE: the fast level once per convolution form (3d, summed, stacked, graph; with -all: at every "
        "3x3x3 convolution, not only wan_vae_fast.FAST_CONV_SHAPES), comma-separated",
    )
    p.add_argument("--vae-profile", action="store_true", help="the top CUDA kernels of each VAE level")
    p.add_argument(
        "--fast-ablations", action="store_true",
        help="VAE: also the fast level without and with fused epilogues at its shapes (FUSED_EPILOGUE)",
    )  # fmt: skip
    p.add_argument("--conv-input", action="store_true", help="the conv-input kernel alone, against eager")
    p.add_argument("--conv-layouts", action="store_true", help="NCDHW and NDHWC convolutions: same bits?")
    p.add_argument("--tiled", action="store_true", help="VAE: the tiled kernels for channels-last frames")
    p.add_argument("--conv-speed", action="store_true", help="decoder convolutions: time, other forms")
    p.add_argument("--conv-cudnn", action="store_true", help="convolutions: bias + add fused by cuDNN")
    p.add_argument("--norm-orders", action="store_true", help="channel-norm orders vs ATen's")
    p.add_argument("--dit-profile", action="store_true", help="Z-Image step: GPU time by kind, SDPA backends")
    p.add_argument(
        "--gemms", default="auto",
        help="transformer steps: a row per W8A8 GEMM (auto: as the server runs them; library; triton: "
        "kernels/w8a8_gemm.py), comma-separated; the DiT profile and final outputs run the first",
    )  # fmt: skip
    p.add_argument(
        "--gated-epilogue", default="",
        help="transformer steps: a row per setting (on,off) of Z-Image's gated unit in w13's GEMM epilogue",
    )  # fmt: skip
    p.add_argument(
        "--hold-rows", default="",
        help="transformer steps: a row per setting (on,off) of settings.HOLD_ROWS, bf16 too (default: as is)",
    )  # fmt: skip
    p.add_argument(
        "--paired-norms", default="",
        help="transformer steps: a row per setting (on,off) of fused.PAIRED_NORMS, bf16 too (default: as is)",
    )  # fmt: skip
    p.add_argument(
        "--v-peak", default="",
        help="transformer steps: a row per setting (on,off) of fused.V_PEAK_IN_PRODUCT (V's peak in to_qkv)",
    )  # fmt: skip
    p.add_argument(
        "--gemm-tiles", default="",
        help="transformer steps: a row per Triton GEMM tile configuration (indices of w8a8_gemm.CONFIGS)",
    )  # fmt: skip
    p.add_argument(
        "--formats", default="",
        help="steps and final outputs: only these quantized rows (labels of FORMATS, ';'-separated)",
    )  # fmt: skip
    p.add_argument(
        "--attention-plans", type=int, default=None,
        help="fp8 attention: time cuDNN's first N plans at a shape's first call (AUTOTUNE_PLANS)",
    )  # fmt: skip
    args = p.parse_args(argv)
    from omnirt.kernels import fp8_attention, w8a8

    if args.attention_plans is not None:
        fp8_attention.AUTOTUNE_PLANS = args.attention_plans

    global GEMMS, GATED_EPILOGUE, TILES, FORMAT_LABELS, HOLD_ROWS, V_PEAK, PAIRED
    from omnirt.kernels import w8a8_gemm

    try:
        TILES = tuple(w8a8_gemm.CONFIGS[int(i)] for i in args.gemm_tiles.split(",") if i)
        TILES = TILES or (w8a8_gemm.DEFAULT,)
    except (ValueError, IndexError):
        p.error(f"--gemm-tiles are indices of w8a8_gemm.CONFIGS (0 to {len(w8a8_gemm.CONFIGS) - 1})")
    FORMAT_LABELS = tuple(f for f in args.formats.split(";") if f)
    if any(f not in [label for label, _, _ in FORMATS] for f in FORMAT_LABELS):
        p.error(f"--formats are {'; '.join(label for label, _, _ in FORMATS)}")
    GEMMS = tuple(args.gemms.split(","))
    GATED_EPILOGUE = _on_off(p, "--gated-epilogue", args.gated_epilogue)
    HOLD_ROWS = _on_off(p, "--hold-rows", args.hold_rows)
    V_PEAK = _on_off(p, "--v-peak", args.v_peak)
    PAIRED = _on_off(p, "--paired-norms", args.paired_norms)
    if any(g not in w8a8.GEMMS for g in GEMMS):
        p.error(f"--gemms are {', '.join(w8a8.GEMMS)}")
    for kind in w8a8.KINDS:
        w8a8.set_gemm(kind, GEMMS[0])
    sizes = [s for s in args.vae.split(",") if s]
    if any(s not in SIZES for s in sizes):
        p.error(f"--vae sizes are {', '.join(SIZES)}")
    from omnirt.stages.diffusion.wan_vae_fast import FAST_CONVS

    forms = tuple(args.fast_convs.split(","))
    if any(form.removesuffix("-all") not in FAST_CONVS for form in forms):
        p.error(f"--fast-convs are {', '.join(FAST_CONVS)}, each optionally with -all")
    if not torch.cuda.is_available():
        print("benchmarks/quant_vae.py needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.tiled:
        from omnirt.kernels import conv_input

        conv_input.FLAT_CHANNELS_LAST = False
    print(f"# W8A8 DiTs, Wan VAE fast path: {torch.cuda.get_device_name()} (torch {torch.__version__})\n")
    if not args.skip_zimage or args.wan:
        print(
            "| transformer step | weights | ms | CUDA graph replay ms | speed-up | speed-up (replays) "
            "| weight GiB | output SNR vs bf16 (dB) |"
        )
        print("|---|---|---|---|---|---|---|---|")
    if not args.skip_zimage:
        zimage_rows()  # (each row printed as it comes)
        torch.cuda.empty_cache()
    if args.wan and not args.dit_profile:
        wan_rows(args.wan, args.wan_size)  # (each row printed as it comes)
        torch.cuda.empty_cache()
    if args.dit_profile:
        dit_profile((args.wan, args.wan_size) if args.wan else None)
        torch.cuda.empty_cache()
    if args.final:
        print("\n| final output | weights | PSNR vs bf16 (dB) |\n|---|---|---|")
        if not args.skip_zimage:
            zimage_final_rows()  # (each row printed as it comes)
            torch.cuda.empty_cache()
        if args.wan:
            wan_final_rows(args.wan, args.wan_size, args.final_steps)
            torch.cuda.empty_cache()
    if args.conv_layouts:
        print("\n| dtype | convolution | NDHWC bitwise NCDHW |\n|---|---|---|")
        print("\n".join(conv_layout_rows()), flush=True)
    if args.conv_speed:
        print("\n| convolution (bf16, channels-last) | form | ms | TFLOP/s | speed-up | max diff / max |")
        print("|---|---|---|---|---|---|")
        print("\n".join(conv_speed_rows()), flush=True)
    if args.conv_cudnn:
        print("\n| convolution (bf16, channels-last) | form | ms | TFLOP/s | speed-up | max diff / max |")
        print("|---|---|---|---|---|---|")
        print("\n".join(conv_cudnn_rows()), flush=True)
    if args.norm_orders:
        print(
            "\n| dtype | frames | norms | ATen's S | S=1 (fma/mul+add) | S=2 | S=4 | S=8 | S=16 "
            "| ATen on channels-last |\n|---|---|---|---|---|---|---|---|---|---|"
        )
        print("\n".join(norm_order_rows()), flush=True)
    if args.conv_input:
        print(
            "\n| frames | chain | eager ms | kernel ms | speed-up | kernel GB/s |\n|---|---|---|---|---|---|"
        )
        print("\n".join(conv_input_rows()), flush=True)
    if sizes:
        print(
            "\n| decode | level | ms | speed-up | peak GiB | pixels vs diffusers |\n|---|---|---|---|---|---|"
        )
        dtype = torch.bfloat16 if args.vae_dtype == "bf16" else torch.float32
        for size in sizes:
            vae_rows(size, dtype, args.repeats, args.vae_profile, forms, args.fast_ablations)
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
