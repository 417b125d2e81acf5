"""Builds the image and video pipelines the server runs: a diffusers folder or, with
``--load-format dummy``, component configs alone (random weights at real size), by family; and the
embedded default's tiny random-weight Z-Image and Wan."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Literal

from .pipeline import DiffusionPipeline

log = logging.getLogger(__name__)

Family = Literal["z-image", "wan"]

#: Threads encoding PNGs and MP4s beside the engine thread, per pipeline (stages/diffusion/encoding.py).
MEDIA_WORKERS = 2

#: The embedded video model's id (the image one is ``zimage_demo.DEMO_ID``).
WAN_DEMO_ID = "demo-wan2.1-t2v"

#: The diffusers pipeline class (``model_index.json``) and transformer class of each family.
PIPELINES: dict[str, Family] = {"ZImagePipeline": "z-image", "WanPipeline": "wan"}
TRANSFORMERS: dict[str, Family] = {"ZImageTransformer2DModel": "z-image", "WanTransformer3DModel": "wan"}


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{str(path)!r} is not readable JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{str(path)!r} does not hold a JSON object")
    return value


def diffusion_family(path: Path) -> Family:
    """The family of a diffusers folder (its ``model_index.json``) or of a components file (its
    transformer's ``_class_name``); ``ValueError`` naming what is served otherwise."""
    served = ", ".join(PIPELINES)
    if path.is_dir():
        name = _json(path / "model_index.json").get("_class_name")
        if name not in PIPELINES:
            raise ValueError(f"{str(path)!r} holds a {name!r} pipeline; served here: {served}")
        return PIPELINES[name]
    data = _json(path)
    names = {
        value.get("_class_name")
        for key, value in data.items()
        if (key == "transformer" or key.startswith("transformer_")) and isinstance(value, dict)
    }
    families = {TRANSFORMERS[n] for n in names if n in TRANSFORMERS}
    if len(families) != 1:
        raise ValueError(
            f"{str(path)!r}: no single transformer of a served family ({', '.join(TRANSFORMERS)}) "
            f"among its components ({sorted(map(str, names))})"
        )
    return families.pop()


#: What each family's pipeline serves (``DiffusionPipeline.kind``): the engine takes one of each.
KINDS: dict[Family, str] = {"z-image": "image", "wan": "video"}


def diffusion_kind(path: Path) -> str:
    """``"image"`` or ``"video"``: what the diffusers folder or components file at ``path`` serves
    (:func:`diffusion_family`), read from its JSON alone, before anything loads."""
    return KINDS[diffusion_family(path)]


def build_diffusion_pipeline(
    path: Path,
    *,
    device: str,
    load_format: str = "auto",
    max_rows: int = 8,
    warm_up: bool = True,
    quantization: str = "none",
    cuda_graphs: bool = True,
) -> DiffusionPipeline:
    """The image (Z-Image) or video (Wan) pipeline of ``path``: a diffusers folder, or with
    ``load_format="dummy"`` its configs alone or a components JSON file. ``warm_up``: run one
    request at start-up (:meth:`DiffusionPipeline.warm_up`), not at the first client's.
    ``cuda_graphs=False``: the transformer's block pieces run eagerly even where
    ``block_graphs.BLOCK_GRAPHS`` replays them (``omnirt serve --no-cuda-graphs``)."""
    if diffusion_family(path) == "z-image":
        from .zimage_loader import load_zimage

        denoiser: Any = load_zimage(path, device=device, load_format=load_format, quantization=quantization)
    else:
        from .wan_loader import load_wan

        denoiser = load_wan(path, device=device, load_format=load_format, quantization=quantization)
    return _served(_pipeline(denoiser, max_rows, cuda_graphs), warm_up)


def _pipeline(denoiser: Any, max_rows: int, cuda_graphs: bool) -> DiffusionPipeline:
    if not cuda_graphs:
        denoiser.block_graphs.enabled = False
    return DiffusionPipeline(denoiser, max_rows=max_rows, media_workers=MEDIA_WORKERS)


def _served(pipeline: DiffusionPipeline, warm_up: bool) -> DiffusionPipeline:
    if warm_up:
        pipeline.warm_up()
    return pipeline


def build_image_pipeline(
    model: str | None,
    *,
    device: str = "cpu",
    load_format: str = "auto",
    max_rows: int = 8,
    warm_up: bool = True,
) -> DiffusionPipeline:
    """The image pipeline of ``model``: None or ``"demo"`` for the embedded tiny Z-Image (random
    weights, built into the cache on first use), else a path as :func:`build_diffusion_pipeline`."""
    if model in (None, "", "demo"):
        return _served(_embedded_image(device, max_rows), warm_up)
    path = Path(model).expanduser()  # type: ignore[arg-type]
    if not path.exists():
        raise ValueError(f"image model {model!r}: no such file or folder (nothing is downloaded)")
    pipeline = build_diffusion_pipeline(
        path, device=device, load_format=load_format, max_rows=max_rows, warm_up=warm_up
    )
    if pipeline.kind != "image":
        raise ValueError(f"image model {model!r}: {pipeline.info.id} makes {pipeline.kind}s")
    return pipeline


def _embedded_image(
    device: str, max_rows: int, quantization: str = "none", cuda_graphs: bool = True
) -> DiffusionPipeline:
    from .zimage_demo import DEMO_ID, ensure_zimage_demo
    from .zimage_loader import load_zimage

    path = ensure_zimage_demo()
    denoiser = load_zimage(
        path, device=device, model_id=DEMO_ID, random_weights=True, quantization=quantization
    )
    return _pipeline(denoiser, max_rows, cuda_graphs)


def build_embedded_diffusion_pipelines(
    *,
    device: str,
    max_rows: int = 4,
    warm_up: bool = True,
    quantization: str = "none",
    cuda_graphs: bool = True,
) -> list[DiffusionPipeline]:
    """The embedded default's image and video pipelines: tiny Z-Image and Wan, random weights."""
    from .wan_demo import ensure_wan_demo
    from .wan_loader import load_wan

    image = _embedded_image(device, max_rows, quantization, cuda_graphs)
    video = _pipeline(
        load_wan(ensure_wan_demo(), device=device, model_id=WAN_DEMO_ID, quantization=quantization),
        max_rows,
        cuda_graphs,
    )
    log.warning(
        "serving the embedded demo %s and %s with RANDOM WEIGHTS: their images and videos are noise. "
        "Pass --model DIFFUSERS_FOLDER for a real model.",
        image.info.id,
        video.info.id,
    )
    return [_served(image, warm_up), _served(video, warm_up)]
