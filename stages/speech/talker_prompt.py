"""The talker's prompt, as ``Qwen3OmniMoeForConditionalGeneration.generate`` builds it, but streamed.

``generate`` runs the whole thinker first, then feeds the talker:

* a prompt of the user turns (text tokens through ``text_projection`` of their thinker input
  embeddings, audio/image tokens through ``hidden_projection`` of the thinker's
  ``accept_hidden_layer`` states) followed by nine assistant positions: ``<|im_start|>``,
  ``assistant``, ``\\n`` + zero codec, four ``tts_pad`` + codec ``nothink, think_bos, think_eos,
  speaker``, ``tts_bos`` + codec ``pad``, and the first reply token + codec ``bos``;
* then, at decode step ``k``, the sum of the previous frame's codec embeddings plus the text
  embedding of reply token ``k + 1`` (``tts_eos`` right after the last one, ``tts_pad`` after).

So talker step ``k`` needs only reply token ``k + 1``: the talker runs one step behind the
thinker. This module builds the user part and the assistant header from a prompt's prefill
and the talker prompt's multimodal RoPE index; :mod:`.talker` runs the steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn

from ..graphs import upload


@dataclass
class TalkerPrompt:
    """What a request's talker needs from its thinker prefill (all on the model's device)."""

    user_embeds: torch.Tensor  # [U, Ht] talker-space embeddings of the user turns
    user_ids: torch.Tensor  # [U] their thinker token ids, on the host (for the multimodal RoPE index)
    assistant_embeds: torch.Tensor  # [A, Dthinker] thinker input embeddings from <|im_start|>assistant on
    #: The first ``reused`` user positions are in the talker's slot already (a reused prefix):
    #: their rows of ``user_embeds`` are zeros, not read.
    reused: int = 0


def user_positions(input_ids: torch.Tensor, im_start: int, user: int) -> torch.Tensor:
    """Which positions of a prompt ``input_ids`` [L] lie in user turns (after
    ``<|im_start|>user``), as a bool mask [L]: what the talker prompt keeps."""
    length = input_ids.shape[0]
    positions = torch.arange(length, device=input_ids.device)
    starts = torch.where(input_ids == im_start, positions, positions.new_full((), -1))
    previous_start = torch.cummax(starts, dim=0).values.clamp_min(0)
    return input_ids[(previous_start + 1).clamp_max(length - 1)] == user


def build_talker_prompt(
    model: nn.Module,
    input_ids: torch.Tensor,
    thinker_embeds: torch.Tensor,
    thinker_hidden: torch.Tensor,
    *,
    start: int = 0,
    reused: int = 0,
) -> TalkerPrompt:
    """The user part of the talker prompt and the assistant header, from one prompt's prefill.

    ``input_ids`` [L] on the host (which positions are what is decided there, so building the
    prompt never waits for the GPU); ``thinker_embeds`` [L, D] and ``thinker_hidden`` [L - start,
    D] (hidden states 0 and ``accept_hidden_layer`` of a thinker prefill that read the prompt from
    position ``start`` on), on the model's device. With ``reused``, the talker's slot holds the
    first ``reused`` user positions already: only the later ones are built, and those of audio or
    images must lie at or after ``start`` (their hidden states are needed).
    """
    cfg = model.config
    tcfg = cfg.thinker_config
    ids = input_ids.cpu()
    device = thinker_embeds.device
    length = ids.shape[0]
    user = user_positions(ids, cfg.im_start_token_id, cfg.user_token_id)
    built = user & (torch.cumsum(user.long(), 0) > reused) if reused else user
    multimodal = (ids == tcfg.audio_token_id) | (ids == tcfg.image_token_id) | (ids == tcfg.video_token_id)
    header = (ids[:-1] == cfg.im_start_token_id) & (ids[1:] == cfg.assistant_token_id)
    if not bool(header.any()):
        raise ValueError("the prompt has no open assistant turn (<|im_start|>assistant)")
    assistant_start = int(header.nonzero().flatten()[-1])
    mm_at = (built & multimodal).nonzero().flatten()
    if mm_at.numel() and int(mm_at[0]) < start:
        raise ValueError("an audio or image position the talker reads lies in the reused thinker prefix")
    txt_at = (built & ~multimodal).nonzero().flatten()
    talker = model.talker
    embeds = torch.empty(
        (length, cfg.talker_config.text_config.hidden_size), device=device, dtype=thinker_embeds.dtype
    )
    if reused:
        embeds[upload((user & ~built).nonzero().flatten(), device)] = 0
    if mm_at.numel():
        hidden = thinker_hidden[upload(mm_at - start, device)]
        embeds[upload(mm_at, device)] = talker.hidden_projection(hidden).to(embeds.dtype)
    if txt_at.numel():
        at = upload(txt_at, device)
        embeds[at] = talker.text_projection(thinker_embeds[at]).to(embeds.dtype)
    user_at = user.nonzero().flatten()
    return TalkerPrompt(
        user_embeds=embeds[upload(user_at, device)],
        user_ids=ids[user_at],
        assistant_embeds=thinker_embeds[assistant_start:],
        reused=reused,
    )


class TalkerRope:
    """Multimodal RoPE positions of talker prompts, as ``generate`` computes them; the
    configuration it reads is built once per model.

    transformers' talker ``get_rope_index`` reads ``config.audio_config.n_window``, which the
    talker config lacks, whenever a prompt holds an image *and* audio (it raises
    AttributeError there). The window is the thinker audio encoder's, so this runs the same
    function with the talker's config plus that one value.
    """

    def __init__(self, model: nn.Module) -> None:
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            Qwen3OmniMoePreTrainedModelForConditionalGeneration as Base,
        )

        talker = model.talker
        config = SimpleNamespace(**talker.config.to_dict())
        config.audio_config = SimpleNamespace(n_window=model.config.thinker_config.audio_config.n_window)
        merge = getattr(talker, "spatial_merge_size", None) or talker.config.spatial_merge_size
        shim = SimpleNamespace(config=config, spatial_merge_size=merge)
        shim.get_llm_pos_ids_for_vision = lambda *args: Base.get_llm_pos_ids_for_vision(shim, *args)
        self._shim = shim
        self._get_rope_index = Base.get_rope_index

    def __call__(
        self, ids: torch.Tensor, image_grid_thw: torch.Tensor | None, audio_lengths: torch.Tensor | None
    ) -> torch.Tensor:
        """The positions [3, 1, L] of the talker prompt ``ids`` [1, L] (host tensors)."""
        mask = torch.ones_like(ids)
        positions, _ = self._get_rope_index(
            self._shim, ids, image_grid_thw, None, mask, False, audio_lengths, None
        )
        return positions
