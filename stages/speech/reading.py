"""Reading the prompts of new turns, for the speech pipeline's tick: the slots and the prompt
prefixes they keep (:mod:`.prefix_cache`), which prefix a new prompt reuses (copied into its
slots before its prefill starts), the prefills advanced each tick (:mod:`.prefill`), what a slot
keeps once its turn ends, and the slots a held turn moves to.

The pipeline owns the turns (:class:`~.turn.Turn`, by request id) and loads finished prefills;
a :class:`PromptReader` decides, for each tick, what is read and where it goes.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from ..pipeline import CallCounter
from .prefill import Prefiller
from .prefix_cache import Prefix, Reuse, SlotPool, common_prefix
from .talker import Talker
from .talker_prompt import user_positions
from .thinker import Thinker
from .turn import Turn


class PromptReader:
    """The slots of ``max_slots`` turns and the reading of their prompts.

    ``prefix_cache``: a slot keeps what its turn read and fed for later prompts that begin the
    same way (off: every prompt is read whole). Inline (no ``worker``), each tick the
    ``prefills_per_step`` prompts with the fewest pieces left read one piece each; a long prompt
    waits for the latency-critical ticks of other turns at most ``long_prefill_wait`` ticks in a
    row (:meth:`advance`). ``calls`` counts the batched passes and the slot moves."""

    def __init__(
        self,
        model: Any,
        thinker: Thinker,
        talker: Talker | None,
        calls: CallCounter,
        *,
        max_slots: int,
        prefix_cache: bool,
        prefills_per_step: int,
        long_prefill_wait: int,
        worker: bool,
    ) -> None:
        self.model = model
        self.thinker = thinker
        self.talker = talker
        self.calls = calls
        self.prefiller = Prefiller(model, thinker, talker, calls, worker=worker)
        #: Slots, and the prompt prefix each one's caches hold for later requests.
        self.slots = SlotPool(max_slots, self._move_prefix)
        self.prefix_cache = prefix_cache
        self.prefills_per_step = prefills_per_step
        #: Ticks a long prompt may wait in a row for the latency-critical ticks of other turns.
        self.long_prefill_wait = long_prefill_wait
        self._long_waits = 0
        #: Prompt tokens ``read`` and ``cached`` (a reused prefix), read by the engine's stats.
        self.prompt_tokens: collections.Counter[str] = collections.Counter()

    def use_prefix_cache(self, enabled: bool) -> None:
        self.prefix_cache = enabled
        if not enabled:
            self.slots.clear()

    def start(self, turn: Turn, turns: Collection[Turn]) -> None:
        """Starts the turn's prefill (``turn.job``) after the prefix it reuses, copied into its
        slots; or nothing yet, while it waits for a prompt being read (:meth:`_reuse`; ``turns``:
        every turn of the pipeline)."""
        reuse = self._reuse(turn, turns)
        if reuse is False:
            return
        moved = self.slots.vacate(turn.slot)
        if reuse is not None and reuse.slot == turn.slot and moved is not None:
            reuse = dataclasses.replace(reuse, slot=moved)  # reused from where it went
        speaker = turn.talker.speaker_id if turn.talker is not None else None
        mask = turn.constraint.first if turn.constraint is not None else None
        reused = (0, 0)
        if reuse is not None:
            self._copy_prefix(turn, reuse)
            reused = (reuse.thinker, reuse.talker)
        self.prompt_tokens["cached"] += reused[0]
        self.prompt_tokens["read"] += turn.prompt.length - reused[0]
        turn.job = self.prefiller.start(turn.slot, turn.prompt, speaker, mask, reused)

    def advance(self, reading: Sequence[Turn], turns: Collection[Turn]) -> int:
        """Inline prefill, one tick: the ``prefills_per_step`` prompts of ``reading`` with the
        fewest pieces left (the oldest first among equals) each read one more (the first pieces
        of new prompts in one batched pass of the thinker, then of the talker), so a short turn
        never queues behind long prompts. A long prompt (more than one tick left) waits while a
        turn is being read or a reply of ``turns`` awaits its first audio, the latency-critical
        ticks of the other sessions, for at most ``long_prefill_wait`` ticks in a row; then it
        reads its piece anyway. Returns how many prompts read a piece."""
        jobs = sorted(reading, key=lambda t: t.job.ticks_left)  # type: ignore[union-attr]
        lanes = self.prefills_per_step
        critical = any(
            t.prefilled and t.audio_started is None and t.talker is not None and not (t.talker.done or t.held)
            for t in turns
        )
        waited = False
        chosen = []
        for turn in jobs:
            job = turn.job
            assert job is not None
            if lanes == 0:
                break
            long = job.ticks_left > 1
            if long and critical and self._long_waits < self.long_prefill_wait:
                waited = True
                continue
            critical |= not long  # a short turn read now: its reply is the critical one
            lanes -= 1
            chosen.append(job)
        self.prefiller.advance(chosen)  # the first pieces of a pass in one batched pass
        self._long_waits = self._long_waits + 1 if waited else 0
        return len(chosen)

    def held(self, turn: Turn, fed: int = 0) -> Prefix | None:
        """What the turn's slots hold once its prompt is read: the prompt and its first ``fed``
        reply tokens (thinker), the prompt's user turns (talker)."""
        keys = turn.prompt.fingerprint
        if not self.prefix_cache or keys is None or not turn.prefilled:
            return None
        if fed:
            keys = np.concatenate([keys, np.asarray(turn.drawn[:fed], dtype=np.int64)])
        t = turn.talker
        talker_user = t.prompt.user_embeds.shape[0] if t is not None and t.prompt is not None else 0
        return Prefix(keys, talker_user)

    def repack(self, turn: Turn) -> None:
        """Keeps the slots that step packed low: a step runs the first rows up to the bucket that
        covers the highest stepping slot, so a turn held in a low slot (for as long as its client
        is behind: up to ``max_held_seconds``) would make every step of the others run rows it
        does not need. Held, the turn moves to the highest free slot above its own (a prefix
        there swaps places with it); released, to the lowest free slot below it. Only once its
        prompt is loaded (a prefill under way writes its slot). Its reply goes on unchanged:
        every per-slot state moves."""
        if not turn.prefilled:
            return
        source = turn.slot
        planned = self.slots.park(source) if turn.held else self.slots.unpark(source)
        if planned is None:
            return
        target, swap = planned
        self.thinker.move(source, target, swap=swap)
        if self.talker is not None:
            self.talker.move(source, target, swap=swap)
        turn.slot = target
        self.calls["move", 1] += 1

    def _reuse(self, turn: Turn, turns: Collection[Turn]) -> Reuse | None | bool:
        """The longest prefix of the turn's prompt that a slot holds (None: none), or False when
        a prompt still being read shares at least a piece more of it: the turn then waits for
        that one instead of reading the same tokens beside it (out-of-band responses over one
        context, asked at once)."""
        keys = turn.prompt.fingerprint
        if not self.prefix_cache or keys is None:
            return None
        user = None
        if turn.talker is not None:
            cfg = self.model.config
            ids = turn.prompt.input_ids[0]
            user = user_positions(ids, cfg.im_start_token_id, cfg.user_token_id).numpy()
        best = self.slots.best(keys, user)
        got = best.thinker if best is not None else 0
        for other in turns:
            theirs = other.prompt.fingerprint
            if other.job is None or other.prefilled or theirs is None or other is turn:
                continue
            if min(common_prefix(keys, theirs), keys.shape[0] - 1) >= got + self.thinker.prompt.chunk:
                return False
        return best

    def _copy_prefix(self, turn: Turn, reuse: Reuse) -> None:
        """Copies a reused prefix into the turn's slots (unless it is there already); counts it in
        the turn's usage."""
        self._copy_entries(reuse.slot, turn.slot, reuse.thinker, reuse.talker)
        ids = turn.prompt.input_ids[0, : reuse.thinker]
        thinker = self.model.config.thinker_config
        audio = int((ids == thinker.audio_token_id).sum())
        image = int((ids == thinker.image_token_id).sum())
        turn.usage.cached_audio_tokens, turn.usage.cached_image_tokens = audio, image
        turn.usage.cached_text_tokens = reuse.thinker - audio - image

    def _move_prefix(self, source: int, target: int, prefix: Prefix) -> None:
        self._copy_entries(source, target, prefix.keys.shape[0], prefix.talker_user)

    def _copy_entries(self, source: int, target: int, thinker: int, talker: int) -> None:
        self.thinker.kv.copy_prefix(source, target, thinker)
        if self.talker is not None:
            self.talker.kv.copy_prefix(source, target, talker)
