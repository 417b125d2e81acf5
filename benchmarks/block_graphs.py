"""The DiT's main layers as the engine runs a step's block pieces: eagerly, and replayed from the
per-block CUDA graphs of ``stages/diffusion/block_graphs.py``, at real size.

Z-Image (6.15 B, 1024x1024, the published config with random bf16 weights, the fused kernels
installed as the server installs them) in bf16 and in the W8A8 formats of ``quant_vae.py``
(``--formats``). The layers' inputs are those of one transformer call (taken at its first main
layer). For each format: milliseconds of the 30 main layers run as one piece (the median of
``triton.testing.do_bench``, launched from Python, so the host's pace counts), eager and replayed,
the speed-up, and whether the replayed output is bitwise the eager one; the first replayed piece's
time (it captures every block) is shown apart.

    python benchmarks/block_graphs.py [--formats "fp8, fp8 attention;int8"] [--pieces 1,3,30]

``--pieces``: also the 30 layers run as pieces of so many blocks each (each piece copies the
inputs in and the hidden state out, as the engine's pieces do).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import quant_vae  # noqa: E402  (the models and formats of the steps table)


def layer_inputs(model: torch.nn.Module, call) -> dict[str, torch.Tensor | None]:
    """What the first main layer takes in one call of ``model``, under the names the Z-Image
    denoiser's pieces use."""
    seen: dict[str, torch.Tensor | None] = {}

    def hook(_module, args):
        hidden, mask, freqs, adaln, noise = args[:5]
        seen.update(hidden=hidden.clone(), mask=mask, freqs=freqs, adaln=adaln, noise=noise)

    handle = model.layers[0].register_forward_pre_hook(hook)
    try:
        call(model)
    finally:
        handle.remove()
    return seen


def rows(formats: list[str], pieces: list[int]) -> list[str]:
    from omnirt.stages.diffusion import fused

    model, call = quant_vae._zimage()
    fused.install(model)  # as the server runs it on CUDA (and as the steps table does)
    out = variant_rows("bf16", model, call, "off", pieces)
    for label, kind, attention in quant_vae.FORMATS:
        if label in formats:
            quantized = quant_vae.quantized_copy(model, kind)[0]
            out += variant_rows(label, quantized, call, attention, pieces)
            del quantized
            torch.cuda.empty_cache()
    return out


@torch.no_grad()
def variant_rows(label: str, model: torch.nn.Module, call, attention: str, pieces: list[int]) -> list[str]:
    """``model``'s rows: its main layers as one piece (and as ``pieces``), eager and replayed."""
    from omnirt.stages.diffusion import zimage
    from omnirt.stages.diffusion.block_graphs import BlockGraphs

    out: list[str] = []
    context = quant_vae.attention_in_fp8(attention) if attention != "off" else contextlib.nullcontext()
    with context:
        inputs = layer_inputs(model, call)
        layers = list(model.layers)
        eager = BlockGraphs(zimage._layer_call, enabled=False)
        graphs = BlockGraphs(zimage._layer_call, enabled=True)

        def run(g: BlockGraphs, size: int = len(layers)) -> torch.Tensor:
            state = dict(inputs)
            for start in range(0, len(layers), size):
                state["hidden"] = g.run(layers, state, start, min(start + size, len(layers)))
            hidden = state["hidden"]
            assert hidden is not None
            return hidden

        want = run(eager)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        got = run(graphs)  # captures every block
        torch.cuda.synchronize()
        first = f"{(time.perf_counter() - t0) * 1e3:.0f}"
        for size in [len(layers), *(n for n in pieces if n < len(layers))]:
            eager_ms = quant_vae.bench(lambda size=size: run(eager, size))
            replay_ms = quant_vae.bench(lambda size=size: run(graphs, size))
            got = run(graphs, size)
            same = "yes" if torch.equal(got, want) else f"no (SNR {quant_vae.snr_db(got, want):.1f} dB)"
            name = label if size == len(layers) else f"{label}, pieces of {size}"
            out.append(
                f"| {name} | {len(layers)} | {eager_ms:.1f} | {replay_ms:.1f} | {eager_ms / replay_ms:.2f}x "
                f"| {first} | {same} | {graphs.last_path} |"
            )
            print(out[-1], flush=True)
            first = "-"
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default="fp8, fp8 attention", help="W8A8 formats beside bf16 (';'-separated)")
    p.add_argument("--pieces", default="", help="also pieces of so many blocks (comma-separated)")
    args = p.parse_args(argv)
    formats = [f.strip() for f in args.formats.split(";") if f.strip()]
    known = [label for label, _, _ in quant_vae.FORMATS]
    if any(f not in known for f in formats):
        p.error(f"--formats are {'; '.join(known)}")
    try:
        pieces = [int(n) for n in args.pieces.split(",") if n]
    except ValueError:
        p.error("--pieces are block counts: 1,3,10")
    if any(n < 1 for n in pieces):
        p.error("--pieces are block counts of at least 1")
    if not torch.cuda.is_available():
        print("benchmarks/block_graphs.py needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"# The DiT's main layers, eager and from per-block CUDA graphs: {torch.cuda.get_device_name()}\n")
    print("| Z-Image 1024x1024 | layers | eager ms | replayed ms | speed-up | first piece ms (captures) "
          "| bitwise | path |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    rows(formats, pieces)
    return 0


if __name__ == "__main__":
    sys.exit(main())
