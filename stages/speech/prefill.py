"""Reading a new turn's prompt: the thinker's prompt pass (first reply token), the talker prompt
built from it and the talker's prompt pass (first codec code).

A prefill writes only the request's own slot entries, which no decode step touches while the
slot waits, so it can run inline in the ticks (the default) or, with ``worker=True``, on a
thread and CUDA stream of its own beside the decode steps; either way it is a
:class:`PrefillJob` whose result the engine thread loads (``Thinker.load``, ``Talker.load``) in
stream order. Inline, a job advances a piece per tick (:meth:`PrefillJob.advance`): the passes
read their prompts ``prompt_chunk`` tokens at a time (:class:`~.slots.PromptPass`), so a long
prompt is read over several ticks and never stalls the running sessions for more than a piece.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import torch

from ..pipeline import CallCounter, RequestRejected
from .prompt import PromptInputs
from .talker import HEADER_MAX, Talker, TalkerPrefill
from .talker_prompt import TalkerPrompt, TalkerRope, build_talker_prompt
from .thinker import Answer, Call, Thinker, ThinkerPrefill


@dataclass
class Prefilled:
    """What a prefill hands the engine thread."""

    thinker: ThinkerPrefill
    talker_prompt: TalkerPrompt | None
    talker: TalkerPrefill | None
    event: torch.cuda.Event | None  # recorded on the prefill stream after its last kernel

    def wait(self, device: torch.device) -> None:
        """Orders the engine thread's stream after the prefill's kernels."""
        if self.event is not None:
            torch.cuda.current_stream(device).wait_event(self.event)


def _on(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager[Any]:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


class PrefillJob:
    """One prompt's prefill as a sequence of pieces: :func:`advance` runs the next tick's pieces
    of several jobs (on the engine thread, inline), :meth:`run` all of one job's (on the
    worker); :attr:`future` holds the :class:`Prefilled`, or the error that fails this request
    only."""

    def __init__(
        self,
        pieces: Generator[Call | None, Answer | None, Prefilled],
        stream: torch.cuda.Stream | None,
        estimate: int,
    ) -> None:
        self._pieces = pieces
        self._stream = stream
        self.future: futures.Future[Prefilled] = futures.Future()
        #: Advances (ticks) still to run, estimated (the talker's prompt counted as long as the
        #: thinker's): the pipeline reads the prompts with the least left first.
        self.ticks_left = estimate

    def done(self) -> bool:
        return self.future.done()

    def result(self) -> Prefilled:
        return self.future.result()

    def advance(self) -> None:
        """Runs the next tick's pieces; the last one sets the result."""
        advance([self])

    def _resume(self, answer: Answer | None) -> Call | None:
        """Resumes the pieces with ``answer`` (the outputs of the call it asked for: a prompt
        piece, its audio): the next call, or None at the end of its tick (or of the prefill, or
        on an error)."""
        try:
            with torch.no_grad(), _on(self._stream):
                call = self._pieces.send(answer)
        except StopIteration as stop:
            self.future.set_result(stop.value)
            return None
        except Exception as exc:
            self.future.set_exception(exc)
            return None
        if call is None:
            self.ticks_left = max(1, self.ticks_left - 1)
        return call

    def _fail(self, exc: BaseException) -> None:
        self.future.set_exception(exc)
        self._pieces.close()

    def run(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return  # cancelled before it started
        while not self.future.done():
            advance([self])

    def cancel(self) -> None:
        """Drops the pieces not run yet; a job running on the worker runs on, its result dropped."""
        if not self.future.done() and self.future.cancel():
            self._pieces.close()


def advance(
    jobs: Sequence[PrefillJob],
    passed: Callable[[Any, int], None] | None = None,
    order: Sequence[Any] = (),
) -> None:
    """One tick of each of ``jobs``: runs each to the end of its tick, the calls they ask for at
    once run together by their owner: their audio in one batch of windows
    (:meth:`~.audio_encoder.AudioEncoder.execute`), the first pieces of one prompt pass, the
    thinker's or the talker's, in one batched pass that reads the weights once
    (:meth:`~.slots.PromptPass.execute`). ``order``: the owners in the order a prefill calls
    them; a call waits while another job has one for an earlier owner, so a text prompt's
    thinker piece waits for an audio prompt's encoding and joins its pass. ``passed(owner,
    calls)`` is told of each run. A failing run fails the jobs whose calls it ran, not the
    others."""
    rank = {id(owner): k for k, owner in enumerate(order)}
    asked = {job: job._resume(None) for job in jobs if not job.done()}
    while pending := [(job, call) for job, call in asked.items() if call is not None]:
        owner = min((call.owner for _, call in pending), key=lambda o: rank.get(id(o), len(rank)))
        group = [(job, call) for job, call in pending if call.owner is owner]
        for job, _ in group:
            del asked[job]
        try:
            with torch.no_grad(), _on(group[0][0]._stream):
                outs = owner.execute([call for _, call in group])
        except Exception as exc:
            for job, _ in group:
                job._fail(exc)
            continue
        if passed is not None:
            passed(owner, len(group))
        for (job, _), out in zip(group, outs, strict=True):
            asked[job] = job._resume(out)


class Prefiller:
    def __init__(
        self, model: Any, thinker: Thinker, talker: Talker | None, calls: CallCounter, *, worker: bool
    ) -> None:
        self.model = model
        self.thinker = thinker
        self.talker = talker
        self.calls = calls
        self.device = thinker.device
        self.worker = futures.ThreadPoolExecutor(1, thread_name_prefix="omnirt-prefill") if worker else None
        self.stream = torch.cuda.Stream(self.device) if worker and self.device.type == "cuda" else None
        self.talker_rope = TalkerRope(model) if talker is not None else None

    def advance(self, jobs: Sequence[PrefillJob]) -> None:
        """One tick of each of ``jobs`` (:func:`advance`), counting the batched runs by the
        prompts in each in ``calls`` (``audio_encoder``, ``thinker_prompt``, ``talker_prompt``)."""

        owners: list[tuple[Any, str]] = [(self.thinker.prompt, "thinker_prompt")]
        if self.thinker.audio is not None:
            owners.insert(0, (self.thinker.audio, "audio_encoder"))
        if self.talker is not None:
            owners.append((self.talker.prompt, "talker_prompt"))
        names = {id(owner): name for owner, name in owners}

        def passed(owner: Any, calls: int) -> None:
            self.calls[names[id(owner)], calls] += 1

        advance(jobs, passed, [owner for owner, _ in owners])

    def start(
        self,
        slot: int,
        prompt: PromptInputs,
        speaker_id: int | None,
        mask: torch.Tensor | None = None,
        reused: tuple[int, int] = (0, 0),
    ) -> PrefillJob:
        """The prefill of ``prompt`` into ``slot`` (``speaker_id``: the voice, None for text
        only; ``mask``: the first token's allowed-token mask of a constrained reply; ``reused``:
        the thinker positions and talker user positions the slot holds already, a reused
        prefix): inline, a job the pipeline advances a piece per tick; on the worker, queued
        whole."""
        pieces = self.thinker.prompt.pieces(prompt.length, reused[0])
        if speaker_id is not None:  # the talker's, its first piece in the thinker's last tick
            pieces += pieces - 1
        job = PrefillJob(self._pieces(slot, prompt, speaker_id, mask, reused), self.stream, pieces)
        if self.stream is not None:  # after the reused prefix's copy into the slot
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        if self.worker is not None:
            self.worker.submit(job.run)
        return job

    def _pieces(
        self,
        slot: int,
        prompt: PromptInputs,
        speaker_id: int | None,
        mask: torch.Tensor | None,
        reused: tuple[int, int],
    ) -> Generator[Call | None, Answer | None, Prefilled]:
        start, talker_reused = reused
        self.calls["thinker_prefill", 1] += 1
        thinker = yield from self.thinker.forward_prompt(slot, prompt, allowed=mask, start=start)
        talker_prompt = talker = None
        if speaker_id is not None:
            assert self.talker is not None
            accepted = thinker.accepted if thinker.accepted is not None else thinker.embeds[start:]
            talker_prompt = build_talker_prompt(
                self.model, prompt.input_ids[0], thinker.embeds, accepted, start=start, reused=talker_reused
            )
            header = talker_prompt.assistant_embeds
            if header.shape[0] > 4 + HEADER_MAX:
                raise RequestRejected("the prompt's assistant header is too long for the talker")
            # Talker input 3: the header's fourth position, else reply token 0.
            first = header[3] if header.shape[0] > 3 else self.thinker.embed_tokens(thinker.token)
            self.calls["talker_prefill", 1] += 1
            rope = self._rope(prompt)
            talker = yield from self.talker.forward_prompt(slot, talker_prompt, first, speaker_id, rope)
        event = None
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record(self.stream)
        return Prefilled(thinker, talker_prompt, talker, event)

    def _rope(self, prompt: PromptInputs) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The talker prompt's multimodal RoPE index, for prompts with audio or images, computed
        on the host (its ids are host ids: no wait for the GPU)."""
        if prompt.input_features is None and prompt.image_grid_thw is None:
            return None
        audio = prompt.input_features is not None
        audio_lengths = prompt.feature_attention_mask.sum(-1) if audio else None
        grid = prompt.image_grid_thw

        talker_rope = self.talker_rope
        assert talker_rope is not None

        def rope(ids: torch.Tensor) -> torch.Tensor:
            return talker_rope(ids[None], grid, audio_lengths)

        return rope
