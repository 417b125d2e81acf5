"""Z-Image (text to image) as a :class:`~.denoiser.Denoiser` for the shared diffusion runtime.

The arithmetic is diffusers' ``ZImagePipeline`` (0.42), step by step, on its own model classes:

- prompt: the Qwen3 chat template (one user turn, generation prompt, ``enable_thinking=True``),
  tokenised (truncated at ``max_sequence_length``), the text encoder's second-to-last hidden state,
  the padding dropped: one ``[tokens, dim]`` tensor per prompt. diffusers pads every prompt to 512
  tokens; we pad to the longest prompt of the call, which changes nothing for the real tokens (the
  encoder is causal and masked).
- noise: float32 ``[16, H / 8, W / 8]`` per row from that row's generator (``randn_tensor``).
- schedule: ``FlowMatchEulerDiscreteScheduler`` with sigmas ``linspace(1, 1 / steps, steps)`` and
  ``mu`` from the image's token count (``calculate_shift``), as the pipeline sets it.
- transformer: ``ZImageTransformer2DModel`` on a list of ``[C, 1, h, w]`` latents, timestep
  ``(1000 - t) / 1000``, the caption embeddings; its output is negated (the pipeline's
  ``noise_pred = -noise_pred``). We negate each branch before the guidance combine, which is
  exact in floating point (negation commutes with the combine's rounding).
- guidance: ``cond + scale * (cond - uncond)`` per row, with the pipeline's optional
  ``cfg_normalization`` (the guided norm capped at ``cfg_normalization`` times the cond norm).
  ``cfg_truncation`` is not implemented: its default (1.0) never truncates.
- decode: ``latents / scaling_factor + shift_factor`` through ``AutoencoderKL``, then
  ``(x / 2 + 0.5).clamp(0, 1) * 255`` rounded (diffusers' ``postprocess`` to PIL). The decode also
  runs in parts (a :class:`~.denoiser.SplitDecoder`): the decoder's ``conv_in`` and middle block,
  each up block, then its head (``conv_norm_out``, ``conv_act``, ``conv_out``), the activations
  kept in between: the same modules in ``Decoder.forward``'s order, so bitwise the one-call
  decode. A 1024x1024 decode took about 90 ms whole on the H200, over one 80 ms realtime frame.

Previews decode the sampler's clean-sample estimate ``x0 = x_t - sigma_t * v`` (see
:meth:`FlowMatchSampler.denoised`) through the same VAE; latents of 64 or more per side are
average-pooled 2x first, so a preview costs about a quarter of a final decode (half-size image).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..pipeline import RequestRejected
from ..types import ModelInfo
from . import fused
from .block_graphs import BlockGraphs
from .denoiser import Branch, Defaults, Shape
from .hooks import forward_is_wrapped
from .types import DiffusionRequest, ImageRequest

#: Published recommendation of Z-Image-Turbo (the model card and the component configs).
TURBO_DEFAULTS = Defaults(width=1024, height=1024, num_inference_steps=8, guidance_scale=0.0)


@dataclass(frozen=True)
class Limits:
    """What a request may ask of the model."""

    max_side: int = 2048
    max_steps: int = 100
    #: Prompt tokens read by the text encoder (diffusers' ``max_sequence_length``); longer prompts
    #: are truncated, as the diffusers pipeline does.
    max_sequence_length: int = 512


class FlowMatchSampler:
    """A diffusers ``FlowMatchEulerDiscreteScheduler`` for one request's rows, stepped in order."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.timesteps: torch.Tensor = scheduler.timesteps

    def step(self, prediction: torch.Tensor, index: int, latents: torch.Tensor) -> torch.Tensor:
        at = self.scheduler.step_index
        if (0 if at is None else at) != index:
            raise RuntimeError(f"sampler stepped out of order: at step {at}, asked for {index}")
        return self.scheduler.step(prediction.float(), self.timesteps[index], latents, return_dict=False)[0]

    def denoised(self, prediction: torch.Tensor, index: int, latents: torch.Tensor) -> torch.Tensor:
        """The clean-sample estimate at step ``index`` (``latents`` before that step)."""
        sigma = self.scheduler.sigmas[index].to(latents.device)
        return latents - sigma * prediction


_PATCH, _F_PATCH = 2, 1  # the forward's defaults, which ZImagePipeline uses
_PATCH_KEY = f"{_PATCH}-{_F_PATCH}"


@dataclass(eq=False)
class ZImageDecodeState:
    """One VAE decode between its parts (see :meth:`ZImageDenoiser.start_decode`)."""

    hidden: torch.Tensor  # the decoder's activations after ``done`` parts (first: its input)
    done: int
    total: int


@dataclass(eq=False)
class ZImageCallState:
    """One transformer call between its pieces: the unified (image then caption) sequence, padded
    to the longest row, and what every main layer and the final layer take besides it."""

    hidden: torch.Tensor  # [rows, tokens, dim]
    mask: torch.Tensor | None  # [rows, tokens] bool; None when every row has all tokens
    freqs: torch.Tensor  # RoPE, [rows, tokens, ...]
    adaln_input: torch.Tensor  # timestep embedding [rows, adaln dim]
    noise: torch.Tensor | None  # the omni mode's noise mask: None here
    sizes: list[tuple[int, int, int]]  # per row (frames, height, width) of the latents


def _layer_call(layer: torch.nn.Module, inputs: Mapping[str, torch.Tensor | None]) -> torch.Tensor:
    """One of ``ZImageTransformer2DModel.layers`` as its ``forward`` calls it (basic mode)."""
    hidden, mask, freqs = inputs["hidden"], inputs["mask"], inputs["freqs"]
    return layer(hidden, mask, freqs, inputs["adaln"], inputs["noise"], None, None)


class ZImageDenoiser:
    family = "z-image"
    output: Literal["image"] = "image"

    def __init__(
        self,
        *,
        transformer: Any,
        vae: Any,
        text_encoder: Any,
        tokenizer: Any,
        scheduler_config: dict[str, Any],
        info: ModelInfo,
        defaults: Defaults = TURBO_DEFAULTS,
        limits: Limits = Limits(),
        cfg_normalization: float = 0.0,
    ) -> None:
        self.transformer = transformer.eval()
        self.vae = vae.eval()
        self.text_encoder = text_encoder.eval()
        self.tokenizer = tokenizer
        self.scheduler_config = dict(scheduler_config)
        self.info = info
        self.defaults = defaults
        self.limits = limits
        self.cfg_normalization = cfg_normalization
        self.device: torch.device = next(transformer.parameters()).device
        self.dtype: torch.dtype = next(transformer.parameters()).dtype
        self.vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)
        #: Sides must be multiples of this (the VAE's downsampling times the 2x2 patches).
        self.multiple = self.vae_scale_factor * 2
        self.latent_channels = int(transformer.config.in_channels)
        if self.device.type == "cuda":  # the fused QK-norm/RoPE kernel, where exact
            fused.install(transformer)
        #: The main layers' pieces replayed from CUDA graphs (``block_graphs.BLOCK_GRAPHS``).
        self.block_graphs = BlockGraphs(_layer_call)

    # -- requests ---------------------------------------------------------------------------
    def check(self, request: DiffusionRequest) -> Shape:
        if not isinstance(request, ImageRequest):
            raise RequestRejected("Z-Image generates images, not videos")
        d, lim = self.defaults, self.limits
        width = d.width if request.width is None else request.width
        height = d.height if request.height is None else request.height
        for name, side in (("width", width), ("height", height)):
            if not isinstance(side, int) or side < self.multiple or side > lim.max_side:
                raise RequestRejected(
                    f"{name} must be from {self.multiple} to {lim.max_side} pixels, got {side}"
                )
            if side % self.multiple:
                raise RequestRejected(f"{name} must be a multiple of {self.multiple}, got {side}")
        steps = d.num_inference_steps if request.num_inference_steps is None else request.num_inference_steps
        if not isinstance(steps, int) or not 1 <= steps <= lim.max_steps:
            raise RequestRejected(f"num_inference_steps must be from 1 to {lim.max_steps}, got {steps}")
        return Shape(width=width, height=height)

    def latent_size(self, shape: Shape) -> tuple[int, int]:
        unit = self.vae_scale_factor * 2
        return 2 * (shape.height // unit), 2 * (shape.width // unit)

    # -- model calls ------------------------------------------------------------------------
    def _texts(self, prompts: Sequence[str]) -> list[str]:
        return [
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": p}],
                tokenize=False,
                add_generation_prompt=True,
                enable_thinking=True,
            )
            for p in prompts
        ]

    def count_tokens(self, prompts: Sequence[str]) -> list[int]:
        """The tokens the text encoder reads for each prompt (chat template included, truncated
        at ``max_sequence_length``, as :meth:`encode` reads them): the requests' usage."""
        ids = self.tokenizer(
            self._texts(prompts), max_length=self.limits.max_sequence_length, truncation=True
        ).input_ids
        return [len(row) for row in ids]

    @torch.no_grad()
    def encode(self, prompts: Sequence[str]) -> list[torch.Tensor]:
        texts = self._texts(prompts)
        inputs = self.tokenizer(
            texts,
            padding="longest",
            max_length=self.limits.max_sequence_length,
            truncation=True,
            return_tensors="pt",
        )
        ids = inputs.input_ids.to(self.text_encoder.device)
        mask = inputs.attention_mask.to(self.text_encoder.device).bool()
        hidden = self.text_encoder(
            input_ids=ids, attention_mask=mask, output_hidden_states=True
        ).hidden_states[-2]
        return [hidden[i][mask[i]] for i in range(len(texts))]

    def init_latents(self, shape: Shape, generators: Sequence[torch.Generator]) -> torch.Tensor:
        from diffusers.utils.torch_utils import randn_tensor

        h, w = self.latent_size(shape)
        return randn_tensor(
            (len(generators), self.latent_channels, h, w),
            generator=list(generators),
            device=self.device,
            dtype=torch.float32,
        )

    def sampler(self, shape: Shape, steps: int) -> FlowMatchSampler:
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift, get_default_z_image_sigmas

        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config)
        h, w = self.latent_size(shape)
        cfg = scheduler.config
        mu = calculate_shift(
            (h // 2) * (w // 2),
            cfg.get("base_image_seq_len", 256),
            cfg.get("max_image_seq_len", 4096),
            cfg.get("base_shift", 0.5),
            cfg.get("max_shift", 1.15),
        )
        scheduler.set_timesteps(sigmas=get_default_z_image_sigmas(steps), device=self.device, mu=mu)
        scheduler.set_begin_index(0)
        return FlowMatchSampler(scheduler)

    @torch.no_grad()
    def predict(
        self,
        latents: torch.Tensor,
        step: int,
        sampler: FlowMatchSampler,  # type: ignore[override]
        conditions: Sequence[torch.Tensor],
        branch: Branch,
    ) -> torch.Tensor:
        rows = latents.shape[0]
        timestep = sampler.timesteps[step].expand(rows)
        timestep = (1000 - timestep) / 1000
        x = latents.to(self.dtype).unsqueeze(2)
        out = self.transformer(list(x.unbind(dim=0)), timestep, list(conditions), return_dict=False)[0]
        return -torch.stack([o.float() for o in out], dim=0).squeeze(2)

    # -- the call in pieces (SplitDenoiser) ------------------------------------------------------
    # ``ZImageTransformer2DModel.forward`` (diffusers 0.42, basic mode, patch 2, frame patch 1),
    # its submodules called in the same order with the same arguments: ``start`` is everything up
    # to the main layers (timestep embedding, patchify, the noise and context refiners, the
    # unified sequence), ``run_blocks`` a range of ``transformer.layers``, ``finish`` the final
    # layer and unpatchify (and the pipeline's negation, as in :meth:`predict`).

    @property
    def num_blocks(self) -> int:
        return 0 if forward_is_wrapped(self.transformer) else len(self.transformer.layers)

    @torch.no_grad()
    def start(
        self,
        latents: torch.Tensor,
        step: int,
        sampler: FlowMatchSampler,  # type: ignore[override]
        conditions: Sequence[torch.Tensor],
        branch: Branch,
    ) -> ZImageCallState:
        tr = self.transformer
        rows = latents.shape[0]
        if len(conditions) != rows:
            raise ValueError(f"{rows} rows of latents but {len(conditions)} conditions")
        t = (1000 - sampler.timesteps[step].expand(rows)) / 1000
        x = list(latents.to(self.dtype).unsqueeze(2).unbind(dim=0))
        device = x[0].device
        adaln_input = tr.t_embedder(t * tr.t_scale).type_as(x[0])
        x, cap_feats, x_size, x_pos_ids, cap_pos_ids, x_pad_mask, cap_pad_mask = tr.patchify_and_embed(
            x, list(conditions), _PATCH, _F_PATCH
        )
        x_seqlens = [len(xi) for xi in x]
        x = tr.all_x_embedder[_PATCH_KEY](torch.cat(x, dim=0))
        x, x_freqs, x_mask, _, x_noise = tr._prepare_sequence(
            list(x.split(x_seqlens, dim=0)), x_pos_ids, x_pad_mask, tr.x_pad_token, None, device
        )
        for layer in tr.noise_refiner:
            x = layer(x, x_mask, x_freqs, adaln_input, x_noise, None, None)
        cap_seqlens = [len(ci) for ci in cap_feats]
        cap_feats = tr.cap_embedder(torch.cat(cap_feats, dim=0))
        cap_feats, cap_freqs, cap_mask, _, _ = tr._prepare_sequence(
            list(cap_feats.split(cap_seqlens, dim=0)),
            cap_pos_ids,
            cap_pad_mask,
            tr.cap_pad_token,
            None,
            device,
        )
        for layer in tr.context_refiner:
            cap_feats = layer(cap_feats, cap_mask, cap_freqs)
        unified, freqs, mask, noise = tr._build_unified_sequence(
            x, x_freqs, x_seqlens, None,  # image
            cap_feats, cap_freqs, cap_seqlens, None,  # caption
            None, None, None, None,  # no SigLIP features (omni mode only)
            False,
            device,
        )  # fmt: skip
        return ZImageCallState(unified, mask, freqs, adaln_input, noise, list(x_size))

    @torch.no_grad()
    def run_blocks(self, state: ZImageCallState, start: int, stop: int) -> ZImageCallState:
        s = state
        inputs = dict(hidden=s.hidden, mask=s.mask, freqs=s.freqs, adaln=s.adaln_input, noise=s.noise)
        s.hidden = self.block_graphs.run(self.transformer.layers, inputs, start, stop)
        return state

    @torch.no_grad()
    def finish(self, state: ZImageCallState) -> torch.Tensor:
        tr = self.transformer
        unified = tr.all_final_layer[_PATCH_KEY](state.hidden, c=state.adaln_input)
        out = tr.unpatchify(list(unified.unbind(dim=0)), state.sizes, _PATCH, _F_PATCH, None)
        return -torch.stack([o.float() for o in out], dim=0).squeeze(2)

    def keep_rows(self, state: ZImageCallState, rows: Sequence[int]) -> ZImageCallState:
        index = torch.tensor(list(rows), dtype=torch.long, device=state.hidden.device)
        return ZImageCallState(
            state.hidden.index_select(0, index),
            None if state.mask is None else state.mask.index_select(0, index),
            state.freqs.index_select(0, index),
            state.adaln_input.index_select(0, index),
            None if state.noise is None else state.noise.index_select(0, index),
            [state.sizes[i] for i in rows],
        )

    def uses_guidance(self, scale: float) -> bool:
        """``ZImagePipeline`` runs the unconditional branch whenever the scale is above 0."""
        return scale > 0

    def guide(self, cond: torch.Tensor, uncond: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        s = scale.to(device=cond.device, dtype=cond.dtype).view(-1, *([1] * (cond.dim() - 1)))
        guided = cond + s * (cond - uncond)
        if self.cfg_normalization > 0:
            dims = tuple(range(1, cond.dim()))
            cap = torch.linalg.vector_norm(cond, dim=dims) * self.cfg_normalization
            norm = torch.linalg.vector_norm(guided, dim=dims)
            factor = torch.where(norm > cap, cap / norm, torch.ones_like(norm))
            guided = guided * factor.view_as(s)
        return guided

    def _vae_input(self, latents: torch.Tensor) -> torch.Tensor:
        cfg = self.vae.config
        return latents.to(self.vae.dtype) / cfg.scaling_factor + cfg.shift_factor

    @staticmethod
    def _to_pixels(image: torch.Tensor) -> torch.Tensor:
        """The decoder's ``[rows, 3, H, W]`` in [-1, 1] to uint8 ``[rows, 1, H, W, 3]`` on the CPU."""
        image = (image.float() * 0.5 + 0.5).clamp(0, 1)
        pixels = (image * 255).round().to(torch.uint8)
        return pixels.permute(0, 2, 3, 1).unsqueeze(1).cpu()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self._to_pixels(self.vae.decode(self._vae_input(latents), return_dict=False)[0])

    # -- the VAE decode in parts (SplitDecoder) ----------------------------------------------------
    # ``AutoencoderKL._decode`` (diffusers 0.42, no tiling): ``post_quant_conv`` (where the VAE has
    # one), then ``Decoder.forward``: ``conv_in``, the middle block, the up blocks, the head.

    @property
    def decode_splits(self) -> bool:
        """Whether decodes run in parts: not with the VAE's tiling or slicing on (``decode`` then
        follows them whole), nor with a hook on the VAE or its decoder (an offload hook could move
        it between two parts; a replaced forward would not be the modules run here)."""
        vae = self.vae
        tiled = getattr(vae, "use_tiling", False) or getattr(vae, "use_slicing", False)
        return not tiled and not forward_is_wrapped(vae) and not forward_is_wrapped(vae.decoder)

    def decode_parts_total(self, shape: Shape) -> int:
        """``conv_in`` with the middle block, each up block, the head (whatever the shape)."""
        return self._decode_parts

    def decode_part_kinds(self, shape: Shape) -> int:
        """Every part costs differently (the up blocks double the side each): each its own kind."""
        return self.decode_parts_total(shape)

    @property
    def _decode_parts(self) -> int:
        return len(self.vae.decoder.up_blocks) + 2

    @torch.no_grad()
    def start_decode(self, latents: torch.Tensor) -> ZImageDecodeState:
        if not self.decode_splits:
            raise ValueError("this VAE decodes whole (tiling, slicing or a hook is on)")
        z = self._vae_input(latents)
        if self.vae.post_quant_conv is not None:
            z = self.vae.post_quant_conv(z)
        return ZImageDecodeState(z, 0, self._decode_parts)

    @torch.no_grad()
    def decode_parts(self, state: ZImageDecodeState, n: int) -> ZImageDecodeState:
        """The next ``n`` parts (fewer when fewer are left)."""
        if n < 0:
            raise ValueError(f"cannot decode {n} parts")
        decoder = self.vae.decoder
        for _ in range(n):
            if state.done == state.total:
                break
            x, part = state.hidden, state.done
            if part == 0:
                x = decoder.conv_in(x)
                if decoder.mid_block is not None:
                    x = decoder.mid_block(x, None)
            elif part <= len(decoder.up_blocks):
                x = decoder.up_blocks[part - 1](x, None)
            else:
                x = decoder.conv_out(decoder.conv_act(decoder.conv_norm_out(x)))
            state.hidden, state.done = x, part + 1
        return state

    def finish_decode(self, state: ZImageDecodeState) -> torch.Tensor:
        """The pixels of a decode whose parts all ran: bitwise :meth:`decode`'s."""
        if state.done != state.total:
            raise ValueError(f"decode has run {state.done} of {state.total} parts")
        return self._to_pixels(state.hidden)

    def decode_keep_rows(self, state: ZImageDecodeState, rows: Sequence[int]) -> ZImageDecodeState:
        """The decode of the listed rows only; the others' activations are released."""
        index = torch.tensor(list(rows), dtype=torch.long, device=state.hidden.device)
        return ZImageDecodeState(state.hidden.index_select(0, index), state.done, state.total)

    def preview(self, latents: torch.Tensor) -> torch.Tensor:
        if min(latents.shape[-2:]) >= 64:
            latents = torch.nn.functional.avg_pool2d(latents, 2)
        return self.decode(latents)

    def describe(self) -> str:
        params = sum(p.numel() for p in self.transformer.parameters())
        return f"Z-Image ({params / 1e6:.1f} M transformer parameters, {self.dtype}, {self.device})"
