"""What one diffusion model family gives the runtime (:class:`Denoiser`).

The runtime owns the step loop and calls a denoiser only through this interface, so Z-Image
(text-to-image) and Wan (text-to-video) share one loop: batching of compatible requests, one
transformer call (or one piece of it) per scheduler step, the classifier-free-guidance branches,
progress, previews and cancellation. A denoiser wraps the diffusers model classes of its family
(transformer, VAE, scheduler, text encoder) and reproduces its diffusers pipeline's arithmetic exactly, so our
results equal diffusers' on the same weights, seed and inputs (the parity tests).

Long calls: a denoiser may also split one transformer call into pieces (:class:`SplitDenoiser`:
``start``, ``run_blocks`` over groups of its transformer blocks, ``finish``), so the runtime can
run a call over several of its steps and put realtime ticks between the pieces.

Rows: every call works on a batch of rows, one row per generated sample (an image, or a video).
A request with ``n`` images has ``n`` rows. Per-row conditions are opaque to the runtime: the
denoiser makes one per prompt and batches the rows' conditions inside :meth:`Denoiser.predict`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from ..types import ModelInfo
from .types import DiffusionRequest

#: The classifier-free-guidance branch of a transformer call, named on every call: ``cond`` sees
#: the prompt, ``uncond`` the negative prompt. Step caches keep separate state per branch.
Branch = Literal["cond", "uncond"]


@dataclass(frozen=True)
class Defaults:
    """What a request that leaves a field out gets (the model card's recommended settings)."""

    width: int
    height: int
    num_inference_steps: int
    guidance_scale: float
    num_frames: int | None = None  # video only
    fps: int | None = None  # video only


@dataclass(frozen=True)
class Shape:
    """The output size of a row; rows batch together only when their shapes and step counts agree."""

    width: int
    height: int
    frames: int = 1  # 1 for images


class Sampler(Protocol):
    """The denoising schedule of one batch of rows (a diffusers scheduler instance, its state).

    The runtime keeps one per request and steps it in order. A sampler may also have
    ``denoised(prediction, index, latents) -> Tensor``, the clean-sample estimate at step
    ``index`` (``latents`` before that step): previews then show it rather than the noisy latents."""

    timesteps: torch.Tensor  # [steps]

    def step(self, prediction: torch.Tensor, index: int, latents: torch.Tensor) -> torch.Tensor:
        """Latents after step ``index`` given the (guided) model prediction."""
        ...


class Denoiser(Protocol):
    #: "z-image", "wan", ...
    family: str
    output: Literal["image", "video"]
    info: ModelInfo
    defaults: Defaults
    device: torch.device
    dtype: torch.dtype

    def check(self, request: DiffusionRequest) -> Shape:
        """The request's output shape, with defaults filled in; raises
        :class:`~omnirt.stages.pipeline.RequestRejected` with a clear message for what the model
        cannot do (sizes not multiples of its patch size, too many frames, steps out of range)."""
        ...

    def encode(self, prompts: Sequence[str]) -> list[Any]:
        """One condition per prompt (text encoder output, as the transformer takes it)."""
        ...

    def count_tokens(self, prompts: Sequence[str]) -> list[int]:
        """The tokens the text encoder reads of each prompt, as :meth:`encode` reads it (template
        and special tokens included, truncated as it truncates): the requests' usage."""
        ...

    def init_latents(self, shape: Shape, generators: Sequence[torch.Generator]) -> torch.Tensor:
        """Initial noise, one row per generator, exactly as the diffusers pipeline draws it."""
        ...

    def sampler(self, shape: Shape, steps: int) -> Sampler:
        """A fresh schedule for rows of ``shape`` (timesteps may depend on the size)."""
        ...

    def predict(
        self, latents: torch.Tensor, step: int, sampler: Sampler, conditions: Sequence[Any], branch: Branch
    ) -> torch.Tensor:
        """One transformer call over the rows: the model's prediction at step ``step``."""
        ...

    def uses_guidance(self, scale: float) -> bool:
        """Whether rows at guidance ``scale`` run the ``uncond`` branch, as the family's diffusers
        pipeline decides (Z-Image: scale > 0; Wan: scale > 1)."""
        ...

    def guide(self, cond: torch.Tensor, uncond: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The guided prediction per row (``scale`` [rows]), as the diffusers pipeline combines it."""
        ...

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Final pixels: uint8 [rows, frames, height, width, 3]."""
        ...

    def preview(self, latents: torch.Tensor) -> torch.Tensor:
        """Cheap pixels from intermediate latents (uint8 as :meth:`decode`), for partial images."""
        ...


class SplitDenoiser(Denoiser, Protocol):
    """A denoiser whose transformer call also runs in pieces, the hidden states kept in between:
    ``finish(run_blocks(start(...), 0, num_blocks))`` (in any grouping of the blocks) is bitwise
    the prediction :meth:`Denoiser.predict` gives for the same arguments.

    The runtime calls the pieces in order, each once: ``start``, then ``run_blocks`` over
    consecutive ranges covering ``[0, num_blocks)``, then ``finish``."""

    #: Transformer blocks one call runs between ``start`` and ``finish``; 0 when the call cannot
    #: be split now (e.g. a diffusers cache hook wraps the whole forward).
    num_blocks: int

    def start(
        self, latents: torch.Tensor, step: int, sampler: Sampler, conditions: Sequence[Any], branch: Branch
    ) -> Any:
        """The call up to its first transformer block (patchify, timestep and text embeddings,
        positions, any refiner blocks): the state the blocks run on."""
        ...

    def run_blocks(self, state: Any, start: int, stop: int) -> Any:
        """Blocks ``start`` to ``stop - 1`` over ``state``; returns the state (possibly the same object)."""
        ...

    def finish(self, state: Any) -> torch.Tensor:
        """The call after its last block (final layer, unpatchify): the prediction, as ``predict``."""
        ...

    def keep_rows(self, state: Any, rows: Sequence[int]) -> Any:
        """The state of the listed rows only (in that order): the others' memory is released.
        The kept rows' results may differ from those of the full batch only by float noise."""
        ...


def split_blocks(denoiser: Denoiser) -> int:
    """How many blocks ``denoiser`` can split its transformer call into (0: it cannot split)."""
    if not all(callable(getattr(denoiser, name, None)) for name in ("start", "run_blocks", "finish")):
        return 0
    return int(getattr(denoiser, "num_blocks", 0))


class SplitDecoder(Protocol):
    """A denoiser whose VAE decode also runs in pieces (Wan's video VAE decoding one latent frame
    at a time with a feature cache, each frame's decoder call in stages; Z-Image's image VAE in the
    stages of its one decoder call), the decode's state kept in between:
    ``finish_decode(decode_parts(start_decode(latents), total))`` (in any grouping of the parts) is
    bitwise :meth:`Denoiser.decode`. Each state owns its cache: decodes of several
    batches may be under way at once on one model.

    The runtime calls ``start_decode``, then ``decode_parts`` until ``decode_parts_total`` parts
    ran, then ``finish_decode``."""

    #: Whether decodes can run in pieces now (False: e.g. the VAE's tiling is on).
    decode_splits: bool

    def decode_parts_total(self, shape: Shape) -> int:
        """The parts (stages of the decoder calls, frame after frame) of a decode of ``shape``."""
        ...

    def decode_part_kinds(self, shape: Shape) -> int:
        """The parts cycle through this many kinds of different cost (a latent frame's decoder
        stages): the runtime measures each kind apart to size the pieces (optional: without it,
        one kind)."""
        ...

    def start_decode(self, latents: torch.Tensor) -> Any:
        """The decode's state, before its first part (the latents prepared for the decoder)."""
        ...

    def decode_parts(self, state: Any, n: int) -> Any:
        """The next ``n`` parts over ``state`` (fewer when fewer are left); returns the state."""
        ...

    def finish_decode(self, state: Any) -> torch.Tensor:
        """The pixels once every part ran: uint8 ``[rows, frames, H, W, 3]``, as ``decode``."""
        ...

    def decode_keep_rows(self, state: Any, rows: Sequence[int]) -> Any:
        """The state of the listed rows only (in that order): the others' memory is released."""
        ...


def split_decode(denoiser: Denoiser) -> bool:
    """Whether ``denoiser`` can run its VAE decode in pieces now."""
    names = ("start_decode", "decode_parts", "finish_decode", "decode_parts_total")
    if not all(callable(getattr(denoiser, name, None)) for name in names):
        return False
    return bool(getattr(denoiser, "decode_splits", False))
