"""The turn-based speech pipeline of Qwen3-Omni: thinker -> talker (+ code predictor) -> code2wav.

One :meth:`SpeechPipeline.step` is one scheduler tick for every admitted request:

1. the prefill of each new request (:mod:`.prefill`): the thinker's prompt pass (audio and
   vision encoders, then the layers in static-length pieces, :mod:`.thinker`) that draws the
   first reply token, then the talker's prompt pass that draws the first codec code. Both read
   only what follows the longest prefix a slot already holds (the conversation's previous
   prompt and reply, another response's prompt over the same context), copied into the
   request's slots first (:mod:`.prefix_cache`). Inline,
   each tick one piece (``prefill_chunk`` tokens of a pass) of each of the
   ``prefills_per_step`` prompts with the fewest pieces left, so a long prompt takes several
   ticks, never stalls the others for more than a piece, and never holds up a short turn; or
   with ``prefill_worker=True`` whole on a thread and CUDA stream of their own, beside the
   decode steps, which never wait for them. The tick that finds a prefill done loads it into
   the request's slots;
2. one batched thinker decode token for every prefilled request still generating text, the
   ones prefilled in this tick included (so a new turn's talker takes its first step, which
   needs reply token 1, in the tick of its prefill: first audio one tick sooner);
3. one copy of the new tokens to the host; then one batched talker frame step
   (:mod:`.talker`: code predictor for the pending frame, talker decode, next group-0 code)
   for every request whose next text input is known;
4. while the GPU runs the talker: detokenising, stop strings and tool calls (:mod:`.text_out`),
   the next allowed-token masks of constrained replies (:mod:`.constrain`); then one copy of the
   frames to the host, one batched code2wav step, and the audio chunks due.

Tools and constrained decoding. A request's ``tools`` are rendered into the prompt by the chat
template; when it declares tools, its reply is split on the ``<tool_call>`` / ``</tool_call>``
tokens (:mod:`.tool_calls`): the text outside call blocks goes out as :class:`TextDelta` and is
spoken; a block is held back, never reaches the talker, and once closed goes out as one
:class:`ToolCall` (or as text when it does not parse as a call of a declared function). With
``tool_choice`` ``required`` or a named function the reply is calls only, so it has no audio.
``required``, a named function, ``none`` and ``response_format`` constrain the thinker's draws
(:mod:`.constrain`): the grammar is compiled in ``prepare``, the first token is drawn under its
mask in the prompt pass, and from then on the matcher advances with each drawn token and writes
the next mask into the slot's row (:class:`~.token_masks.SlotMasks`) while the GPU runs the
talker; a constrained request therefore decodes its second token one tick after its prefill.

The decode steps (thinker, talker frame with its code-predictor loop and sampling) run over
preallocated per-slot device state with an exec mask, rows being slots, so on CUDA they replay
CUDA graphs captured at start-up (:meth:`capture`), one per batch bucket and attention-length
bucket, as do the prompt pieces (per piece-length or attention-length bucket) and code2wav;
``cuda_graphs=False`` (``omnirt serve --no-cuda-graphs``) runs every step eagerly.
A request holds one slot, the same in every pool (and one code2wav stream), from ``add`` until it
finishes or is removed; the lowest free slot is taken, so the busy slots stay packed low. Held
(its client behind reading), it moves to a free slot above the others and back down once
released (:meth:`.reading.PromptReader.repack`), so a held request never widens the others' steps.
``prepare`` (validation, the prompt's tokens and audio / image features) runs before ``add``, on
the engine's prompt threads.

The result equals ``Qwen3OmniMoeForConditionalGeneration.generate`` (tests/speech/test_parity.py)
except where ``generate`` is wrong for streaming: when the thinker stops on its token budget,
``generate`` never feeds the talker the last reply token (it only has input embeddings of fed
tokens); here the talker speaks the whole reply. With greedy decoding the talker is greedy too;
with sampling it uses ``generate``'s talker defaults (temperature 0.9, top-k 50, repetition
penalty 1.05) and the code predictor top-k 50 / top-p 0.8, drawn from counter-based randomness
keyed by the request's seed (:mod:`.draws`), so a seed gives the same reply whatever the batch.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from omnirt.codecs.audio import float_to_int16

from ..draws import fresh_seed
from ..graphs import batch_buckets, prewarm
from ..pipeline import CallCounter, PhaseTimes, Priority, RequestRejected, StepTimer
from ..prompt_size import max_prompt_chars, prompt_chars, too_long_message
from ..truncation import answers_before, conversation_budget, first_kept, reply_room, split_head
from ..types import (
    SAMPLE_RATE,
    AudioDelta,
    ContextMessage,
    Finished,
    GenerationRequest,
    ModelInfo,
    NamedTool,
    Output,
    Started,
    TextPart,
    ToolSpec,
    Truncation,
    Usage,
)
from .code2wav import Vocoder, make_vocoder
from .constrain import Constrainer, GrammarConstraint, ReplyConstraint
from .prefill import Prefilled
from .prompt import PromptBuilder, PromptInputs
from .reading import PromptReader
from .talker import (
    TEXT_EOS,
    TEXT_HEADER,
    TEXT_PAD,
    TEXT_TOKEN,
    Talker,
    TalkerState,
)
from .text_out import TextOut
from .thinker import Thinker
from .tool_calls import CallSplitter, Piece
from .turn import Turn

log = logging.getLogger(__name__)

#: Seconds from a spoken reply's request by which its first audio is due while batch work
#: (diffusion) waits: the server's default (``--first-audio-target``).
FIRST_AUDIO_TARGET = 0.25
#: Ticks from admission to first audio assumed before any was measured.
FIRST_AUDIO_TICKS = 4.0
#: Ticks in a row a prompt may wait for frames that are due (:meth:`SpeechPipeline._tick_kind`).
MAX_PROMPT_DEFERRALS = 4


@dataclass(frozen=True)
class SpeechPrompt:
    """What :meth:`SpeechPipeline.prepare` makes of a request, off the engine thread."""

    prompt: PromptInputs
    speaker_id: int  # -1 without audio output
    max_tokens: int
    #: What the reply's tokens are constrained to (None: nothing).
    constraint: ReplyConstraint | None = None
    #: The reply is spoken (audio requested, and the reply is not calls only).
    speak: bool = True


class SpeechPipeline:
    """Implements :class:`~omnirt.stages.pipeline.Pipeline` for ``Qwen3OmniMoeForConditionalGeneration``."""

    kind = "speech"
    priority = Priority.REALTIME
    #: Audio may be made ahead of playback: see :meth:`next_deadline`.
    runs_early = True

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
        prefill_chunk: int = 512,
        long_prefill_wait: int = 8,
        audio_frames_per_token: float = 12.0,
        audio_frames_base: int = 25,
        stop_token_ids: set[int] | None = None,
        talker_repetition_penalty: float = 1.05,
        vocoder: str | Vocoder = "auto",
        cuda_graphs: bool = True,
        prefill_worker: bool = False,
        prefix_cache: bool = True,
        tool_call_budget: int = 1024,
        playback_margin: float = 0.15,
        first_audio_target: float | None = FIRST_AUDIO_TARGET,
        prompt_ticks: bool = True,
    ) -> None:
        self.model = model
        self.prompts = prompts
        self.tokenizer = prompts.tokenizer
        self.info = info
        self.max_slots = max_slots
        self.max_context = max_context
        self.max_audio_frames = max_audio_frames
        #: Once the text is complete, speech stops after ``base + per_token * reply tokens`` frames
        #: even without the talker's end code (a runaway talker, or random demo weights).
        self.audio_frames_per_token = audio_frames_per_token
        self.audio_frames_base = audio_frames_base
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        cfg = model.config
        self.stop_token_ids = stop_token_ids if stop_token_ids is not None else {int(cfg.im_end_token_id)}
        self.vocab_limit = min(len(self.tokenizer), int(cfg.thinker_config.text_config.vocab_size))
        #: Tool choices and response formats -> constraints (``prepare``); ``tool_call_budget``
        #: caps the tokens of a reply that must be calls.
        self.constrainer = Constrainer(
            self.tokenizer,
            vocab_size=int(model.thinker.lm_head.out_features),
            vocab_limit=self.vocab_limit,
            stop_ids=self.stop_token_ids,
            tool_call_budget=tool_call_budget,
        )
        graphs = cuda_graphs and self.device.type == "cuda"
        self._buckets = buckets = batch_buckets(max_slots)
        pool = torch.cuda.graph_pool_handle() if graphs else None
        self.has_talker = bool(getattr(model, "has_talker", False))
        self.thinker = Thinker(
            model,
            max_slots=max_slots,
            max_len=max_context,
            batch_buckets=buckets,
            graphs=graphs,
            pool=pool,
            accept_layer=int(cfg.talker_config.accept_hidden_layer) if self.has_talker else 0,
            prompt_chunk=prefill_chunk,
        )
        if self.has_talker:
            self.talker = Talker(
                model,
                max_slots=max_slots,
                max_len=max_context + max_audio_frames + 16,  # + the nine assistant-header positions
                max_prompt=max_context + 16,
                batch_buckets=buckets,
                graphs=graphs,
                pool=pool,
                repetition_penalty=talker_repetition_penalty,
                prompt_chunk=prefill_chunk,
            )
            self.vocoder: Vocoder = (
                make_vocoder(
                    model.code2wav, vocoder, max_streams=max_slots, graphs=cuda_graphs, buckets=buckets
                )
                if isinstance(vocoder, str)
                else vocoder
            )
            self.speakers = {k.lower(): int(v) for k, v in (cfg.talker_config.speaker_id or {}).items()}
        #: Called with (request_id, token_id) for every thinker token drawn (tests, tracing).
        self.token_observer: Callable[[str, int], None] | None = None
        self._active: dict[str, Turn] = {}
        #: Rows of each batched model call (``calls[name, rows]``), read by the engine's stats.
        self.calls: CallCounter = collections.Counter()
        # Prompts are read inline, up to ``prefills_per_step`` per tick, or with
        # ``prefill_worker`` on a thread (and CUDA stream) beside the decode steps. Off by default:
        # prefill is Python-bound (eager encoders), and on the H200 the worker thread and the
        # engine thread starved each other of the GIL (docs/benchmarks.md).
        self.reader = PromptReader(
            model,
            self.thinker,
            self.talker if self.has_talker else None,
            self.calls,
            max_slots=max_slots,
            prefix_cache=prefix_cache,
            prefills_per_step=prefills_per_step,
            long_prefill_wait=long_prefill_wait,
            worker=prefill_worker,
        )
        #: Prompt tokens ``read`` and ``cached`` (a reused prefix), read by the engine's stats.
        self.prompt_tokens = self.reader.prompt_tokens
        self._retired: list[Prefilled] = []
        self.step_timer = StepTimer()
        #: Host time of the steps by phase (prompts, thinker, tokens, talker, text, frames, audio).
        self.phases = PhaseTimes()
        #: Seconds of audio kept ahead of playback beyond one tick (network and clock jitter).
        self.playback_margin = playback_margin
        if first_audio_target is not None and not 0 <= first_audio_target <= 60:
            raise ValueError(f"first_audio_target must be from 0 to 60 seconds, got {first_audio_target}")
        #: Seconds from a spoken reply's request by which its first audio is due while batch work
        #: waits (None: at once, every other tick; see :meth:`next_deadline`).
        self.first_audio_target = first_audio_target
        #: Ticks from admission to first audio (moving average): how many a waiting reply still needs.
        self.first_audio_ticks = StepTimer()
        #: Inline prompt passes in ticks of their own while other replies make frames
        #: (:meth:`_tick_kind`): on CUDA a frame step is a few graph replays and a prompt pass in
        #: it would double it. On by default (``omnirt serve --no-prompt-ticks``: in the frame
        #: ticks); beside diffusion on an H200 it kept the frame p99 within 10% of speech alone,
        #: with no audio late (docs/benchmarks.md, issue 10).
        self.prompt_ticks = prompt_ticks
        #: Seconds of a tick that reads prompts only (moving average).
        self.prompt_timer = StepTimer()
        #: Ticks in a row that left the prompts waiting for frames that were due, and when the
        #: first of them began (the prompts are due since).
        self._prompts_deferred = 0
        self._prompt_due = 0.0

    # -- graphs and warm-up ------------------------------------------------------------------------
    @property
    def runners(self) -> list[Any]:
        """The graphed steps: thinker decode and prompt pieces, the audio encoder, talker frame and
        prompt pieces."""
        runners = [self.thinker.runner, *self.thinker.prompt.runners]
        if self.thinker.audio is not None:
            runners.append(self.thinker.audio.runner)
        if self.has_talker:
            runners += [self.talker.runner, *self.talker.prompt.runners]
        return runners

    def capture(self, compile_workers: int = 0) -> float:
        """Captures the CUDA graphs of every step (decode steps per batch and length bucket,
        prompt passes per length bucket; the vocoder captures its own when built); returns the
        seconds it took. Does nothing off CUDA or with graphs off. Needs an idle pipeline:
        capturing a prompt pass writes into slot 0's cache (the loader captures at start-up).
        ``compile_workers`` >= 2: every step's first calls made on that many threads before the
        captures (:func:`~omnirt.stages.graphs.prewarm`)."""
        if self._active:
            raise RuntimeError("capture() needs an idle pipeline")
        t0 = time.perf_counter()
        prewarm(self.runners, compile_workers)
        for runner in self.runners:
            runner.capture()
        seconds = time.perf_counter() - t0
        graphs = sum(r.graphs for r in self.runners)
        if graphs:
            log.info("captured %d CUDA graphs of the speech steps in %.1f s", graphs, seconds)
        return seconds

    def use_graphs(self, enabled: bool) -> None:
        """Switches the graphs of the thinker and talker steps and prompt passes on or off (off:
        they run eagerly). The vocoder's graphs follow ``cuda_graphs`` at construction."""
        for runner in self.runners:
            runner.enabled = enabled

    def use_prefix_cache(self, enabled: bool) -> None:
        """Switches the prompt prefix cache on or off (off: every prompt read whole, and the
        prefixes held so far forgotten)."""
        self.reader.use_prefix_cache(enabled)

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
    @property
    def free_slots(self) -> int:
        return len(self.reader.slots)

    def can_add(self) -> bool:
        return bool(self.reader.slots)

    def has_work(self) -> bool:
        return any(not a.held for a in self._active.values())

    def hold(self, request_id: str, held: bool) -> None:
        """Hold (or release) a request: while held its rows take no thinker or talker steps (a
        prefill under way still lands); its reply goes on unchanged once released."""
        active = self._active.get(request_id)
        if active is not None:
            active.held = held
            self.reader.repack(active)

    def accepts(self, request: object) -> bool:
        return isinstance(request, GenerationRequest)

    def next_deadline(self) -> float | None:
        """When the next tick must start, so that no reply's audio runs dry and each spoken
        reply's first audio comes within ``first_audio_target`` of when it was asked for
        (``request.asked_at``: waiting for a slot, or for the tick that admits it, counts):

        - a playing reply plays at real time from its first audio on, so the audio sent so far
          lasts until ``audio_started + audio_seconds``; the tick must begin ``step_cost() +
          playback_margin`` before that;
        - a spoken reply not playing yet is due at once until its first tick (its prompt is read
          at once), then ``(left + 1) * step_cost()`` before ``asked_at + first_audio_target``,
          where ``left`` is how many ticks its first audio still needs (the moving average of
          ticks from admission to first audio, at least one) and one more is a margin;
        - a text-only reply, or a spoken one while ``first_audio_target`` is None: no deadline
          (None: at once; the scheduler then runs a batch step between two ticks).

        The earliest of these; None as soon as one reply asks for at once, or when every reply's
        audio is made (finish them now); already passed when the last tick left a prompt waiting
        for frames that were due (:meth:`_tick_kind`: it is read in the time they made). Held
        replies are ignored. The pipeline ``runs_early``: with no batch work waiting the
        scheduler steps it at once, so replies come as fast as the model can make them; the
        deadlines only say how long batch work may hold it back."""
        # A prompt left waiting for the frames is read at once after them: due since then.
        earliest = self._prompt_due if self._prompts_deferred else math.inf
        cost = self.step_timer.seconds
        for a in self._active.values():
            if a.held:
                continue
            t = a.talker
            if t is None:
                return None
            if a.audio_started is None:
                if self.first_audio_target is None:
                    return None
                if not a.ticks:
                    earliest = min(earliest, a.admitted)
                    continue
                expected = self.first_audio_ticks.seconds or FIRST_AUDIO_TICKS
                left = max(1.0, expected - a.ticks) + 1  # a tick more: the prompt ticks cost more
                earliest = min(earliest, a.request.asked_at + self.first_audio_target - left * cost)
            elif not t.done:
                earliest = min(earliest, a.audio_started + a.audio_seconds - cost - self.playback_margin)
        return None if earliest == math.inf else earliest

    def step_cost(self) -> float:
        return self.step_timer.seconds

    def prepare(self, request: GenerationRequest) -> SpeechPrompt:
        """Validation, the prompt's tokens and audio / image features, the voice, the reply's
        constraint (tools, tool choice, response format: the grammar compiled) (any thread)."""
        if request.temperature < 0 or not 0 < request.top_p <= 1:
            raise RequestRejected("temperature must be >= 0 and top_p in (0, 1]")
        if request.max_output_tokens is not None and request.max_output_tokens < 1:
            raise RequestRejected("max_output_tokens must be at least 1")
        speaker_id = self._speaker(request) if request.output_audio else -1
        truncation = request.truncation
        messages, dropped = request.messages, 0
        if truncation is not None:  # megabytes of old text are left out before tokenising
            messages, dropped = self._left_out_by_characters(messages, request.tools)
        # Refuse a prompt that cannot fit before tokenising it (seconds under the GIL for megabytes).
        too_long = too_long_message(prompt_chars(messages, request.tools), self.max_context)
        if too_long is not None:
            raise RequestRejected(too_long)
        prompt = self.prompts.build(messages, request.tools)
        if truncation is not None:
            kept, more = self._left_out_by_tokens(request, truncation, messages, prompt.length)
            if more:
                prompt = self.prompts.build(kept, request.tools)
                dropped += more
        prompt.dropped = dropped
        if prompt.length >= self.max_context:
            raise RequestRejected(
                f"the prompt is {prompt.length} tokens; this model's context is {self.max_context} tokens"
            )
        room = self.max_context - prompt.length
        constraint, max_tokens = self.constrainer.plan(request, min(room, request.max_output_tokens or room))
        calls_only = request.tool_choice == "required" or isinstance(request.tool_choice, NamedTool)
        speak = request.output_audio and not calls_only
        return SpeechPrompt(prompt, speaker_id, max_tokens, constraint, speak)

    def _left_out_by_characters(
        self, messages: list[ContextMessage], tools: list[ToolSpec]
    ) -> tuple[list[ContextMessage], int]:
        """A truncation's first pass (:class:`~omnirt.stages.types.Truncation`): the oldest messages
        left out until the rest is within the bound on characters that needs no tokenizer
        (:mod:`~omnirt.stages.prompt_size`); and how many. Most prompts are far under it."""
        head, conversation = split_head(messages)
        sizes = [prompt_chars([m]) for m in conversation]
        held = list(itertools.accumulate(reversed(sizes), initial=0))[::-1]  # from message k on
        room = max_prompt_chars(self.max_context) - prompt_chars(head, tools)
        start = first_kept(len(conversation), held.__getitem__, room, 1.0, answers_before(conversation))
        if not start:  # fits, or its last message alone does not: refused as it is
            return messages, 0
        return head + conversation[start:], start

    def _left_out_by_tokens(
        self, request: GenerationRequest, truncation: Truncation, messages: list[ContextMessage], length: int
    ) -> tuple[list[ContextMessage], int]:
        """A truncation's second pass: ``messages`` (whose prompt is ``length`` tokens) less the oldest
        the rule leaves out, and how many. A prompt that fits costs nothing more (with
        ``post_instructions``, a rendering of the head alone); one that does not, a rendering (no
        audio or image features) per bisection step."""
        room = reply_room(self.max_context, request.max_output_tokens)
        if truncation.post_instructions is None and length <= self.max_context - room:
            return messages, 0  # fits: the common case, no more rendering
        head, conversation = split_head(messages)
        tools = request.tools
        # The head's tokens with the reply's header (no instructions: an empty system message
        # stands for the header and the tools, a few tokens over).
        head_tokens = self.prompts.length(head or [ContextMessage("system", (TextPart(""),))], tools)
        available = self.max_context - room - head_tokens
        budget = conversation_budget(truncation, available)
        if length - head_tokens <= budget or budget <= 0:
            return messages, 0  # fits (or cannot: refused below when over the context)

        def held(k: int) -> int:
            whole = length if k == 0 else self.prompts.length(head + conversation[k:], tools)
            return whole - head_tokens

        start = first_kept(
            len(conversation), held, budget, truncation.retention_ratio, answers_before(conversation)
        )
        if not start:
            return messages, 0
        log.info(
            "%s: truncation leaves out the oldest %d of %d messages (the conversation may hold %d tokens)",
            request.request_id, start, len(conversation), budget,
        )
        return head + conversation[start:], start

    def add(self, request: GenerationRequest, prepared: SpeechPrompt | None = None) -> None:
        """Takes a slot; ``prepared`` defaults to ``self.prepare(request)``, run here."""
        if request.request_id in self._active:
            raise RequestRejected(f"request id {request.request_id!r} is already active")
        if not self.reader.slots:
            raise RequestRejected("no free slot")
        if prepared is None:
            prepared = self.prepare(request)
        prompt, speaker_id, max_tokens = prepared.prompt, prepared.speaker_id, prepared.max_tokens
        speak = prepared.speak
        usage = Usage(
            input_text_tokens=prompt.text_tokens,
            input_audio_tokens=prompt.audio_tokens,
            input_image_tokens=prompt.image_tokens,
        )
        slot = self.reader.slots.take()
        seed = fresh_seed(request.seed)
        self.thinker.sampling.set(
            slot, temperature=request.temperature, top_k=0, top_p=request.top_p, seed=seed
        )
        tags = self.constrainer.tags if request.tools else None
        active = Turn(
            request=request,
            slot=slot,
            prompt=prompt,
            usage=usage,
            max_tokens=max_tokens,
            text=TextOut(
                self.tokenizer,
                vocab_limit=self.vocab_limit,
                stops=request.stop,
                tool_names=[t.name for t in request.tools] if tags else (),
            ),
            constraint=prepared.constraint,
            splitter=CallSplitter(tags) if tags else None,
        )
        if prepared.constraint is not None:
            self.thinker.masks.set(slot, prepared.constraint.first)
        if speak:
            self.talker.set_sampling(slot, sample=request.temperature > 0, seed=seed)
            active.talker = TalkerState(prompt=None, speaker_id=speaker_id, max_frames=self.max_audio_frames)
        self._active[request.request_id] = active
        if speak:
            try:
                self.vocoder.open(request.request_id)
            except ValueError as exc:
                self.remove(request.request_id)
                raise RequestRejected(f"no free audio stream: {exc}") from None

    def remove(self, request_id: str) -> Usage | None:
        active = self._active.pop(request_id, None)
        if active is None:
            return None
        if active.job is not None:
            active.job.cancel()  # if it has not started; a running one's result is dropped
        self._release(active)
        return active.usage

    @torch.no_grad()
    def step(self) -> list[tuple[str, Output]]:
        t0 = time.perf_counter()
        phase = self.phases.begin
        phase("prompts")
        out: list[tuple[str, Output]] = []
        kind = self._tick_kind()
        for a in self._active.values():
            a.ticks += not a.held
        self._retired.clear()  # prefill results the last tick loaded: its sync has passed
        # 1. start new prompts' prefills, load the finished ones; 2. a thinker token for every
        # prefilled request, the new ones included (their first token is fed at once, so their
        # talker can take its first step in this tick), unless this tick reads prompts only.
        busy = any(a.prefilled and not a.thinker_done and not a.held for a in self._active.values())
        first_tokens, read = self._take_prefills(out, idle=not busy) if kind != "frames" else ([], 0)
        prompts_only = kind == "prompts" and bool(read or first_tokens)
        phase("thinker")
        # A grammar's next mask needs the first token on the host: those rows decode next tick.
        waiting = {id(a) for a, _ in first_tokens if isinstance(a.constraint, GrammarConstraint)}
        decoding = [
            a
            for a in self._active.values()
            if a.prefilled and not a.thinker_done and not a.held and id(a) not in waiting
        ] if not prompts_only else []
        tokens = None
        if decoding:
            tokens = self._batched(decoding, out, "thinker decode", self._thinker_step)
        phase("tokens")
        # 3. the new tokens on the host (one sync), with the first code each new talker drew
        # (its prompt pass's: it may be the end of speech), then the talker.
        drawn: list[tuple[Turn, int]] = []
        if first_tokens or tokens is not None:
            parts = [torch.stack([t for _, t in first_tokens])] if first_tokens else []
            parts += [tokens] if tokens is not None else []
            talkers = [a for a, _ in first_tokens if a.talker is not None]
            if talkers:
                parts.append(self.talker.next_code[[a.slot for a in talkers]].to(parts[0].dtype))
            host = torch.cat(parts).tolist()
            drawn += [(a, v) for (a, _), v in zip(first_tokens, host, strict=False)]
            if tokens is not None:
                drawn += [(a, host[len(first_tokens) + a.slot]) for a in decoding]
            for a, code in zip(talkers, host[len(host) - len(talkers) :], strict=True):
                assert a.talker is not None
                a.talker.next_code = code
                self._check_code(a)
        texts = []
        for a, tok in drawn:  # a new request's first token before its second
            if a.request.request_id in self._active and not a.thinker_done:
                texts.append((a, tok, self._take_token(a, tok, out)))
        phase("talker")
        frames = None
        talking: list[Turn] = []
        if self.has_talker and not prompts_only:
            talking = [a for a in self._active.values() if self._talker_ready(a)]
            if talking:
                frames = self._batched(talking, out, "talker step", self._talker_step)
        phase("text")
        # 4. while the GPU runs the talker: text out, the next masks of constrained rows; then audio.
        for active, token, piece in texts:
            if piece is not None:
                self._send_text(active, token, piece, out)
        for active in {id(a): a for a, _, _ in texts}.values():
            if isinstance(active.constraint, GrammarConstraint) and not active.thinker_done:
                self._guard(active, out, self._next_mask, active)
        if self.has_talker and not prompts_only:
            phase("frames")
            self._take_frames(talking if frames is not None else [])
            phase("audio")
            self._emit_audio(out)
        phase("finish")
        for active in list(self._active.values()):
            if active.thinker_done and (active.talker is None or active.talker.done):
                self._finish(active, out)
        self.phases.end()
        (self.prompt_timer if prompts_only else self.step_timer).record(time.perf_counter() - t0)
        return out

    def _tick_kind(self) -> str:
        """What this tick does: ``"both"`` (read prompts, then a frame for every reply),
        ``"prompts"`` (read prompts only) or ``"frames"`` (leave the prompts for the next tick).

        Inline (``prompt_ticks``), a prompt pass costs a few frame steps; in the tick of the
        frames it would delay every other reply's frame by that much. So while other replies
        are under way a tick reads prompts only, where their audio lasts until the prompt tick
        (``prompt_timer``) has ended and their next frame step is due (:meth:`next_deadline`);
        otherwise it makes their frames first and reads the prompts at once after them (at most
        ``MAX_PROMPT_DEFERRALS`` ticks in a row). With nothing else under way, or on the prefill
        worker (prompts beside the steps), both in one tick."""
        active = self._active.values()
        if not self.prompt_ticks or self.reader.prefiller.worker is not None:
            return "both"
        if all(a.prefilled for a in active):
            self._prompts_deferred = 0
            return "both"
        others = [
            a
            for a in active
            if a.prefilled and not a.held and not (a.thinker_done and (a.talker is None or a.talker.done))
        ]
        if not others:
            return "both"
        dry = [
            a.audio_started + a.audio_seconds
            for a in others
            if a.audio_started is not None and a.talker is not None and not a.talker.done
        ]
        due = min(dry, default=math.inf) - self.step_timer.seconds - self.playback_margin
        fits = time.monotonic() + self.prompt_timer.seconds <= due
        if fits or self._prompts_deferred >= MAX_PROMPT_DEFERRALS:
            self._prompts_deferred = 0
            return "prompts"
        if not self._prompts_deferred:
            self._prompt_due = time.monotonic()
        self._prompts_deferred += 1
        return "frames"

    def _batched(self, rows: list[Turn], out: list[tuple[str, Output]], what: str, fn: Any) -> Any:
        """Runs one batched step; a failure fails its rows, not the engine."""
        try:
            return fn(rows, self._bucket(max(a.slot for a in rows) + 1))
        except Exception as exc:
            log.exception("%s failed", what)
            for a in rows:
                self._fail(a, out, f"internal error: {exc}")
            return None

    def _bucket(self, rows: int) -> int:
        """The batch a step runs at: the smallest bucket holding ``rows`` slots. Graphs or not,
        so eager steps compute exactly what the graphs replay (same shapes, same kernels)."""
        return next(b for b in self._buckets if b >= rows)

    # -- thinker ------------------------------------------------------------------------------------
    def _take_prefills(
        self, out: list[tuple[str, Output]], idle: bool
    ) -> tuple[list[tuple[Turn, torch.Tensor]], int]:
        """Starts the prefill of every new request (after the prefix it reuses, copied into its
        slots) and loads those that are done; returns their first tokens (on the device).
        Inline (the default), the ``prefills_per_step`` prompts with the fewest pieces left each
        read one piece here (``prefill_chunk`` tokens of a pass; a short prompt's two passes in
        one tick); on the prefill worker they run whole beside the decode steps, which never
        wait for them, except on a tick with nothing else to do. Also returns how many prompts
        read a piece in this tick (inline)."""
        for active in self._active.values():
            if active.job is None:
                self.reader.start(active, self._active.values())
        pending = [a for a in self._active.values() if a.job is not None and not a.prefilled]
        read = 0
        if self.reader.prefiller.worker is None:
            reading = [a for a in pending if not a.job.done()]  # type: ignore[union-attr]
            read = self.reader.advance(reading, self._active.values())
        elif idle and pending and not any(a.job.done() for a in pending):  # type: ignore[union-attr]
            futures.wait([a.job.future for a in pending], timeout=0.1, return_when=futures.FIRST_COMPLETED)  # type: ignore[union-attr]
        first = []
        for active in pending:
            if active.job.done():  # type: ignore[union-attr]
                token = self._guard(active, out, self._load_prefill, active, out)
                if token is not None:
                    first.append((active, token))
        return first, read

    def _load_prefill(self, active: Turn, out: list[tuple[str, Output]]) -> torch.Tensor:
        """Loads a finished prefill into the request's slots (engine thread, stream order)."""
        assert active.job is not None
        done = active.job.result()  # re-raises the prefill's error: it fails this request only
        done.wait(self.device)
        self._retired.append(done)  # its tensors stay alive until this tick's sync has passed
        self.thinker.load(active.slot, done.thinker)
        active.prefilled = True
        out.append((active.request.request_id, Started(Usage(**vars(active.usage)), active.prompt.dropped)))
        t = active.talker
        if t is not None:
            assert done.talker is not None
            t.prompt = done.talker_prompt
            self.talker.load(active.slot, done.talker)
            t.started = True
        self.reader.slots.hold(active.slot, self.reader.held(active))
        return done.thinker.token

    def _thinker_step(self, rows: list[Turn], batch: int) -> torch.Tensor:
        self.calls["thinker", len(rows)] += 1
        self.calls["thinker_rows", batch] += 1  # rows computed: the bucket (as duplex's "lm_rows")
        return self.thinker.decode([a.slot for a in rows], batch)

    def _take_token(self, active: Turn, token: int, out: list[tuple[str, Output]]) -> Piece | None:
        """Counts a drawn token; the cheap checks (stop token, length, call tags) that the
        talker's next input depends on; advances the reply's grammar. Returns what the token is
        (text or part of a call) if it is still to be sent."""
        if self.token_observer is not None:
            self.token_observer(active.request.request_id, token)
        active.drawn.append(token)
        if token in self.stop_token_ids:
            self._end_text(active, "stop", out)
            return None
        if isinstance(active.constraint, GrammarConstraint):
            active.constraint.advance(token)
        piece = active.splitter.feed(token) if active.splitter is not None else Piece.TEXT
        index = active.usage.output_text_tokens
        # Calls are not spoken; the first token always reaches the talker (its prefill reads it).
        if piece is Piece.TEXT or index == 0:
            active.reply.append(token)
            active.reply_at.append(index)
        active.spoken += piece is Piece.TEXT
        active.usage.output_text_tokens += 1
        if active.usage.output_text_tokens >= active.max_tokens:  # max_tokens fits the context (add)
            active.thinker_done, active.reason = True, "length"
        return piece

    def _next_mask(self, active: Turn) -> None:
        """The mask of the request's next token, into its slot's host row (uploaded before the
        next thinker step)."""
        assert isinstance(active.constraint, GrammarConstraint)
        remaining = active.max_tokens - active.usage.output_text_tokens - 1
        active.constraint.fill(self.thinker.masks.host[active.slot], remaining)
        self.thinker.masks.changed(active.slot)

    def _send_text(self, active: Turn, token: int, piece: Piece, out: list[tuple[str, Output]]) -> None:
        outputs, stopped = active.text.push(token, piece)
        out.extend((active.request.request_id, o) for o in outputs)
        if stopped:
            self._end_text(active, "stop", out, flush=False)
        elif active.thinker_done:  # the length limit
            self._end_text(active, "length", out)

    def _end_text(
        self, active: Turn, reason: str, out: list[tuple[str, Output]], flush: bool = True
    ) -> None:
        active.thinker_done = True
        active.reason = reason
        out.extend((active.request.request_id, o) for o in active.text.finish(flush=flush))
        t = active.talker
        if t is not None and not active.spoken:
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

    def _text_input(self, active: Turn, index: int) -> tuple[int, int] | None:
        """The talker's text input at assistant-sequence position ``index`` as (kind, value):
        a header position, a reply token, the end of the text, or padding; None when the thinker
        has not got there yet."""
        t = active.talker
        assert t is not None and t.prompt is not None
        header = t.prompt.assistant_embeds.shape[0]
        if index < header:
            return TEXT_HEADER, index - 4
        k = index - header
        if k < len(active.reply):
            return TEXT_TOKEN, active.reply[k]
        if not active.thinker_done:
            return None
        return (TEXT_EOS, 0) if k == len(active.reply) else (TEXT_PAD, 0)

    def _talker_ready(self, active: Turn) -> bool:
        t = active.talker
        if t is None or not t.started or t.done or active.held:
            return False
        return self._text_input(active, 4 + t.step) is not None

    def _talker_step(self, rows: list[Turn], batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls["talker", len(rows)] += 1
        self.calls["talker_rows", batch] += 1
        text = []
        for a in rows:
            assert a.talker is not None
            item = self._text_input(a, 4 + a.talker.step)
            assert item is not None
            text.append(item)
        return self.talker.step([a.slot for a in rows], text, batch)

    def _take_frames(self, stepped_rows: list[Turn]) -> None:
        """Pushes the frames of the rows the talker stepped to the vocoder and reads back every
        started talker's next code."""
        started = [a for a in self._active.values() if a.talker is not None and a.talker.started]
        if not started:
            return
        # One copy (it waits for the talker step): each slot's next group-0 code, then the frame
        # its last step made; a copy, since vocoders may keep the frames.
        host = torch.cat((self.talker.next_code.unsqueeze(1), self.talker.frames), dim=1).cpu()
        next_codes = host[:, 0].tolist()
        stepped = {id(a) for a in stepped_rows}
        for a in started:
            t = a.talker
            assert t is not None
            if id(a) in stepped:
                self.vocoder.push(a.request.request_id, host[a.slot, 1:])
                a.usage.output_audio_tokens += 1
                t.step += 1
                if self.talker.kv.length(a.slot) >= self.talker.kv.max_len:
                    t.done = True
            if not t.done:
                t.next_code = next_codes[a.slot]
                self._check_code(a)

    def _check_code(self, active: Turn) -> None:
        t = active.talker
        assert t is not None
        limit = t.max_frames
        if active.thinker_done:
            budget = self.audio_frames_base + self.audio_frames_per_token * active.spoken
            limit = min(limit, int(budget))
        if t.next_code == self.talker.eos or t.step >= limit:  # one frame per talker step
            t.done = True

    def _text_chars(self, active: Turn, frames: int) -> int:
        """Reply characters whose speech the first ``frames`` frames carry.

        Frame ``f``'s group-0 code is drawn after the talker has read assistant position
        ``3 + f`` (reply token ``3 + f - header``)."""
        t = active.talker
        assert t is not None and t.prompt is not None
        k = 3 + frames - 1 - t.prompt.assistant_embeds.shape[0]
        if 0 <= k < len(active.reply_at):
            k = active.reply_at[k]
        elif k >= len(active.reply_at):  # past the reply: the end of the text, once it is done
            k = len(active.text.chars_after) + k
        return active.text.chars_at(k, active.thinker_done)

    def _emit_audio(self, out: list[tuple[str, Output]]) -> None:
        finishing = {rid for rid, a in self._active.items() if a.talker is not None and a.talker.done}
        for rid, (pcm, frames) in self.vocoder.pull(finishing).items():
            active = self._active.get(rid)
            if active is None or pcm.size == 0:
                continue
            active.audio_frames_sent += frames
            active.audio_seconds += pcm.size / SAMPLE_RATE
            if active.audio_started is None:
                active.audio_started = time.monotonic()
                self.first_audio_ticks.record(active.ticks)
            pcm16 = float_to_int16(pcm)
            chars = self._text_chars(active, active.audio_frames_sent)
            out.append((rid, AudioDelta(pcm16, chars, frames)))

    # -- lifecycle ----------------------------------------------------------------------------------
    def _finish(self, active: Turn, out: list[tuple[str, Output]]) -> None:
        self._end(active, out, Finished(active.reason, active.usage))  # type: ignore[arg-type]

    def _fail(self, active: Turn, out: list[tuple[str, Output]], message: str) -> None:
        self._end(active, out, Finished("error", active.usage, message))

    def _end(self, active: Turn, out: list[tuple[str, Output]], finished: Finished) -> None:
        rid = active.request.request_id
        if self._active.get(rid) is active:  # whoever takes it out of _active frees its slot, once
            del self._active[rid]
            self._release(active, keep=finished.reason != "error")
        out.append((rid, finished))

    def _guard(self, active: Turn, out: list[tuple[str, Output]], fn: Any, *args: Any) -> Any:
        """Runs one request's own work; an error fails that request only."""
        try:
            return fn(*args)
        except RequestRejected as exc:
            self._fail(active, out, str(exc))
        except Exception as exc:
            log.exception("request %s failed", active.request.request_id)
            self._fail(active, out, f"internal error: {exc}")
        return None

    def _release(self, active: Turn, keep: bool = True) -> None:
        """Frees the request's slots; with ``keep`` (not after an error) they hold its prompt and
        reply for later requests (:mod:`.prefix_cache`)."""
        fed = self.thinker.kv.length(active.slot) - active.prompt.length
        held = self.reader.held(active, fed) if keep else None
        if keep and active.job is None:  # never started: what the slot held is still there
            held = self.reader.slots.held.get(active.slot)
        self.thinker.kv.reset(active.slot)
        self.thinker.masks.reset(active.slot)
        if self.has_talker:
            self.talker.kv.reset(active.slot)
            self.vocoder.close(active.request.request_id)
        self.reader.slots.give(active.slot, held)
