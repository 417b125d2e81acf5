"""W8A8 DiTs (``--quantization``): one transformer step in bf16, int8 and fp8 at real size, with
the weights' memory and the step output's SNR against bf16 on the same weights and inputs.

Z-Image (6.15 B, 1024x1024) and optionally Wan (1.3 B or 14 B, 480p or 720p, 81 frames) from the
published configs with random bf16 weights, on a CUDA GPU; each row is measured in the same run
(a copy of the bf16 model is quantized, so both stay loaded). Milliseconds are the median of
``triton.testing.do_bench``. The VAE decoder fast path of issue 15 is not built yet, so this
script has no VAE rows.

    python benchmarks/quant_vae.py [--wan 1.3b|14b] [--wan-size 480p|720p]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"480p": (60, 104), "720p": (90, 160)}


def bench(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=2, rep=20, return_mode="median"))


def snr_db(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    return float(10 * torch.log10(want.pow(2).mean() / (got - want).pow(2).mean()))


def rows_for(name: str, model: torch.nn.Module, call) -> list[str]:
    from omnirt.stages.diffusion.quant import quantize_model

    with torch.no_grad():
        ref = call(model)
        base = bench(lambda: call(model))
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        rows = [f"| {name} | bf16 | {base:.1f} | 1.00x | {weights / 2**30:.2f} | - |"]
        for kind in ("int8", "fp8"):
            quantized = copy.deepcopy(model)
            done = quantize_model(quantized, kind)
            out = call(quantized)
            ms = bench(lambda q=quantized: call(q))
            rows.append(
                f"| {name} | {kind} ({done.layers} layers) | {ms:.1f} | {base / ms:.2f}x "
                f"| {done.bytes_after / 2**30:.2f} | {snr_db(out, ref):.1f} |"
            )
            del quantized
            torch.cuda.empty_cache()
    return rows


def zimage_rows() -> list[str]:
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
    name = "Z-Image 6.15B 1024x1024"
    return rows_for(name, model, lambda m: m(latents, t, caption, return_dict=False)[0][0])


def wan_rows(variant: str, size: str) -> list[str]:
    from diffusers import WanTransformer3DModel
    from omnirt.stages.diffusion.wan_loader import _cast_keeping_fp32

    cfg = json.loads((ROOT / "benchmarks/models/wan2.1-t2v/wan2.1-t2v.components.json").read_text())
    cfg = {k: v for k, v in cfg[f"transformer_{variant}"].items() if not k.startswith("_")}
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.device("cuda"):
        torch.manual_seed(0)
        model = WanTransformer3DModel.from_config(cfg)
        _cast_keeping_fp32(model, torch.bfloat16)
        model = model.eval()
    h, w = SIZES[size]
    video = torch.randn(1, 16, 21, h, w, device="cuda", dtype=torch.bfloat16, generator=g)
    text = torch.randn(1, 512, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    step = torch.tensor([500.0], device="cuda")
    name = f"Wan {variant} {size} 81 frames"
    return rows_for(name, model, lambda m: m(video, step, text, return_dict=False)[0])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wan", choices=("1.3b", "14b"), default=None, help="also a Wan transformer step")
    p.add_argument("--wan-size", choices=tuple(SIZES), default="480p")
    p.add_argument("--skip-zimage", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/quant_vae.py needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"# W8A8 DiT steps on {torch.cuda.get_device_name()} (torch {torch.__version__})\n")
    print("| transformer step | weights | ms | speed-up | weight GiB | output SNR vs bf16 (dB) |")
    print("|---|---|---|---|---|---|")
    if not args.skip_zimage:
        print("\n".join(zimage_rows()), flush=True)
        torch.cuda.empty_cache()
    if args.wan:
        print("\n".join(wan_rows(args.wan, args.wan_size)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
