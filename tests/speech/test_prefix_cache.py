"""Prompt prefixes reused across requests: the slot pool's bookkeeping, and the pipeline reading
only what is new while computing what reading the whole prompt computes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from omnirt.stages.speech.loader import load_speech_pipeline
from omnirt.stages.speech.prefix_cache import (
    MIN_REUSE,
    Prefix,
    SlotPool,
    common_prefix,
    media_key,
    plan_reuse,
)
from omnirt.stages.types import (
    AudioDelta,
    AudioPart,
    ContextMessage,
    Finished,
    GenerationRequest,
    Started,
    TextDelta,
    TextPart,
)

from .conftest import TokenLog, drain, of, tone

# -- the pool, on its own ------------------------------------------------------------------------


def keys(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def test_common_prefix_and_media_keys() -> None:
    assert common_prefix(keys(1, 2, 3), keys(1, 2, 4, 5)) == 2
    assert common_prefix(keys(1, 2), keys(1, 2, 3)) == 2
    assert common_prefix(keys(7), keys(1)) == 0
    a, b = media_key(b"one"), media_key(b"two")
    assert a < 0 and b < 0 and a != b and a == media_key(b"one")


def test_plan_reuse_reads_at_least_the_last_position() -> None:
    held = Prefix(keys(1, 2, 3, 4))
    assert plan_reuse(keys(1, 2, 3, 4), None, 5, held).thinker == 3  # the same prompt: one read
    assert plan_reuse(keys(1, 2, 9), None, 5, held).thinker == 2
    assert plan_reuse(keys(9, 2), None, 5, held) is None


def test_plan_reuse_stops_before_media_the_talker_must_read() -> None:
    """The talker reads user positions; those of audio need the thinker's hidden state, so the
    thinker prefix ends before the first such position the talker has not got."""
    m = media_key(b"audio")
    prompt = keys(1, 2, m, m, 3, 4, 5)
    user = np.array([0, 1, 1, 1, 1, 0, 0], dtype=bool)
    # The held talker has all four user positions: everything but the last position.
    full = plan_reuse(prompt, user, 0, Prefix(prompt, talker_user=4))
    assert (full.thinker, full.talker) == (6, 4)
    # It has one (a text position): the thinker prefix ends at the audio, which the talker needs.
    cut = plan_reuse(prompt, user, 0, Prefix(prompt, talker_user=1))
    assert (cut.thinker, cut.talker) == (2, 1)
    # Text only: the talker does not matter.
    assert plan_reuse(prompt, None, 0, Prefix(prompt, talker_user=0)).thinker == 6


def test_pool_hands_out_the_lowest_slot_and_moves_a_held_prefix_out_of_the_way() -> None:
    moves: list[tuple[int, int, int]] = []
    pool = SlotPool(4, lambda s, t, p: moves.append((s, t, p.keys.shape[0])))
    assert [pool.take(), pool.take()] == [0, 1]
    pool.give(0, Prefix(keys(1, 2, 3)))
    assert pool.take() == 0 and pool.best(keys(1, 2, 3, 4), None, at_least=1).slot == 0  # held until vacated
    assert pool.vacate(0) == 3 and moves == [(0, 3, 3)]  # to the highest free slot holding nothing
    assert pool.best(keys(1, 2, 3, 4), None, at_least=1).slot == 3
    assert pool.take() == 2 and pool.vacate(2) is None  # it held nothing
    assert pool.take() == 3
    assert pool.vacate(3) is None and moves == [(0, 3, 3)]  # no room left: the prefix is dropped
    assert pool.best(keys(1, 2, 3, 4), None, at_least=1) is None and len(pool) == 0


def test_a_parked_request_goes_up_with_its_prefix_and_comes_back_down() -> None:
    """``park`` (a held request): to the highest free slot above holding nothing, else to the
    least recently used prefix above, which swaps places with it (kept, in the slot it left);
    ``unpark``: to the lowest free slot below, whose prefix moves out of the way (never into the
    slot the request is leaving)."""
    moves: list[tuple[int, int]] = []
    pool = SlotPool(5, lambda s, t, p: moves.append((s, t)))
    assert [pool.take() for _ in range(5)] == [0, 1, 2, 3, 4]
    pool.give(4, Prefix(keys(4, 4)))  # older
    pool.give(3, Prefix(keys(3, 3)))
    pool.hold(1, Prefix(keys(1, 1)))  # the busy request's own prompt
    assert pool.park(1) == (4, True) and moves == []  # no empty slot above: swapped with the oldest
    assert pool.best(keys(1, 1, 9), None, at_least=1).slot == 4  # its prefix went along
    assert pool.best(keys(4, 4, 9), None, at_least=1).slot == 1  # the displaced one is kept
    assert pool.park(4) is None  # nothing free above the top
    pool.give(0, Prefix(keys(0, 0)))
    assert pool.unpark(4) == (0, False)
    assert moves == [(0, 3)]  # slot 0's prefix over the least recently used one (3), not into 4
    assert pool.best(keys(0, 0, 9), None, at_least=1).slot == 3
    assert pool.best(keys(1, 1, 9), None, at_least=1).slot == 0
    assert pool.best(keys(3, 3, 9), None, at_least=1) is None  # dropped
    assert pool.unpark(0) is None  # nothing free below
    assert [pool.take() for _ in range(3)] == [1, 3, 4] and len(pool) == 0  # 1 and 4: left by it


def test_pool_moves_over_the_least_recently_used_prefix() -> None:
    moves: list[tuple[int, int]] = []
    pool = SlotPool(3, lambda s, t, p: moves.append((s, t)))
    for _ in range(3):
        pool.take()
    pool.give(2, Prefix(keys(5, 5)))  # older
    pool.give(1, Prefix(keys(6, 6)))
    pool.give(0, Prefix(keys(7, 7)))  # newest
    assert pool.take() == 0 and pool.vacate(0) == 2
    assert moves == [(0, 2)]  # over the oldest (slot 2's), not slot 1's
    assert pool.best(keys(7, 7, 1), None, at_least=1).slot == 2
    assert pool.best(keys(5, 5, 1), None, at_least=1) is None
    assert pool.best(keys(6, 6, 1), None, at_least=1).slot == 1


def test_the_pool_reads_only_the_prefixes_that_begin_as_the_prompt_and_finds_what_a_scan_finds() -> None:
    """``best`` looks up the held prefixes by their first ``MIN_REUSE`` keys; through takes,
    gives, moves, parks and drops it answers as reading every held prefix would."""
    rng = np.random.default_rng(7)
    heads = [rng.integers(0, 50, MIN_REUSE) for _ in range(3)]

    def prompt() -> np.ndarray:
        tail = rng.integers(0, 50, int(rng.integers(0, 40)))
        if rng.random() < 0.2:  # too short to be reused
            return rng.integers(0, 50, int(rng.integers(1, MIN_REUSE)))
        return np.concatenate([heads[int(rng.integers(3))], tail]).astype(np.int64)

    pool = SlotPool(12, lambda s, t, p: None)
    busy: list[int] = []
    for _ in range(400):
        op = rng.random()
        if op < 0.35 and len(pool):
            slot = pool.take()
            pool.vacate(slot)
            busy.append(slot)
        elif op < 0.7 and busy:
            held = Prefix(prompt()) if rng.random() < 0.9 else None
            pool.give(busy.pop(int(rng.integers(len(busy)))), held)
        elif op < 0.8 and busy:
            slot = busy[int(rng.integers(len(busy)))]
            moved = pool.park(slot) if rng.random() < 0.5 else pool.unpark(slot)
            if moved is not None:
                busy[busy.index(slot)] = moved[0]
        elif op < 0.85:
            pool.clear()
        query = prompt()
        scan = [plan_reuse(query, None, slot, held) for slot, held in pool.held.items()]
        longest = max((r.thinker for r in scan if r is not None and r.thinker >= MIN_REUSE), default=None)
        found = pool.best(query, None)
        assert (found.thinker if found else None) == longest
        if found is not None:
            assert common_prefix(query, pool.held[found.slot].keys) >= found.thinker
        index = {s for slots in pool.held._by_head.values() for s in slots}
        assert index == {s for s, held in pool.held.items() if held.keys.shape[0] >= MIN_REUSE}


# -- the pipeline --------------------------------------------------------------------------------


def summary(outs) -> tuple[str, np.ndarray, Finished]:
    text = "".join(o.text for o in outs if isinstance(o, TextDelta))
    pcm = [o.pcm for o in outs if isinstance(o, AudioDelta)]
    done = outs[-1]
    assert isinstance(done, Finished)
    return text, np.concatenate(pcm) if pcm else np.zeros(0, np.int16), done


def same_reply(a, b) -> None:
    (text_a, pcm_a, done_a), (text_b, pcm_b, done_b) = a, b
    assert (text_a, done_a.reason) == (text_b, done_b.reason)
    assert done_a.usage.output_audio_tokens == done_b.usage.output_audio_tokens
    assert pcm_a.shape == pcm_b.shape
    assert np.abs(pcm_a.astype(np.int32) - pcm_b.astype(np.int32)).max(initial=0) <= 2


@pytest.fixture(scope="module")
def pipes(demo_dir: Path):
    """The same model with and without the prefix cache."""
    cached = load_speech_pipeline(demo_dir, max_slots=4, max_audio_frames=30, prefill_chunk=64)
    whole = load_speech_pipeline(
        demo_dir, max_slots=4, max_audio_frames=30, prefill_chunk=64, prefix_cache=False
    )
    return cached, whole


def run(pipe, requests: list[GenerationRequest]) -> tuple[dict[str, tuple], dict[str, list[int]], list]:
    log = TokenLog(pipe)
    for r in requests:
        pipe.add(r)
    outs = drain(pipe)
    pipe.token_observer = None
    return {r.request_id: summary(of(outs, r.request_id)) for r in requests}, dict(log.tokens), outs


def turn(rid: str, messages: list[ContextMessage], **kw) -> GenerationRequest:
    kw.setdefault("max_output_tokens", 8)
    return GenerationRequest(rid, messages, **kw)


def test_a_conversation_turn_reads_only_what_is_new(pipes, monkeypatch: pytest.MonkeyPatch) -> None:
    """Turn 2 of a spoken conversation reuses turn 1's prompt and reply: its earlier audio is
    not encoded again, and its reply (text, tokens, speech) is the one reading the whole prompt
    gives."""
    cached, whole = pipes
    first = ContextMessage("user", (AudioPart(tone(1.0)), TextPart("hello " * 40)))
    replies = {}
    for pipe in pipes:
        replies[pipe] = run(pipe, [turn("t1", [first])])
    text1 = replies[cached][0]["t1"][0]
    assert text1 == replies[whole][0]["t1"][0]
    history = [first, ContextMessage("assistant", (TextPart(text1),))]
    second = [*history, ContextMessage("user", (AudioPart(tone(0.6, 330.0, seed=3)), TextPart("and this?")))]
    encoded: list[int] = []
    from omnirt.stages.speech.audio_encoder import AudioEncoder

    original = AudioEncoder.plan
    monkeypatch.setattr(
        AudioEncoder, "plan", lambda self, f, *a: encoded.append(f.shape[0]) or original(self, f, *a)
    )
    got, tokens, outs = run(cached, [turn("t2", second)])
    assert encoded == [1]  # the new audio part only
    want, want_tokens, _ = run(whole, [turn("t2", second)])
    assert encoded == [1, 2]  # read whole: both parts
    assert tokens == want_tokens
    same_reply(got["t2"], want["t2"])
    started = next(o for o in of(outs, "t2") if isinstance(o, Started))
    usage = got["t2"][2].usage
    first_len = replies[cached][0]["t1"][2].usage.input_tokens
    assert usage.cached_tokens == started.usage.cached_tokens >= first_len  # turn 1's prompt, and more
    assert usage.cached_audio_tokens == 13 and usage.cached_tokens < usage.input_tokens
    assert want["t2"][2].usage.cached_tokens == 0


def test_responses_over_one_context_asked_at_once_read_it_once(pipes) -> None:
    """Four out-of-band responses over one context, added in one tick: the first reads the
    prompt, the other three wait for it and then read its last position only; every reply equals
    the one of reading the whole prompt."""
    cached, whole = pipes
    context = [ContextMessage("user", (AudioPart(tone(0.8, 290.0, seed=5)), TextPart("word " * 150)))]
    requests = [turn(f"o{i}", context, temperature=0.8, seed=i) for i in range(4)]
    got, tokens, outs = run(cached, requests)
    want, want_tokens, _ = run(whole, [turn(f"o{i}", context, temperature=0.8, seed=i) for i in range(4)])
    assert tokens == want_tokens
    for rid in want:
        same_reply(got[rid], want[rid])
    length = want["o0"][2].usage.input_tokens
    cached_counts = sorted(got[r][2].usage.cached_tokens for r in got)
    assert cached_counts[1:] == [length - 1] * 3 and cached_counts[0] < length - 1
    starts = [rid for rid, o in outs if isinstance(o, Started)]
    leader = next(r for r in got if got[r][2].usage.cached_tokens == cached_counts[0])
    assert starts[0] == leader


def test_another_audio_of_the_same_length_is_not_reused(pipes) -> None:
    """Two prompts whose tokens are the same but whose audio differs share only the text before
    the audio."""
    cached, whole = pipes
    context = ContextMessage("user", (TextPart("the same words " * 30),))
    a = [context, ContextMessage("user", (AudioPart(tone(0.7, 200.0, seed=1)), TextPart("same words")))]
    b = [context, ContextMessage("user", (AudioPart(tone(0.7, 410.0, seed=2)), TextPart("same words")))]
    run(cached, [turn("a", a)])
    got, tokens, _ = run(cached, [turn("b", b)])
    want, want_tokens, _ = run(whole, [turn("b", b)])
    assert tokens == want_tokens
    same_reply(got["b"], want["b"])
    usage = got["b"][2].usage
    assert usage.cached_audio_tokens == 0 and 64 <= usage.cached_tokens < usage.input_text_tokens


def test_a_short_common_prefix_is_read_again(pipes) -> None:
    """A prefix shorter than the smallest piece (a system prompt, a short first message) is not
    worth a copy: the prompt is read whole."""
    cached, _ = pipes
    run(cached, [turn("s1", [ContextMessage("user", (TextPart("hello"),))])])
    got, _, _ = run(cached, [turn("s2", [ContextMessage("user", (TextPart("hello again"),))])])
    assert got["s2"][2].usage.cached_tokens == 0


def test_a_prefix_moved_out_of_the_way_is_still_reused(demo_dir: Path) -> None:
    """A finished conversation's slot is taken by another request: its prefix moves to a free
    slot, and the conversation's next turn reuses it from there, with the reply of a whole
    read."""
    cached = load_speech_pipeline(demo_dir, max_slots=3, max_audio_frames=20)
    whole = load_speech_pipeline(demo_dir, max_slots=3, max_audio_frames=20, prefix_cache=False)
    first = ContextMessage("user", (TextPart("tell me about the sea " * 10),))
    text1 = run(cached, [turn("c1", [first])])[0]["c1"][0]
    assert set(cached.reader.slots.held) == {0}
    cached.add(turn("x", [ContextMessage("user", (TextPart("something else"),))], max_output_tokens=30))
    outs = cached.step()  # x holds slot 0 now: c1's prefix moved to the highest free slot
    assert set(cached.reader.slots.held) == {0, 2} and len(cached.reader.slots.held[2].keys) > 60
    reply = ContextMessage("assistant", (TextPart(text1),))
    second = [first, reply, ContextMessage("user", (TextPart("more"),))]
    cached.add(turn("c2", second))  # slot 1, beside x
    outs += drain(cached)
    got = summary(of(outs, "c2"))
    want, _, _ = run(whole, [turn("c2", second)])
    same_reply(got, want["c2"])
    assert got[2].usage.cached_tokens > 60


def test_a_held_request_swaps_places_with_a_prefix_and_both_stay_whole(demo_dir: Path) -> None:
    """Held, a request moves up into the only free slot, which holds a finished conversation's
    prefix: the two swap places. The conversation's next turn then reuses that prefix from the
    held request's old slot (the reply of a whole read), and the held request, released, ends
    with the reply it makes never held."""
    cached = load_speech_pipeline(demo_dir, max_slots=2, max_audio_frames=20)
    whole = load_speech_pipeline(demo_dir, max_slots=2, max_audio_frames=20, prefix_cache=False)
    first = ContextMessage("user", (TextPart("tell me about the sea " * 10),))
    text1 = run(cached, [turn("c1", [first])])[0]["c1"][0]
    held = lambda: turn("h", [ContextMessage("user", (TextPart("count slowly"),))], max_output_tokens=24)  # noqa: E731
    alone = run(whole, [held()])[0]["h"]
    cached.add(held())  # slot 0: c1's prefix moves to slot 1
    outs = []
    while not cached._active["h"].prefilled:
        outs += cached.step()
    outs += cached.step()
    assert set(cached.reader.slots.held) == {0, 1} and len(cached.reader.slots.held[1].keys) > 60
    cached.hold("h", True)
    assert cached._active["h"].slot == 1  # swapped: c1's prefix is in slot 0 now
    assert len(cached.reader.slots.held[0].keys) > 60
    reply = ContextMessage("assistant", (TextPart(text1),))
    second = [first, reply, ContextMessage("user", (TextPart("more"),))]
    cached.add(turn("c2", second))  # slot 0, over the prefix it reuses
    outs += drain(cached)
    got = summary(of(outs, "c2"))
    want, _, _ = run(whole, [turn("c2", second)])
    same_reply(got, want["c2"])
    assert got[2].usage.cached_tokens > 60
    cached.hold("h", False)
    assert cached._active["h"].slot == 0  # back down
    outs += drain(cached)
    same_reply(summary(of(outs, "h")), alone)
