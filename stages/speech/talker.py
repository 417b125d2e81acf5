"""The talker's inputs, as ``Qwen3OmniMoeForConditionalGeneration.generate`` builds them, but streamed.

``generate`` runs the whole thinker first, then feeds the talker:

* a prompt of the user turns (text tokens through ``text_projection`` of their thinker input
  embeddings, audio/image tokens through ``hidden_projection`` of the thinker's
  ``accept_hidden_layer`` states) followed by nine assistant positions: ``<|im_start|>``,
  ``assistant``, ``\\n`` + zero codec, four ``tts_pad`` + codec ``nothink, think_bos, think_eos,
  speaker``, ``tts_bos`` + codec ``pad``, and the first reply token + codec ``bos``;
* then, at decode step ``k``, the sum of the previous frame's codec embeddings plus the text
  embedding of reply token ``k + 1`` (``tts_eos`` right after the last one, ``tts_pad`` after).

So talker step ``k`` needs only reply token ``k + 1``: the talker runs one step behind the
thinker, and this module gives each request the inputs of its next step as soon as the thinker
has produced them. Each frame's residual codes come from the code predictor, batched across
requests (every row is at the same code group at the same time, so no padding is involved),
run by :class:`~.slots.SlotDecoder` over its layers with a per-request slot of
``num_code_groups + 1`` positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from torch import nn

from .sampling import SamplingParams, apply_repetition_penalty, choose_rows_tensor
from .slots import SlotDecoder


@dataclass
class TalkerPrompt:
    """What a request's talker needs from its thinker prefill (all on the model's device)."""

    user_embeds: torch.Tensor  # [U, Ht] talker-space embeddings of the user turns
    user_ids: torch.Tensor  # [U] their thinker token ids (for the multimodal RoPE index)
    assistant_embeds: torch.Tensor  # [A, Dthinker] thinker input embeddings from <|im_start|>assistant on


@dataclass(eq=False)
class TalkerState:
    prompt: TalkerPrompt | None
    speaker_id: int
    params: SamplingParams
    max_frames: int
    started: bool = False
    done: bool = False
    position: int = 0
    step: int = 0  # decode steps run == frames made == index into the trailing text
    next_code: int = -1  # code group 0 of the next frame (sampled, not yet expanded)
    hidden: torch.Tensor | None = None  # last talker hidden state [Ht]
    #: The code predictor's sampling (built once per request, used for every frame).
    predictor_params: SamplingParams = field(default_factory=SamplingParams)


def build_talker_prompt(
    model: nn.Module,
    input_ids: torch.Tensor,
    thinker_embeds: torch.Tensor,
    thinker_hidden: torch.Tensor,
) -> TalkerPrompt:
    """The user part of the talker prompt and the assistant header, from one prompt's prefill.

    ``input_ids`` [L]; ``thinker_embeds`` / ``thinker_hidden`` [L, D] (hidden states 0 and
    ``accept_hidden_layer`` of the thinker prefill).
    """
    cfg = model.config
    tcfg = cfg.thinker_config
    length = input_ids.shape[0]
    positions = torch.arange(length, device=input_ids.device)
    starts = torch.where(input_ids == cfg.im_start_token_id, positions, positions.new_full((), -1))
    previous_start = torch.cummax(starts, dim=0).values.clamp_min(0)
    roles = input_ids[(previous_start + 1).clamp_max(length - 1)]
    user = roles == cfg.user_token_id
    multimodal = (
        (input_ids == tcfg.audio_token_id)
        | (input_ids == tcfg.image_token_id)
        | (input_ids == tcfg.video_token_id)
    )
    talker = model.talker
    embeds = torch.empty(
        (length, cfg.talker_config.text_config.hidden_size),
        device=input_ids.device,
        dtype=thinker_embeds.dtype,
    )
    mm = user & multimodal
    txt = user & ~multimodal
    if bool(mm.any()):
        embeds[mm] = talker.hidden_projection(thinker_hidden[mm]).to(embeds.dtype)
    if bool(txt.any()):
        embeds[txt] = talker.text_projection(thinker_embeds[txt]).to(embeds.dtype)
    header = (input_ids[:-1] == cfg.im_start_token_id) & (input_ids[1:] == cfg.assistant_token_id)
    if not bool(header.any()):
        raise ValueError("the prompt has no open assistant turn (<|im_start|>assistant)")
    assistant_start = int(torch.nonzero(header).flatten()[-1])
    return TalkerPrompt(
        user_embeds=embeds[user],
        user_ids=input_ids[user],
        assistant_embeds=thinker_embeds[assistant_start:],
    )


def talker_rope_index(
    model: nn.Module,
    ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    audio_lengths: torch.Tensor | None,
) -> torch.Tensor:
    """Multimodal RoPE positions [3, 1, L] of a talker prompt, as ``generate`` computes them.

    transformers' talker ``get_rope_index`` reads ``config.audio_config.n_window``, which the
    talker config lacks, whenever a prompt holds an image *and* audio (it raises
    AttributeError there). The window is the thinker audio encoder's, so this runs the same
    function with the talker's config plus that one value.
    """
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoePreTrainedModelForConditionalGeneration as Base,
    )

    talker = model.talker
    config = SimpleNamespace(**talker.config.to_dict())
    config.audio_config = SimpleNamespace(n_window=model.config.thinker_config.audio_config.n_window)
    merge = getattr(talker, "spatial_merge_size", None) or talker.config.spatial_merge_size
    shim = SimpleNamespace(config=config, spatial_merge_size=merge)
    shim.get_llm_pos_ids_for_vision = lambda *args: Base.get_llm_pos_ids_for_vision(shim, *args)
    mask = torch.ones_like(ids)
    positions, _ = Base.get_rope_index(shim, ids, image_grid_thw, None, mask, False, audio_lengths, None)
    return positions


class Talker:
    """The talker side of the model: special embeddings, prefill inputs and code prediction."""

    def __init__(self, model: nn.Module, *, max_slots: int, repetition_penalty: float = 1.05) -> None:
        self.talker = model.talker
        cfg = model.config
        self.cfg = cfg.talker_config
        self.num_groups = int(self.cfg.num_code_groups)
        vocab = int(self.cfg.text_config.vocab_size)
        self.eos = int(self.cfg.codec_eos_token_id)
        device = next(model.parameters()).device
        suppress = torch.zeros(vocab, dtype=torch.bool, device=device)
        suppress[vocab - 1024 :] = True
        suppress[self.eos] = False
        self.suppress = suppress
        self.repetition_penalty = repetition_penalty
        #: Per slot: the group-0 codes its request has drawn (for the repetition penalty).
        self.seen = torch.zeros((max_slots, vocab), dtype=torch.bool, device=device)
        self._true = torch.ones((), dtype=torch.bool, device=device)  # marks ``seen`` without a host copy
        with torch.no_grad():
            special = torch.tensor(
                [[cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id]], device=device
            )
            proj = self.talker.text_projection(model.thinker.get_input_embeddings()(special))[0]
        self.tts_bos, self.tts_eos, self.tts_pad = proj[0], proj[1], proj[2]
        self.tts_pad_token_id = int(cfg.tts_pad_token_id)
        self.predictor_decoder = SlotDecoder(
            self.talker.code_predictor.model,
            num_slots=max_slots,
            max_len=self.num_groups + 1,
            device=device,
            dtype=next(model.parameters()).dtype,
            multimodal_rope=False,
        )

    @torch.no_grad()
    def text_embeds(self, thinker_embeds: torch.Tensor) -> torch.Tensor:
        return self.talker.text_projection(thinker_embeds)

    @torch.no_grad()
    def prefill_inputs(
        self, prompt: TalkerPrompt, first_text: torch.Tensor, speaker_id: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The talker prompt embeddings [U + 9, Ht] and its ids (for RoPE), given reply token 0's
        thinker embedding ``first_text`` [D] (or the prompt's own fourth assistant position)."""
        cfg = self.cfg
        head = self.talker.text_projection(torch.cat([prompt.assistant_embeds[:3], first_text[None]], dim=0))
        pad = self.tts_pad[None].expand(4, -1)
        text_side = torch.cat([head[:3], pad, self.tts_bos[None], head[3:4]], dim=0)
        codec_ids = torch.tensor(
            [
                cfg.codec_nothink_id,
                cfg.codec_think_bos_id,
                cfg.codec_think_eos_id,
                speaker_id,
                cfg.codec_pad_id,
                cfg.codec_bos_id,
            ],
            device=text_side.device,
        )
        codec_side = torch.cat(
            [
                torch.zeros((3, text_side.shape[-1]), device=text_side.device, dtype=text_side.dtype),
                self.talker.get_input_embeddings()(codec_ids),
            ],
            dim=0,
        )
        embeds = torch.cat([prompt.user_embeds, text_side + codec_side], dim=0)
        ids = torch.cat([prompt.user_ids, prompt.user_ids.new_full((9,), self.tts_pad_token_id)])
        return embeds, ids

    def reset_seen(self, slot: int) -> None:
        self.seen[slot] = False

    def choose_codes(self, logits: torch.Tensor, slots: torch.Tensor, states: list[TalkerState]) -> list[int]:
        """Code group 0 for each row of ``logits`` [B, V]: repetition penalty over the codes each
        request drew before, special codes suppressed, then greedy or sampled per request."""
        logits = apply_repetition_penalty(logits.float(), self.seen[slots], self.repetition_penalty)
        logits = logits.masked_fill(self.suppress, float("-inf"))
        codes = choose_rows_tensor(logits, [s.params for s in states])
        self.seen.index_put_((slots, codes), self._true)
        return codes.tolist()

    @torch.no_grad()
    def residual_codes(
        self,
        slots: list[int],
        index: torch.Tensor,
        hidden: torch.Tensor,
        first_codes: torch.Tensor,
        params: list[SamplingParams],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Code groups 1.. for each row, from the talker hidden state [B, Ht] and group-0 codes [B]
        (``slots``: the rows' slots, ``index`` the same as a device tensor).

        The code predictor reads [hidden, embedding of code 0] and then each code it draws, for
        every row at once (all rows are at the same group). Returns the full frames [B, G] and
        the next talker input, the sum of the frame's codec embeddings [B, Ht].
        """
        predictor = self.talker.code_predictor
        decoder = self.predictor_decoder
        decoder.reset(slots, index)
        first = self.talker.get_input_embeddings()(first_codes)
        zeros = torch.zeros_like(first_codes)
        decoder.step(slots, hidden, zeros, index)
        x = first
        codes = [first_codes]
        total = first
        for group in range(self.num_groups - 1):
            out = decoder.step(slots, x, zeros + group + 1, index)
            logits = predictor.lm_head[group](out)
            picked = choose_rows_tensor(logits, params)
            codes.append(picked)
            x = predictor.model.codec_embedding[group](picked)
            total = total + x
        return torch.stack(codes, dim=1), total
