"""The turn-based speech pipeline of Qwen3-Omni: thinker -> talker (+ code predictor) -> code2wav.

One :meth:`SpeechPipeline.step` advances every admitted request by one tick:

1. prefill up to ``prefills_per_step`` new requests (one HF thinker forward each, audio and
   vision encoders included), copy their KV into their slot and draw their first token;
2. one batched thinker decode token for every other request still generating text;
3. start the talker of requests whose first reply token is known (one HF talker forward
   each), then one batched talker step for every request whose next text input is known:
   code predictor for the pending frame, talker decode, next group-0 code;
4. one batched code2wav step for the new frames, and the audio chunks that are due.

Thinker, talker and code-predictor decode run :class:`~.slots.SlotDecoder` over the HF layers'
weights with preallocated KV slot pools; a request holds one slot index in every pool (and one
code2wav stream) from ``add`` until it finishes or is removed. ``prepare`` (the prompt's tokens and
audio / image features) runs before, on the engine's prompt threads.

The result equals ``Qwen3OmniMoeForConditionalGeneration.generate`` (tests/speech/test_parity.py)
except where ``generate`` is wrong for streaming: when the thinker stops on its token budget,
``generate`` never feeds the talker the last reply token (it only has input embeddings of fed
tokens); here the talker speaks the whole reply. With greedy decoding the talker is greedy too;
with sampling it uses ``generate``'s talker defaults (temperature 0.9, top-k 50, repetition
penalty 1.05) and the code predictor top-k 50 / top-p 0.8, from the request's seeded generator.
"""

from __future__ import annotations

import collections
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from omnirt.codecs.audio import float_to_int16

from ..pipeline import CallCounter, Priority, RequestRejected, StepTimer
from ..types import AudioDelta, Finished, GenerationRequest, ModelInfo, Output, Started, TextDelta, Usage
from .code2wav import Vocoder, make_vocoder
from .detok import IncrementalDetokenizer
from .hf_compat import output_cache, thinker_rope_index, thinker_text_model
from .prompt import PromptBuilder, PromptInputs
from .sampling import SamplingParams, choose, choose_rows
from .slots import SlotDecoder
from .talker import Talker, TalkerState, build_talker_prompt, talker_rope_index

log = logging.getLogger(__name__)

#: The talker's sampling when the request samples (its generation defaults in ``generate``).
TALKER_SAMPLING = {"temperature": 0.9, "top_k": 50, "top_p": 1.0}
CODE_PREDICTOR_SAMPLING = {"temperature": 1.0, "top_k": 50, "top_p": 0.8}


@dataclass(frozen=True)
class SpeechPrompt:
    """What :meth:`SpeechPipeline.prepare` makes of a request, off the engine thread."""

    prompt: PromptInputs
    speaker_id: int  # -1 without audio output
    max_tokens: int


@dataclass(eq=False)
class _Active:
    request: GenerationRequest
    slot: int
    prompt: PromptInputs
    usage: Usage
    params: SamplingParams
    max_tokens: int
    detok: IncrementalDetokenizer
    prefilled: bool = False
    thinker_done: bool = False
    reason: str = "stop"
    position: int = 0  # RoPE position of the next thinker input
    next_token: int | None = None  # drawn, not yet fed to the thinker
    text_embeds: list[torch.Tensor] = field(default_factory=list)  # thinker input embeddings of the reply
    chars_after: list[int] = field(default_factory=list)  # reply characters sent after each text token
    pending_tokens: int = 0  # tokens counted in no TextDelta yet
    unsent: str = ""  # decoded text held back (it may begin a stop string)
    sent_chars: int = 0
    talker: TalkerState | None = None
    audio_frames_sent: int = 0  # frames whose audio has gone out in AudioDeltas


class SpeechPipeline:
    """Implements :class:`~omnirt.stages.pipeline.Pipeline` for ``Qwen3OmniMoeForConditionalGeneration``."""

    kind = "speech"
    priority = Priority.REALTIME

    def __init__(
        self,
        model: Any,
        prompts: PromptBuilder,
        info: ModelInfo,
        *,
        max_slots: int = 32,
        max_context: int = 4096,
        max_audio_frames: int = 2048,
        prefills_per_step: int = 2,
        audio_frames_per_token: float = 12.0,
        audio_frames_base: int = 25,
        stop_token_ids: set[int] | None = None,
        talker_repetition_penalty: float = 1.05,
        vocoder: str | Vocoder = "auto",
        cuda_graphs: bool = True,
    ) -> None:
        self.model = model
        self.prompts = prompts
        self.tokenizer = prompts.tokenizer
        self.info = info
        self.max_slots = max_slots
        self.max_context = max_context
        self.max_audio_frames = max_audio_frames
        self.prefills_per_step = prefills_per_step
        #: Once the text is complete, speech stops after ``base + per_token * reply tokens`` frames
        #: even without the talker's end code (a runaway talker, or random demo weights).
        self.audio_frames_per_token = audio_frames_per_token
        self.audio_frames_base = audio_frames_base
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        cfg = model.config
        self.stop_token_ids = stop_token_ids if stop_token_ids is not None else {int(cfg.im_end_token_id)}
        thinker_text = thinker_text_model(model.thinker)
        self.thinker = SlotDecoder(
            thinker_text, num_slots=max_slots, max_len=max_context, device=self.device, dtype=self.dtype
        )
        self.embed_tokens = model.thinker.get_input_embeddings()
        self.lm_head = model.thinker.lm_head
        self.vocab_limit = min(len(self.tokenizer), int(cfg.thinker_config.text_config.vocab_size))
        self.has_talker = bool(getattr(model, "has_talker", False))
        if self.has_talker:
            self.talker = Talker(model, max_slots=max_slots, repetition_penalty=talker_repetition_penalty)
            self.talker_decoder = SlotDecoder(
                model.talker.model,
                num_slots=max_slots,
                max_len=max_context + max_audio_frames + 16,  # + the nine assistant-header positions
                device=self.device,
                dtype=self.dtype,
            )
            self.vocoder: Vocoder = (
                make_vocoder(model.code2wav, vocoder, max_streams=max_slots, graphs=cuda_graphs)
                if isinstance(vocoder, str)
                else vocoder
            )
            self.speakers = {k.lower(): int(v) for k, v in (cfg.talker_config.speaker_id or {}).items()}
            self.accept_layer = int(cfg.talker_config.accept_hidden_layer)
        #: Called with (request_id, token_id) for every thinker token drawn (tests, tracing).
        self.token_observer: Callable[[str, int], None] | None = None
        self._free = deque(range(max_slots))
        self._active: dict[str, _Active] = {}
        self.calls: CallCounter = collections.Counter()
        self.step_timer = StepTimer()

    def warm_up(self) -> None:
        """Runs one tiny audio turn end to end (lazy initialisation, allocator warm-up) and
        discards it, so the first real request is as fast as the next."""
        from ..types import AudioPart, ContextMessage, TextPart

        if self._active:
            raise RuntimeError("warm_up() needs an idle pipeline")
        pcm = np.zeros(4800, dtype=np.float32)
        pcm[::97] = 0.1
        parts = (AudioPart(pcm), TextPart("hi"))
        request = GenerationRequest(
            "__warm_up__", [ContextMessage("user", parts)], output_audio=self.has_talker, max_output_tokens=3
        )
        self.add(request)
        for _ in range(64):
            if not self.has_work():
                break
            self.step()
        self.remove(request.request_id)

    # -- Pipeline protocol -----------------------------------------------------------------------
    def can_add(self) -> bool:
        return bool(self._free)

    def has_work(self) -> bool:
        return bool(self._active)

    def accepts(self, request: object) -> bool:
        return isinstance(request, GenerationRequest)

    def next_deadline(self) -> float | None:
        return None  # every tick while it has work

    def step_cost(self) -> float:
        return self.step_timer.seconds

    def prepare(self, request: GenerationRequest) -> SpeechPrompt:
        """Validation, the prompt's tokens and audio / image features, the voice (any thread)."""
        if request.temperature < 0 or not 0 < request.top_p <= 1:
            raise RequestRejected("temperature must be >= 0 and top_p in (0, 1]")
        if request.max_output_tokens is not None and request.max_output_tokens < 1:
            raise RequestRejected("max_output_tokens must be at least 1")
        speaker_id = self._speaker(request) if request.output_audio else -1
        prompt = self.prompts.build(request.messages)
        if prompt.length >= self.max_context:
            raise RequestRejected(
                f"the prompt is {prompt.length} tokens; this model's context is {self.max_context} tokens"
            )
        room = self.max_context - prompt.length
        return SpeechPrompt(prompt, speaker_id, min(room, request.max_output_tokens or room))

    def add(self, request: GenerationRequest, prepared: SpeechPrompt | None = None) -> None:
        """Takes a slot; ``prepared`` defaults to ``self.prepare(request)``, run here."""
        if request.request_id in self._active:
            raise RequestRejected(f"request id {request.request_id!r} is already active")
        if not self._free:
            raise RequestRejected("no free slot")
        if prepared is None:
            prepared = self.prepare(request)
        prompt, speaker_id, max_tokens = prepared.prompt, prepared.speaker_id, prepared.max_tokens
        # On the model's device: torch.multinomial draws from a generator of its tensor's device.
        generator = torch.Generator(device=self.device)
        if request.seed is not None:
            generator.manual_seed(int(request.seed))
        else:
            generator.seed()
        params = SamplingParams(request.temperature, request.top_p, 0, generator)
        usage = Usage(
            input_text_tokens=prompt.text_tokens,
            input_audio_tokens=prompt.audio_tokens,
            input_image_tokens=prompt.image_tokens,
        )
        slot = self._free.popleft()
        active = _Active(
            request=request,
            slot=slot,
            prompt=prompt,
            usage=usage,
            params=params,
            max_tokens=max_tokens,
            detok=IncrementalDetokenizer(self.tokenizer, vocab_limit=self.vocab_limit),
        )
        if request.output_audio:
            if params.greedy:
                talker_params, predictor_params = SamplingParams(), SamplingParams()
            else:
                talker_params = SamplingParams(generator=generator, **TALKER_SAMPLING)
                predictor_params = SamplingParams(generator=generator, **CODE_PREDICTOR_SAMPLING)
            active.talker = TalkerState(
                prompt=None,
                speaker_id=speaker_id,
                params=talker_params,
                max_frames=self.max_audio_frames,
                predictor_params=predictor_params,
            )
        self._active[request.request_id] = active
        if request.output_audio:
            try:
                self.vocoder.open(request.request_id)
            except ValueError as exc:
                self.remove(request.request_id)
                raise RequestRejected(f"no free audio stream: {exc}") from None

    def remove(self, request_id: str) -> Usage | None:
        active = self._active.pop(request_id, None)
        if active is None:
            return None
        self._release(active)
        return active.usage

    @torch.no_grad()
    def step(self) -> list[tuple[str, Output]]:
        t0 = time.perf_counter()
        out: list[tuple[str, Output]] = []
        fresh = [a for a in self._active.values() if not a.prefilled][: self.prefills_per_step]
        for active in fresh:
            self._guard(active, out, self._prefill, active, out)
        decoding = [a for a in self._active.values() if a.prefilled and not a.thinker_done and a not in fresh]
        if decoding:
            self._thinker_step(decoding, out)
        if self.has_talker:
            for active in list(self._active.values()):
                t = active.talker
                if t is not None and not t.started and not t.done and active.prefilled:
                    self._guard(active, out, self._talker_prefill, active)
            ready = [a for a in self._active.values() if self._talker_ready(a)]
            if ready:
                try:
                    self._talker_step(ready)
                except Exception as exc:  # a batch failure fails its rows, not the engine
                    log.exception("talker step failed")
                    for a in ready:
                        self._fail(a, out, f"internal error: {exc}")
            self._emit_audio(out)
        for active in list(self._active.values()):
            if active.thinker_done and (active.talker is None or active.talker.done):
                self._finish(active, out)
        self.step_timer.record(time.perf_counter() - t0)
        return out

    # -- thinker ------------------------------------------------------------------------------------
    def _prefill(self, active: _Active, out: list[tuple[str, Output]]) -> None:
        thinker = self.model.thinker
        p = active.prompt
        ids = p.input_ids.to(self.device)
        mask = torch.ones_like(ids)
        extra = {k: v.to(self.device) for k, v in p.model_kwargs().items()}
        if "input_features" in extra:
            extra["input_features"] = extra["input_features"].to(self.dtype)
        if "pixel_values" in extra:
            extra["pixel_values"] = extra["pixel_values"].to(self.dtype)
        audio_lengths = extra["feature_attention_mask"].sum(-1) if "feature_attention_mask" in extra else None
        positions, _ = thinker_rope_index(thinker)(
            ids, extra.get("image_grid_thw"), None, mask, False, audio_lengths, None
        )
        self.calls["thinker_prefill", 1] += 1
        result = thinker(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            output_hidden_states=active.talker is not None,
            **extra,
        )
        self.thinker.load(active.slot, output_cache(result))
        active.position = int(positions.max()) + 1
        active.prefilled = True
        out.append((active.request.request_id, Started(Usage(**vars(active.usage)))))
        if active.talker is not None:
            hidden = result.hidden_states
            active.talker.prompt = build_talker_prompt(
                self.model, ids[0], hidden[0][0], hidden[self.accept_layer][0]
            )
        token = choose(result.logits[0, -1], active.params)
        self._take_token(active, token, out)

    def _thinker_step(self, rows: list[_Active], out: list[tuple[str, Output]]) -> None:
        tokens = torch.tensor([a.next_token for a in rows], device=self.device)
        slots = torch.tensor([a.slot for a in rows], device=self.device)
        positions = torch.tensor([a.position for a in rows], device=self.device)
        embeds = self.embed_tokens(tokens)
        self.calls["thinker", len(rows)] += 1
        try:
            hidden = self.thinker.step([a.slot for a in rows], embeds, positions, slots)
            logits = self.lm_head(hidden)
        except Exception as exc:  # a batch failure fails its rows, not the engine
            log.exception("thinker decode failed")
            for a in rows:
                self._fail(a, out, f"internal error: {exc}")
            return
        for a, token in zip(rows, choose_rows(logits, [a.params for a in rows]), strict=True):
            a.position += 1
            self._take_token(a, token, out)

    def _take_token(self, active: _Active, token: int, out: list[tuple[str, Output]]) -> None:
        if self.token_observer is not None:
            self.token_observer(active.request.request_id, token)
        if token in self.stop_token_ids:
            self._end_text(active, "stop", out)
            return
        if active.talker is not None:
            active.text_embeds.append(self.embed_tokens.weight[token])
        active.usage.output_text_tokens += 1
        active.pending_tokens += 1
        stopped = self._send_text(active, active.detok.push(token), out)
        active.chars_after.append(active.sent_chars)
        if stopped:
            self._end_text(active, "stop", out, flush=False)
        elif active.usage.output_text_tokens >= active.max_tokens:  # max_tokens fits the context (add)
            self._end_text(active, "length", out)
        else:
            active.next_token = token

    def _send_text(
        self, active: _Active, text: str, out: list[tuple[str, Output]], final: bool = False
    ) -> bool:
        """Sends new reply text, holding back what may start a stop string; True on a stop string."""
        active.unsent += text
        stops = [s for s in active.request.stop if s]
        cut = len(active.unsent)
        found = False
        if stops:
            hits = [i for i in (active.unsent.find(s) for s in stops) if i >= 0]
            if hits:
                cut, found = min(hits), True
            elif not final:
                for k in range(min(len(active.unsent), max(map(len, stops)) - 1), 0, -1):
                    tail = active.unsent[-k:]
                    if any(s.startswith(tail) for s in stops):
                        cut = len(active.unsent) - k
                        break
        send = active.unsent[:cut]
        active.unsent = "" if found else active.unsent[cut:]
        if send:
            out.append((active.request.request_id, TextDelta(send, active.pending_tokens)))
            active.pending_tokens = 0
            active.sent_chars += len(send)
        return found

    def _end_text(
        self, active: _Active, reason: str, out: list[tuple[str, Output]], flush: bool = True
    ) -> None:
        active.thinker_done = True
        active.reason = reason
        active.next_token = None
        if flush:  # not after a stop string: nothing past it is sent
            self._send_text(active, active.detok.flush(), out, final=True)
        if active.chars_after:
            active.chars_after[-1] = active.sent_chars
        t = active.talker
        if t is not None and not t.started and not active.usage.output_text_tokens:
            t.done = True  # nothing to say

    # -- talker -------------------------------------------------------------------------------------
    def _speaker(self, request: GenerationRequest) -> int:
        if not self.has_talker:
            raise RequestRejected("this model has no talker: request text output only (output_audio=false)")
        if request.voice is None:
            return self.speakers.get("ethan", next(iter(self.speakers.values())))
        speaker = self.speakers.get(request.voice.lower())
        if speaker is None:
            raise RequestRejected(
                f"unknown voice {request.voice!r}; voices: {', '.join(sorted(self.speakers))}"
            )
        return speaker

    def _text_input(self, active: _Active, index: int) -> torch.Tensor | str | None:
        """Thinker embedding of assistant-sequence position ``index`` (prompt header, then reply
        tokens); "eos" / "pad" past the reply's end; None when the thinker has not got there yet."""
        t = active.talker
        assert t is not None and t.prompt is not None
        header = t.prompt.assistant_embeds
        if index < header.shape[0]:
            return header[index]
        k = index - header.shape[0]
        if k < len(active.text_embeds):
            return active.text_embeds[k]
        if not active.thinker_done:
            return None
        return "eos" if k == len(active.text_embeds) else "pad"

    def _talker_prefill(self, active: _Active) -> None:
        t = active.talker
        assert t is not None and t.prompt is not None
        first = self._text_input(active, 3)
        if first is None:
            return
        if isinstance(first, str):
            t.done = True
            return
        embeds, ids = self.talker.prefill_inputs(t.prompt, first, t.speaker_id)
        p = active.prompt
        has_mm = p.input_features is not None or p.image_grid_thw is not None
        if has_mm:
            audio_lengths = (
                p.feature_attention_mask.sum(-1).to(self.device) if p.input_features is not None else None
            )
            grid = p.image_grid_thw.to(self.device) if p.image_grid_thw is not None else None
            positions = talker_rope_index(self.model, ids[None], grid, audio_lengths)
        else:
            positions = torch.arange(ids.shape[0], device=self.device).view(1, 1, -1).expand(3, 1, -1)
        self.calls["talker_prefill", 1] += 1
        result = self.model.talker.model(inputs_embeds=embeds[None], position_ids=positions, use_cache=True)
        self.talker_decoder.load(active.slot, output_cache(result))
        t.position = int(positions.max()) + 1
        t.hidden = result.last_hidden_state[0, -1]
        self.talker.reset_seen(active.slot)
        logits = self.model.talker.codec_head(t.hidden)
        slot = torch.tensor([active.slot], device=self.device)
        t.next_code = self.talker.choose_codes(logits[None], slot, [t])[0]
        t.started = True
        self._check_code(active)

    def _check_code(self, active: _Active) -> None:
        t = active.talker
        assert t is not None
        limit = t.max_frames
        if active.thinker_done:
            budget = self.audio_frames_base + self.audio_frames_per_token * active.usage.output_text_tokens
            limit = min(limit, int(budget))
        if t.next_code == self.talker.eos or t.step >= limit:  # one frame per talker step
            t.done = True

    def _talker_ready(self, active: _Active) -> bool:
        t = active.talker
        if t is None or not t.started or t.done:
            return False
        return self._text_input(active, 4 + t.step) is not None

    def _talker_step(self, rows: list[_Active]) -> None:
        self.calls["talker", len(rows)] += 1
        states = [a.talker for a in rows]
        hidden = torch.stack([t.hidden for t in states])  # type: ignore[union-attr, misc]
        first = torch.tensor([t.next_code for t in states], device=self.device)  # type: ignore[union-attr]
        params = [t.predictor_params for t in states]  # type: ignore[union-attr]
        slots = torch.tensor([a.slot for a in rows], device=self.device)
        slot_list = [a.slot for a in rows]
        frames, codec_sum = self.talker.residual_codes(slot_list, slots, hidden, first, params)
        frames = frames.cpu()  # one copy for all rows; the vocoder checks codes on the host
        trailing = torch.empty_like(codec_sum)
        texts: list[torch.Tensor] = []
        text_rows: list[int] = []
        for i, (a, t) in enumerate(zip(rows, states, strict=True)):
            assert t is not None
            self.vocoder.push(a.request.request_id, frames[i])
            a.usage.output_audio_tokens += 1
            item = self._text_input(a, 4 + t.step)
            if isinstance(item, torch.Tensor):
                texts.append(item)
                text_rows.append(i)
            else:
                trailing[i] = self.talker.tts_eos if item == "eos" else self.talker.tts_pad
        if texts:
            trailing[text_rows] = self.talker.text_embeds(torch.stack(texts)).to(trailing.dtype)
        positions = torch.tensor([t.position for t in states], device=self.device)  # type: ignore[union-attr]
        hidden = self.talker_decoder.step(slot_list, codec_sum + trailing, positions, slots)
        logits = self.model.talker.codec_head(hidden)
        codes = self.talker.choose_codes(logits, slots, states)  # type: ignore[arg-type]
        for i, (a, t) in enumerate(zip(rows, states, strict=True)):
            assert t is not None
            t.position += 1
            t.step += 1
            t.hidden = hidden[i]
            t.next_code = codes[i]
            if self.talker_decoder.length(a.slot) >= self.talker_decoder.max_len:
                t.done = True
            self._check_code(a)

    def _text_chars(self, active: _Active, frames: int) -> int:
        """Reply characters whose speech the first ``frames`` frames carry.

        Frame ``f``'s group-0 code is drawn after the talker has read assistant position
        ``3 + f`` (reply token ``3 + f - header``)."""
        t = active.talker
        assert t is not None and t.prompt is not None
        k = 3 + frames - 1 - t.prompt.assistant_embeds.shape[0]
        if k < 0:
            return 0
        if k >= len(active.chars_after):
            return active.sent_chars if active.thinker_done else (active.chars_after or [0])[-1]
        return active.chars_after[k]

    def _emit_audio(self, out: list[tuple[str, Output]]) -> None:
        finishing = {rid for rid, a in self._active.items() if a.talker is not None and a.talker.done}
        for rid, (pcm, frames) in self.vocoder.pull(finishing).items():
            active = self._active.get(rid)
            if active is None or pcm.size == 0:
                continue
            active.audio_frames_sent += frames
            pcm16 = float_to_int16(pcm)
            chars = self._text_chars(active, active.audio_frames_sent)
            out.append((rid, AudioDelta(pcm16, chars, frames)))

    # -- lifecycle ----------------------------------------------------------------------------------
    def _finish(self, active: _Active, out: list[tuple[str, Output]]) -> None:
        self._end(active, out, Finished(active.reason, active.usage))  # type: ignore[arg-type]

    def _fail(self, active: _Active, out: list[tuple[str, Output]], message: str) -> None:
        self._end(active, out, Finished("error", active.usage, message))

    def _end(self, active: _Active, out: list[tuple[str, Output]], finished: Finished) -> None:
        rid = active.request.request_id
        if self._active.get(rid) is active:  # whoever takes it out of _active frees its slot, once
            del self._active[rid]
            self._release(active)
        out.append((rid, finished))

    def _guard(self, active: _Active, out: list[tuple[str, Output]], fn: Any, *args: Any) -> None:
        """Runs one request's own work; an error fails that request only."""
        try:
            fn(*args)
        except RequestRejected as exc:
            self._fail(active, out, str(exc))
        except Exception as exc:
            log.exception("request %s failed", active.request.request_id)
            self._fail(active, out, f"internal error: {exc}")

    def _release(self, active: _Active) -> None:
        self.thinker.reset(active.slot)
        if self.has_talker:
            self.talker_decoder.reset(active.slot)
            self.vocoder.close(active.request.request_id)
        self._free.append(active.slot)
        active.text_embeds.clear()
