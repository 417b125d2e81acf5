"""Wan2.1 text-to-video as a :class:`~.denoiser.Denoiser` (diffusers' ``WanPipeline`` is the reference).

Every method reproduces one part of ``WanPipeline.__call__`` with the same arithmetic, so the
shared runtime's loop (encode, init_latents, one :meth:`WanDenoiser.predict` per branch and step,
guide, :meth:`WanSampler.step`, decode) gives what the pipeline gives on the same weights,
generators and inputs:

- text: the pipeline's prompt cleaning, UMT5 over tokens padded to ``max_sequence_length``,
  every position past a prompt's mask zeroed, cast to the transformer's dtype;
- latents: float32 noise drawn per row from the row's generator (diffusers' ``randn_tensor``);
- schedule: a fresh scheduler from the folder's config per batch (UniPC is multistep: its history
  of model outputs is per-batch state), begin index 0;
- guidance on when ``guidance_scale > 1`` (``uncond + s * (cond - uncond)``, in the prediction's
  dtype with ``s`` a Python float, as the pipeline);
- decode: latents de-normalised with the VAE's ``latents_mean`` / ``latents_std``, the Wan VAE,
  ``x * 0.5 + 0.5`` clamped, then 8-bit (rounded).

Frame counts follow the pipeline: a ``num_frames`` that is not ``4k + 1`` (4: the VAE's temporal
factor) becomes ``num_frames // 4 * 4 + 1`` (``8 -> 9``, ``10 -> 9``, ``12 -> 13``), and the output
has that many frames (:meth:`WanDenoiser.check` returns it). Sizes the pipeline rejects (height and
width not multiples of 16) are rejected.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ..pipeline import RequestRejected
from ..types import ModelInfo
from . import fused, wan_vae_fast
from .block_graphs import BlockGraphs
from .denoiser import Branch, Defaults, Shape
from .hooks import forward_is_wrapped
from .types import DiffusionRequest, VideoRequest
from .wan_vae_fast import decoder_stage, decoder_stages, fast_decode_applies

log = logging.getLogger(__name__)

#: Schedulers a Wan folder may name (``model_index.json``): Wan2.1 ships UniPC with a flow shift;
#: flow-matching Euler is the other one diffusers documents for it.
SUPPORTED_SCHEDULERS = ("UniPCMultistepScheduler", "FlowMatchEulerDiscreteScheduler")


@dataclass(frozen=True)
class WanLimits:
    """What one request may ask for (beyond what the model itself can do)."""

    max_width: int = 1280
    max_height: int = 1280
    max_frames: int = 129
    max_steps: int = 100
    max_guidance_scale: float = 30.0
    max_fps: int = 60


class WanSampler:
    """The schedule of one batch of rows: its own diffusers scheduler instance (UniPC keeps the
    last model outputs and sample between steps), stepped exactly as ``WanPipeline`` steps it."""

    def __init__(self, scheduler: Any, steps: int, device: torch.device) -> None:
        scheduler.set_timesteps(steps, device=device)
        scheduler.set_begin_index(0)
        self.scheduler = scheduler
        self.timesteps: torch.Tensor = scheduler.timesteps

    def sigma(self, index: int) -> float:
        return float(self.scheduler.sigmas[index])

    def step(self, prediction: torch.Tensor, index: int, latents: torch.Tensor) -> torch.Tensor:
        done = self.scheduler.step_index or 0
        if index != done:
            raise ValueError(f"sampler is at step {done}, asked for step {index}: steps run once, in order")
        return self.scheduler.step(prediction, self.timesteps[index], latents, return_dict=False)[0]


@dataclass(eq=False)
class WanCallState:
    """One transformer call between its pieces."""

    hidden: torch.Tensor  # [rows, tokens, dim]
    text: torch.Tensor  # embedded text [rows, text tokens, dim]
    timestep_proj: torch.Tensor  # [rows, 6, dim]: the blocks' modulation
    temb: torch.Tensor  # [rows, dim]: the output norm's
    rotary_emb: tuple[torch.Tensor, torch.Tensor]  # RoPE (cos, sin), [1, tokens, 1, head dim]
    grid: tuple[int, int, int]  # latent patches per axis (frames, height, width)
    patch: tuple[int, int, int]


@dataclass(eq=False)
class WanDecodeState:
    """One VAE decode between its pieces (see :meth:`WanDenoiser.start_decode`)."""

    latents: torch.Tensor  # after ``post_quant_conv`` [rows, z, latent frames, h, w]
    cache: list[Any]  # the decoder's feature cache, one entry per causal conv (None, "Rep", tensor)
    frames: list[torch.Tensor]  # decoder outputs so far, [rows, 3, 1 or 4, H, W] each
    done: int  # latent frames decoded
    total: int
    stages: int = 1  # decoder stages per latent frame (``wan_vae_fast.decoder_stages``)
    stage: int = 0  # stages of the current latent frame run
    hidden: torch.Tensor | None = None  # the current frame's activations between two stages
    conv: list[int] = field(default_factory=lambda: [0])  # the current frame's conv index (feat_idx)
    fast: bool = False  # the frames take the fast path (``wan_vae_fast.fast_decode_applies``)

    @property
    def parts_done(self) -> int:
        return self.done * self.stages + self.stage


def _block_call(block: torch.nn.Module, inputs: Mapping[str, torch.Tensor | None]) -> torch.Tensor:
    """One of ``WanTransformer3DModel.blocks`` as its ``forward`` calls it."""
    return block(inputs["hidden"], inputs["text"], inputs["proj"], (inputs["cos"], inputs["sin"]))


class WanDenoiser:
    """Wan2.1 T2V for the diffusion runtime. Conditions are per prompt ``[max_sequence_length,
    text_dim]`` tensors (zero past the prompt) in the transformer's dtype, on its device."""

    family = "wan"
    output: Literal["image", "video"] = "video"

    def __init__(
        self,
        *,
        tokenizer: Any,
        text_encoder: torch.nn.Module,
        transformer: torch.nn.Module,
        vae: torch.nn.Module,
        scheduler_config: dict[str, Any],
        info: ModelInfo,
        defaults: Defaults,
        limits: WanLimits = WanLimits(),
        device: torch.device | str = "cpu",
        max_sequence_length: int = 512,
    ) -> None:
        import diffusers

        name = scheduler_config.get("_class_name")
        if name not in SUPPORTED_SCHEDULERS:
            supported = ", ".join(SUPPORTED_SCHEDULERS)
            raise ValueError(f"scheduler {name!r} is not supported for Wan (supported: {supported})")
        self._scheduler_cls = getattr(diffusers, name)
        self.scheduler_config = dict(scheduler_config)
        self.tokenizer = tokenizer
        self.text_encoder = text_encoder
        self.transformer = transformer
        self.vae = vae
        self.info = info
        self.defaults = defaults
        self.limits = limits
        self.device = torch.device(device)
        #: The transformer's dtype as diffusers reports it (``ModelMixin.dtype``): conditions and
        #: latents enter the transformer in it, as in the pipeline.
        self.dtype: torch.dtype = transformer.dtype
        self.max_sequence_length = max_sequence_length
        vae_cfg = vae.config
        self.temporal_factor = int(vae_cfg.scale_factor_temporal)
        self.spatial_factor = int(vae_cfg.scale_factor_spatial)
        patch = transformer.config.patch_size
        self.size_multiple = max(16, self.spatial_factor * int(patch[1]), self.spatial_factor * int(patch[2]))
        self._patch = tuple(int(p) for p in patch)
        self.latent_channels = int(transformer.config.in_channels)
        self._rope_len = int(transformer.config.rope_max_seq_len)
        self._latents_mean = torch.tensor(vae_cfg.latents_mean).view(1, vae_cfg.z_dim, 1, 1, 1)
        self._latents_std = torch.tensor(vae_cfg.latents_std).view(1, vae_cfg.z_dim, 1, 1, 1)
        if self.device.type == "cuda":  # the fused QK-norm/RoPE and AdaLN kernels, where exact
            fused.install(transformer)
        if next(vae.parameters()).is_cuda:  # the VAE decoder's fast path (kernels.settings.VAE_FAST)
            wan_vae_fast.install(vae)
        #: The blocks' pieces replayed from CUDA graphs (``block_graphs.BLOCK_GRAPHS``).
        self.block_graphs = BlockGraphs(_block_call)

    # -- requests ---------------------------------------------------------------------------------

    def uses_guidance(self, scale: float) -> bool:
        """Whether rows at ``scale`` run the unconditional branch (``WanPipeline``: scale > 1)."""
        return scale > 1.0

    def round_frames(self, num_frames: int) -> int:
        """The frame count the pipeline makes of ``num_frames`` (``n // 4 * 4 + 1`` unless ``4k + 1``)."""
        f = self.temporal_factor
        if num_frames % f != 1:
            num_frames = num_frames // f * f + 1
        return max(num_frames, 1)

    def check(self, request: DiffusionRequest) -> Shape:
        if not isinstance(request, VideoRequest):
            raise RequestRejected(f"model {self.info.id!r} generates videos, not images")
        if not isinstance(request.prompt, str) or not request.prompt.strip():
            raise RequestRejected("prompt must be a non-empty string")
        if request.negative_prompt is not None and not isinstance(request.negative_prompt, str):
            raise RequestRejected("negative_prompt must be a string")
        lim, d = self.limits, self.defaults
        width = _int_field("width", request.width, d.width)
        height = _int_field("height", request.height, d.height)
        m = self.size_multiple
        for name, value, top in (("width", width, lim.max_width), ("height", height, lim.max_height)):
            if value < m or value % m:
                raise RequestRejected(f"{name} must be a positive multiple of {m}, got {value}")
            if value > top:
                raise RequestRejected(f"{name} {value} is over this server's limit of {top}")
        asked = _int_field("num_frames", request.num_frames, d.num_frames or 1)
        if asked < 1:
            raise RequestRejected(f"num_frames must be at least 1, got {asked}")
        frames = self.round_frames(asked)
        if frames > lim.max_frames:
            raise RequestRejected(f"num_frames {asked} is over this server's limit of {lim.max_frames}")
        if frames != asked:
            log.info("num_frames %d is not 4k+1: rounded to %d as WanPipeline does", asked, frames)
        latent = self.latent_shape(Shape(width=width, height=height, frames=frames), 1)[2:]
        positions = [n // p for n, p in zip(latent, self._patch, strict=True)]
        if max(positions) > self._rope_len:
            raise RequestRejected(
                f"{width}x{height} with {frames} frames is beyond the model's position range "
                f"({self._rope_len} latent patches per axis)"
            )
        steps = _int_field("num_inference_steps", request.num_inference_steps, d.num_inference_steps)
        if not 1 <= steps <= lim.max_steps:
            raise RequestRejected(f"num_inference_steps must be between 1 and {lim.max_steps}, got {steps}")
        scale = request.guidance_scale if request.guidance_scale is not None else d.guidance_scale
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
            raise RequestRejected(f"guidance_scale must be a number, got {scale!r}")
        if not 0.0 <= scale <= lim.max_guidance_scale:
            top = lim.max_guidance_scale
            raise RequestRejected(f"guidance_scale must be between 0 and {top}, got {scale}")
        fps = _int_field("fps", request.fps, d.fps or 16)
        if not 1 <= fps <= lim.max_fps:
            raise RequestRejected(f"fps must be between 1 and {lim.max_fps}, got {fps}")
        return Shape(width=width, height=height, frames=frames)

    # -- the step loop's parts --------------------------------------------------------------------

    def count_tokens(self, prompts: Sequence[str]) -> list[int]:
        """The tokens the text encoder reads for each prompt (cleaned, special tokens included,
        truncated at ``max_sequence_length``, as :meth:`encode` reads them): the requests' usage."""
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        if not prompts:
            return []
        ids = self.tokenizer(
            [prompt_clean(p) for p in prompts],
            max_length=self.max_sequence_length,
            truncation=True,
            add_special_tokens=True,
        ).input_ids
        return [len(row) for row in ids]

    @torch.no_grad()
    def encode(self, prompts: Sequence[str]) -> list[torch.Tensor]:
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        if not prompts:
            return []
        length = self.max_sequence_length
        cleaned = [prompt_clean(p) for p in prompts]
        tokens = self.tokenizer(
            cleaned,
            padding="max_length",
            max_length=length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        ids, mask = tokens.input_ids, tokens.attention_mask
        seq_lens = mask.gt(0).sum(dim=1).long().tolist()
        enc_device = next(self.text_encoder.parameters()).device
        hidden = self.text_encoder(ids.to(enc_device), mask.to(enc_device)).last_hidden_state
        hidden = hidden.to(dtype=self.text_encoder.dtype, device=self.device)
        out = []
        for row, n in zip(hidden, seq_lens, strict=True):
            kept = row[:n]
            padded = torch.cat([kept, kept.new_zeros(length - n, kept.size(1))])
            out.append(padded.to(self.dtype))
        return out

    def latent_shape(self, shape: Shape, rows: int) -> tuple[int, int, int, int, int]:
        return (
            rows,
            self.latent_channels,
            (shape.frames - 1) // self.temporal_factor + 1,
            shape.height // self.spatial_factor,
            shape.width // self.spatial_factor,
        )

    def init_latents(self, shape: Shape, generators: Sequence[torch.Generator]) -> torch.Tensor:
        from diffusers.utils.torch_utils import randn_tensor

        gens = list(generators)
        if not gens:
            raise ValueError("init_latents needs one generator per row")
        return randn_tensor(
            self.latent_shape(shape, len(gens)), generator=gens, device=self.device, dtype=torch.float32
        )

    def sampler(self, shape: Shape, steps: int) -> WanSampler:
        scheduler = self._scheduler_cls.from_config(self.scheduler_config)
        return WanSampler(scheduler, steps, self.device)

    @torch.no_grad()
    def predict(
        self,
        latents: torch.Tensor,
        step: int,
        sampler: WanSampler,
        conditions: Sequence[torch.Tensor],
        branch: Branch,
    ) -> torch.Tensor:
        if len(conditions) != latents.shape[0]:
            raise ValueError(f"{latents.shape[0]} rows of latents but {len(conditions)} conditions")
        t = sampler.timesteps[step]
        text = torch.stack(list(conditions)).to(device=self.device, dtype=self.dtype)
        where = {
            "step_index": step,
            "sigma": sampler.sigma(step),
            "num_inference_steps": len(sampler.timesteps),
        }
        with self.transformer.cache_context(branch, **where):
            return self.transformer(
                hidden_states=latents.to(self.dtype),
                timestep=t.expand(latents.shape[0]),
                encoder_hidden_states=text,
                return_dict=False,
            )[0]

    # -- the call in pieces (SplitDenoiser) ------------------------------------------------------
    # ``WanTransformer3DModel.forward`` (diffusers 0.42, text to video), its submodules called in
    # the same order with the same arguments: ``start`` is RoPE, the patch embedding and the
    # time/text embeddings, ``run_blocks`` a range of ``transformer.blocks``, ``finish`` the output
    # norm, projection and unpatchify. A transformer with a cache hook (``enable_cache``) wraps
    # its whole forward: its calls do not split (``num_blocks`` 0).

    @property
    def num_blocks(self) -> int:
        return 0 if forward_is_wrapped(self.transformer) else len(self.transformer.blocks)

    @torch.no_grad()
    def start(
        self,
        latents: torch.Tensor,
        step: int,
        sampler: WanSampler,  # type: ignore[override]
        conditions: Sequence[torch.Tensor],
        branch: Branch,
    ) -> WanCallState:
        tr = self.transformer
        if len(conditions) != latents.shape[0]:
            raise ValueError(f"{latents.shape[0]} rows of latents but {len(conditions)} conditions")
        hidden = latents.to(self.dtype)
        timestep = sampler.timesteps[step].expand(latents.shape[0])
        text = torch.stack(list(conditions)).to(device=self.device, dtype=self.dtype)
        rows, _, frames, height, width = hidden.shape
        p_t, p_h, p_w = tr.config.patch_size
        rotary_emb = tr.rope(hidden)
        hidden = tr.patch_embedding(hidden).flatten(2).transpose(1, 2).contiguous()
        temb, timestep_proj, text, _ = tr.condition_embedder(timestep, text, None, timestep_seq_len=None)
        timestep_proj = timestep_proj.unflatten(1, (6, -1))
        grid = (frames // p_t, height // p_h, width // p_w)
        return WanCallState(hidden, text, timestep_proj, temb, rotary_emb, grid, (p_t, p_h, p_w))

    @torch.no_grad()
    def run_blocks(self, state: WanCallState, start: int, stop: int) -> WanCallState:
        cos, sin = state.rotary_emb
        inputs = dict(hidden=state.hidden, text=state.text, proj=state.timestep_proj, cos=cos, sin=sin)
        state.hidden = self.block_graphs.run(self.transformer.blocks, inputs, start, stop)
        return state

    @torch.no_grad()
    def finish(self, state: WanCallState) -> torch.Tensor:
        tr = self.transformer
        hidden, temb = state.hidden, state.temb
        shift, scale = (tr.scale_shift_table.to(temb.device) + temb.unsqueeze(1)).chunk(2, dim=1)
        shift = shift.to(hidden.device)
        scale = scale.to(hidden.device)
        hidden = (tr.norm_out(hidden.float()) * (1 + scale) + shift).type_as(hidden)
        hidden = tr.proj_out(hidden)
        p_t, p_h, p_w = state.patch
        hidden = hidden.reshape(hidden.shape[0], *state.grid, p_t, p_h, p_w, -1)
        hidden = hidden.permute(0, 7, 1, 4, 2, 5, 3, 6)
        return hidden.flatten(6, 7).flatten(4, 5).flatten(2, 3)

    def keep_rows(self, state: WanCallState, rows: Sequence[int]) -> WanCallState:
        index = torch.tensor(list(rows), dtype=torch.long, device=state.hidden.device)
        return WanCallState(
            state.hidden.index_select(0, index),
            state.text.index_select(0, index),
            state.timestep_proj.index_select(0, index),
            state.temb.index_select(0, index),
            state.rotary_emb,  # per position, shared by the rows
            state.grid,
            state.patch,
        )

    def guide(self, cond: torch.Tensor, uncond: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        scales = [float(s) for s in scale.reshape(-1).tolist()]
        if len(scales) != cond.shape[0]:
            raise ValueError(f"{cond.shape[0]} rows but {len(scales)} guidance scales")
        if all(s == scales[0] for s in scales):
            return uncond + scales[0] * (cond - uncond)
        rows = [uncond[i : i + 1] + s * (cond[i : i + 1] - uncond[i : i + 1]) for i, s in enumerate(scales)]
        return torch.cat(rows)

    def _vae_input(self, latents: torch.Tensor) -> torch.Tensor:
        """The latents de-normalised for the VAE, on its device in its dtype (as the pipeline)."""
        vae_device = next(self.vae.parameters()).device
        z = latents.to(vae_device, dtype=self.vae.dtype)
        mean = self._latents_mean.to(z.device, z.dtype)
        inv_std = 1.0 / self._latents_std.to(z.device, z.dtype)
        return z / inv_std + mean

    @staticmethod
    def _to_pixels(video: torch.Tensor) -> torch.Tensor:
        """``[rows, 3, frames, H, W]`` in [-1, 1] to uint8 ``[rows, frames, H, W, 3]`` on the CPU."""
        pixels = (video * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).float()
        return (pixels * 255).round().to(torch.uint8).cpu()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        video = self.vae.decode(self._vae_input(latents), return_dict=False)[0]
        return self._to_pixels(video)

    # -- the VAE decode in pieces (SplitDecoder) ---------------------------------------------------
    # ``AutoencoderKLWan._decode`` (diffusers 0.42, no tiling): ``post_quant_conv`` over all the
    # latents, then the causal decoder one latent frame at a time (frame 0 with ``first_chunk``),
    # each call starting its conv index at 0 and sharing one feature cache, then the frames
    # concatenated, unpatchified (Wan2.2) and clamped. Here the feature cache and the conv index
    # are the decode state's own lists, passed as ``feat_cache`` / ``feat_idx`` as ``_decode``
    # passes the module's: decodes of several jobs never share the module's ``_feat_map``. Each
    # decoder call runs in stages (``wan_vae_fast.decoder_stage``: its up blocks), the frame's
    # activations kept in the state between them, so a piece may be shorter than a latent frame
    # (at 480p on the H200 a latent frame is about 92 ms, over one 80 ms realtime frame).

    @property
    def decode_splits(self) -> bool:
        """Whether decodes run in pieces: not with the VAE's tiling or slicing on (``decode``
        then follows them whole), nor with a model-level hook on the VAE (an offload hook could
        move it off the device between two pieces)."""
        vae = self.vae
        tiled = getattr(vae, "use_tiling", False) or getattr(vae, "use_slicing", False)
        return not tiled and not forward_is_wrapped(vae)

    def decode_parts_total(self, shape: Shape) -> int:
        """The parts of one decode of ``shape``: each latent frame's decoder call, cut into its
        stages (``wan_vae_fast.decoder_stages``: one per up block)."""
        frames = (shape.frames - 1) // self.temporal_factor + 1
        return frames * decoder_stages(self.vae.decoder)

    def decode_part_kinds(self, shape: Shape) -> int:
        """The parts cycle through this many kinds, which cost differently: a latent frame's
        decoder stages (on the H200 at 480p 7, 14, 28 and 45 ms)."""
        return decoder_stages(self.vae.decoder)

    @torch.no_grad()
    def start_decode(self, latents: torch.Tensor) -> WanDecodeState:
        vae = self.vae
        if not self.decode_splits:
            raise ValueError("this VAE decodes whole (tiling, slicing or a hook is on)")
        x = vae.post_quant_conv(self._vae_input(latents))
        cache: list[Any] = [None] * int(vae._cached_conv_counts["decoder"])
        fast = fast_decode_applies(vae.decoder, x[:, :, :1])
        return WanDecodeState(x, cache, [], 0, int(x.shape[2]), stages=decoder_stages(vae.decoder), fast=fast)

    @torch.no_grad()
    def decode_parts(self, state: WanDecodeState, n: int) -> WanDecodeState:
        """The next ``n`` parts (fewer when fewer are left): stages of the decoder's calls, one
        latent frame after the other, each frame's activations kept between its stages."""
        if n < 0:
            raise ValueError(f"cannot decode {n} parts")
        decoder = self.vae.decoder
        for _ in range(n):
            if state.done == state.total:
                break
            i = state.done
            if state.stage == 0:
                state.hidden, state.conv = state.latents[:, :, i : i + 1, :, :], [0]
            assert state.hidden is not None
            state.hidden = decoder_stage(
                decoder, state.stage, state.hidden, state.cache, state.conv, i == 0, state.fast
            )
            state.stage += 1
            if state.stage == state.stages:
                state.frames.append(state.hidden)
                state.hidden, state.stage, state.done = None, 0, i + 1
        return state

    @torch.no_grad()
    def finish_decode(self, state: WanDecodeState) -> torch.Tensor:
        """The pixels of a decode whose frames all ran: uint8 ``[rows, frames, H, W, 3]``, bitwise
        :meth:`decode`'s."""
        from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

        if state.done != state.total:
            total = state.total * state.stages
            raise ValueError(f"decode has run {state.parts_done} of {total} parts")
        out = torch.cat(state.frames, 2)
        state.frames.clear()
        state.cache.clear()
        patch = self.vae.config.patch_size
        if patch is not None:
            out = unpatchify(out, patch_size=patch)
        return self._to_pixels(torch.clamp(out, min=-1.0, max=1.0))

    def decode_keep_rows(self, state: WanDecodeState, rows: Sequence[int]) -> WanDecodeState:
        """The decode of the listed rows only; the others' latents, cache and frames are released."""
        index = torch.tensor(list(rows), dtype=torch.long, device=state.latents.device)

        def pick(t: Any) -> Any:
            return t.index_select(0, index.to(t.device)) if isinstance(t, torch.Tensor) else t

        return dataclasses.replace(
            state,
            latents=pick(state.latents),
            cache=[pick(c) for c in state.cache],
            frames=[pick(f) for f in state.frames],
            hidden=pick(state.hidden),
        )

    def preview(self, latents: torch.Tensor) -> torch.Tensor:
        """The first frame only (the causal VAE decodes the first latent frame alone, at a fraction
        of the full decode): uint8 ``[rows, 1, H, W, 3]``."""
        return self.decode(latents[:, :, :1])


def _int_field(name: str, value: Any, default: int) -> int:
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestRejected(f"{name} must be an integer, got {value!r}")
    return value
