"""The talker side of the speech pipeline: per-slot device state, the talker's prompt pass, and
the batched frame step (code predictor for the pending frame, talker decode, next group-0
code), replayed from CUDA graphs. Its inputs (the prompt, and the text each step reads) are
built as ``generate`` builds them: see :mod:`.talker_prompt`.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch
from torch import nn

from ..draws import PREDICTOR_STREAM, TALKER_STREAM, SlotSampling
from ..graphs import upload
from ..sampling import apply_repetition_penalty
from .slots import PieceCall, PromptPass, SlotDecoder, decode_runner, prompt_example
from .talker_prompt import TalkerPrompt

#: The talker's sampling when the request samples (its generation defaults in ``generate``).
TALKER_SAMPLING = {"temperature": 0.9, "top_k": 50, "top_p": 1.0}
CODE_PREDICTOR_SAMPLING = {"temperature": 1.0, "top_k": 50, "top_p": 0.8}


@dataclass(eq=False)
class TalkerState:
    """A request's talker bookkeeping on the host (its tensors live in :class:`Talker`'s slots)."""

    prompt: TalkerPrompt | None
    speaker_id: int
    max_frames: int
    started: bool = False
    done: bool = False
    step: int = 0  # decode steps run == frames made == index into the trailing text
    next_code: int = -1  # host copy of code group 0 of the next frame (read after each step)


@dataclass
class TalkerPrefill:
    """A talker prompt's prefill, before it is loaded into its slot."""

    length: int  # prompt positions (their keys/values are in the slot already)
    next_position: torch.Tensor  # 0-d
    hidden: torch.Tensor  # [Ht] the last hidden state
    header: torch.Tensor | None  # projected assistant-header positions from 4 on, if any
    code: torch.Tensor  # 0-d: the first group-0 code


#: Kinds of a talker step's text input (``text_kind``): a reply token's thinker id, the end of
#: the text, padding after it, or a position of the assistant header (``text_token`` its index).
TEXT_TOKEN, TEXT_EOS, TEXT_PAD, TEXT_HEADER = 0, 1, 2, 3
#: Assistant-header positions a talker step can read (the header is 3 in Qwen3-Omni's template).
HEADER_MAX = 16


class Talker:
    """The talker side of the model: per-slot device state, prefill, and the batched frame step
    (code predictor for the pending frame, talker decode, next group-0 code) replayed from CUDA
    graphs, one per (batch bucket, attention length bucket)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        max_slots: int,
        max_len: int,
        max_prompt: int,
        batch_buckets: list[int],
        graphs: bool,
        pool: object | None,
        repetition_penalty: float = 1.05,
        prompt_chunk: int = 512,
    ) -> None:
        self.model = model
        self.talker = model.talker
        cfg = model.config
        self.cfg = cfg.talker_config
        self.num_groups = int(self.cfg.num_code_groups)
        vocab = int(self.cfg.text_config.vocab_size)
        self.eos = int(self.cfg.codec_eos_token_id)
        param = next(model.parameters())
        device, dtype = param.device, param.dtype
        self.device = device
        suppress = torch.zeros(vocab, dtype=torch.bool, device=device)
        suppress[vocab - 1024 :] = True
        suppress[self.eos] = False
        self.suppress = suppress
        self.repetition_penalty = repetition_penalty
        self.thinker_embed = model.thinker.get_input_embeddings()
        with torch.no_grad():
            special = torch.tensor(
                [[cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id]], device=device
            )
            proj = self.talker.text_projection(self.thinker_embed(special))[0]
        self.tts_bos, self.tts_eos, self.tts_pad = proj[0], proj[1], proj[2]
        self.tts_pad_token_id = int(cfg.tts_pad_token_id)
        hidden_size = int(self.cfg.text_config.hidden_size)
        self.kv = SlotDecoder(
            self.talker.model, num_slots=max_slots, max_len=max_len, device=device, dtype=dtype
        )
        self.predictor = SlotDecoder(
            self.talker.code_predictor.model,
            num_slots=max_slots,
            max_len=self.num_groups + 1,
            device=device,
            dtype=dtype,
            multimodal_rope=False,
        )
        # Per slot: sampling rows, the last hidden state, the drawn group-0 code, the next RoPE
        # position, the group-0 codes drawn so far (repetition penalty), the projected assistant
        # header, and the frame made by the last step.
        self.sampling = SlotSampling(max_slots, device)
        self.predictor_sampling = SlotSampling(max_slots, device)
        self.hidden = torch.zeros((max_slots, hidden_size), device=device, dtype=dtype)
        self.next_code = torch.zeros(max_slots, dtype=torch.long, device=device)
        self.position = torch.zeros(max_slots, dtype=torch.long, device=device)
        self.seen = torch.zeros((max_slots, vocab), dtype=torch.bool, device=device)
        self.header = torch.zeros((max_slots, HEADER_MAX, hidden_size), device=device, dtype=dtype)
        self.frames = torch.zeros((max_slots, self.num_groups), dtype=torch.long, device=device)
        self._rows = torch.arange(max_slots, device=device)
        self._group_positions = torch.arange(self.num_groups, device=device)
        # Every row of a predictor step stands at the same group: its rotary tables, made once.
        self._group_ropes = [self.predictor.shared_rope(g) for g in range(self.num_groups)]
        self.runner = decode_runner(
            self._step, self._example, batch_buckets=batch_buckets, max_len=max_len, graphs=graphs, pool=pool
        )
        self.prompt = PromptPass(
            self._prompt_step, self._prompt_example, chunk=prompt_chunk, max_len=min(max_prompt, max_len),
            graphs=graphs, pool=pool,
        )

    # -- admission and prefill -------------------------------------------------------------------
    def set_sampling(self, slot: int, *, sample: bool, seed: int) -> None:
        """Greedy talker and code predictor for a greedy request; else ``generate``'s talker
        defaults (see :data:`TALKER_SAMPLING`, :data:`CODE_PREDICTOR_SAMPLING`)."""
        if sample:
            self.sampling.set(slot, seed=seed, **TALKER_SAMPLING)
            self.predictor_sampling.set(slot, seed=seed, **CODE_PREDICTOR_SAMPLING)
        else:
            greedy = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": seed}
            self.sampling.set(slot, **greedy)
            self.predictor_sampling.set(slot, **greedy)

    def prefill_inputs(
        self, prompt: TalkerPrompt, first_text: torch.Tensor, speaker_id: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The talker prompt embeddings [U + 9, Ht] and its ids (for RoPE), given reply token 0's
        thinker embedding ``first_text`` [D] (or the prompt's own fourth assistant position)."""
        cfg = self.cfg
        head = self.talker.text_projection(torch.cat([prompt.assistant_embeds[:3], first_text[None]], dim=0))
        pad = self.tts_pad[None].expand(4, -1)
        text_side = torch.cat([head[:3], pad, self.tts_bos[None], head[3:4]], dim=0)
        codec_ids = upload(
            torch.tensor(
                [
                    cfg.codec_nothink_id,
                    cfg.codec_think_bos_id,
                    cfg.codec_think_eos_id,
                    speaker_id,
                    cfg.codec_pad_id,
                    cfg.codec_bos_id,
                ]
            ),
            text_side.device,
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
        return embeds, ids  # ids on the host, as the prompt's

    def forward_prompt(
        self,
        slot: int,
        prompt: TalkerPrompt,
        first_text: torch.Tensor,
        speaker_id: int,
        rope: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> Generator[PieceCall | None, dict[str, torch.Tensor] | None, TalkerPrefill]:
        """Runs the talker prompt into ``slot``'s cache entries in static-length pieces (a
        generator that yields between them, as :meth:`Thinker.forward_prompt`) and draws its
        first group-0 code with the slot's sampling row. Writes only entries no decode step
        touches while the slot waits (it may run on another thread and CUDA stream); with
        ``prompt.reused``, the slot holds that many user positions already and the pass starts
        after them. :meth:`load` ends the prefill. ``rope``: the prompt ids [L] -> their multimodal RoPE
        index [3, 1, L], on the host; None for prompts without audio or images (positions 0..L-1)."""
        embeds, ids = self.prefill_inputs(prompt, first_text, speaker_id)
        length = ids.shape[0]
        if rope is not None:  # computed on the host from the host ids
            positions = upload(rope(ids), self.device)
        else:
            positions = torch.arange(length, device=self.device).view(1, 1, -1).expand(3, 1, -1)
        hidden = (yield from self.prompt.run(embeds, positions, slot, start=prompt.reused))["last"]
        header = prompt.assistant_embeds[4 : 4 + HEADER_MAX]
        # A fresh slot has drawn no code yet: no repetition penalty on the first one.
        logits = self.talker.codec_head(hidden).float().masked_fill(self.suppress, float("-inf"))
        return TalkerPrefill(
            length,
            positions.max() + 1,
            hidden[0],
            self.talker.text_projection(header) if header.shape[0] else None,
            self.sampling.draw(logits, slot, TALKER_STREAM)[0],
        )

    def _prompt_example(self, batch: int, length: int, chunk: int | None) -> dict[str, torch.Tensor]:
        return prompt_example(batch, length, self.hidden.shape[-1], self.hidden.dtype, self.device, chunk)

    def _prompt_step(self, inputs: dict[str, torch.Tensor], bucket: int) -> dict[str, torch.Tensor]:
        last, _ = self.kv.prompt_step(
            inputs["embeds"], inputs["positions"], inputs["slot"], inputs["length"],
            start=inputs.get("start"), attend=bucket,
        )
        return {"last": last}

    def load(self, slot: int, prefill: TalkerPrefill) -> None:
        """Ends a prefill in ``slot`` (on the engine thread, in stream order)."""
        self.kv.set_length(slot, prefill.length)
        self.position[slot] = prefill.next_position
        self.hidden[slot] = prefill.hidden
        if prefill.header is not None:
            self.header[slot, : prefill.header.shape[0]] = prefill.header
        self.seen[slot] = False
        self.seen[slot, prefill.code] = True
        self.next_code[slot] = prefill.code
        self.sampling.advance_slot(slot)

    def move(self, source: int, target: int, *, swap: bool = False) -> None:
        """A request's state moves from slot ``source`` to free slot ``target`` (between steps, on
        the engine thread): every per-slot tensor of ``__init__`` (the ones :meth:`state` names and
        the header); ``swap``: ``target``'s cache entries go to ``source`` (a prefix kept). No
        device sync."""
        self.kv.move(source, target, swap=swap)
        self.predictor.move(source, target)
        for row in (self.hidden, self.next_code, self.position, self.seen, self.header, self.frames):
            row[target] = row[source]
        self.sampling.copy_row(source, target)
        self.predictor_sampling.copy_row(source, target)

    def _choose(self, logits: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Code group 0 for slots ``start..stop-1`` from ``logits`` [B, V]: repetition penalty over
        the codes each slot drew before, special codes suppressed, then the slot's sampling."""
        logits = apply_repetition_penalty(logits.float(), self.seen[start:stop], self.repetition_penalty)
        logits = logits.masked_fill(self.suppress, float("-inf"))
        return self.sampling.draw(logits, start, TALKER_STREAM)

    # -- the frame step --------------------------------------------------------------------------
    def state(self) -> dict[str, torch.Tensor]:
        """Every tensor a frame step changes, by name."""
        return {
            **self.kv.state("kv"),
            **self.predictor.state("predictor"),
            "hidden": self.hidden,
            "next_code": self.next_code,
            "position": self.position,
            "seen": self.seen,
            "frames": self.frames,
            "counter": self.sampling.counter,
            "predictor_counter": self.predictor_sampling.counter,
        }

    def _example(self, batch: int, length: int = 0) -> dict[str, torch.Tensor]:
        def zeros() -> torch.Tensor:  # one buffer per input: the graph copies into each
            return torch.zeros(batch, dtype=torch.long, device=self.device)

        return {"active": zeros().bool(), "text_token": zeros(), "text_kind": zeros()}

    def step(
        self, slots: list[int], text: list[tuple[int, int]], batch: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One frame for each of ``slots`` (all below ``batch``), with ``text`` [(kind, token)]
        the trailing text input of each (see :data:`TEXT_TOKEN` ...). Returns views [batch, G]
        of the finished frames (group 0 = each slot's pending code) and [batch] of the next
        group-0 codes, on the device."""
        packed = torch.zeros((3, batch), dtype=torch.long, pin_memory=self.device.type == "cuda")
        packed[0, slots] = 1
        packed[1, slots] = torch.tensor([t for _, t in text], dtype=torch.long)
        packed[2, slots] = torch.tensor([k for k, _ in text], dtype=torch.long)
        packed = packed.to(self.device, non_blocking=True)
        inputs = {"active": packed[0].bool(), "text_token": packed[1], "text_kind": packed[2]}
        out = self.runner(inputs, self.kv.longest(slots) + 1)
        self.kv.advance_host(slots)
        return out["frame"], out["next_code"]

    def _step(self, inputs: dict[str, torch.Tensor], attend: int) -> dict[str, torch.Tensor]:
        active, text_token, text_kind = inputs["active"], inputs["text_token"], inputs["text_kind"]
        batch = active.shape[0]
        rows = self._rows[:batch]
        first = self.next_code[:batch]
        # The code predictor reads [hidden, embedding of code 0], then each code it draws; every
        # row is at the same group at the same time. Active rows restart their predictor slot.
        lengths = self.predictor.lengths[:batch]
        lengths.copy_(torch.where(active, 0, lengths))
        predictor = self.talker.code_predictor
        groups = self._group_positions
        ropes, span = self._group_ropes, self.num_groups + 1
        self.predictor.step(self.hidden[:batch], groups[0].expand(batch), active, span, ropes[0])
        x = self.talker.get_input_embeddings()(first)
        codes, total = [first], x
        uniforms = self.predictor_sampling.uniforms(batch, self.num_groups - 1, PREDICTOR_STREAM)
        for group in range(self.num_groups - 1):
            out = self.predictor.step(x, groups[group + 1].expand(batch), active, span, ropes[group + 1])
            picked = self.predictor_sampling.draw_with(predictor.lm_head[group](out), uniforms[:, group])
            codes.append(picked)
            x = predictor.model.codec_embedding[group](picked)
            total = total + x
        self.predictor_sampling.advance(active)
        frames = self.frames[:batch]
        frames.copy_(torch.stack(codes, dim=1))
        # The next talker input: the frame's codec embeddings plus the trailing text.
        token_text = self.talker.text_projection(self.thinker_embed(text_token))
        header = self.header[rows, text_token.clamp(0, HEADER_MAX - 1)]
        kind = text_kind.view(batch, 1)
        trailing = torch.where(
            kind == TEXT_TOKEN,
            token_text.to(total.dtype),
            torch.where(
                kind == TEXT_EOS,
                self.tts_eos.to(total.dtype),
                torch.where(kind == TEXT_PAD, self.tts_pad.to(total.dtype), header.to(total.dtype)),
            ),
        )
        hidden = self.kv.step(total + trailing, self.position[:batch], active, attend)
        code = self._choose(self.talker.codec_head(hidden), 0, batch)
        seen = self.seen[:batch]
        seen[rows, code] = seen[rows, code] | active
        self.hidden[:batch] = torch.where(active.view(batch, 1), hidden, self.hidden[:batch])
        next_code = self.next_code[:batch]
        next_code.copy_(torch.where(active, code, first))
        self.position[:batch] += active.long()
        self.sampling.advance(active)
        return {"frame": frames, "next_code": next_code}
