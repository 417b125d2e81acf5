"""The batched, graph-capturable sampler: Philox known answers, batch invariance, the kept set of
transformers' Top-K/Top-P warpers, the drawn distribution, and input checks (CPU)."""

from __future__ import annotations

import pytest
import torch
from omnirt.stages.sampling import (
    SamplerInputError,
    _filtered_cdf,
    _scale_by_uniform,
    _top_p_cut,
    draw_params,
    draw_prepared,
    draw_rows,
    philox4x32,
    philox_uniform,
    sample_rows,
)
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

# Random123 tests/kat_vectors, the three "philox4x32 10" lines: counter (4 words), key (2), output (4).
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


# --- reference helpers (also used by tests/gpu/test_sampler_gpu.py) ---------------------------------


def philox_python(key: tuple[int, int], ctr: tuple[int, int, int, int]) -> list[int]:
    """Philox4x32-10 on Python ints, from the Random123 description (key bumped before rounds 2..10)."""
    mask = 0xFFFFFFFF
    k0, k1 = key
    x0, x1, x2, x3 = ctr
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & mask, (k1 + 0xBB67AE85) & mask
        p0, p1 = 0xD2511F53 * x0, 0xCD9E8D57 * x2
        x0, x1, x2, x3 = (p1 >> 32) ^ x1 ^ k0, p1 & mask, (p0 >> 32) ^ x3 ^ k1, p0 & mask
    return [x0, x1, x2, x3]


def reference_kept(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """transformers' kept set for one row [V] (bool [V]): scores / T, TopKLogitsWarper, TopPLogitsWarper
    (each only when on, as ``generate`` adds them)."""
    scores = logits.float()[None] / temperature
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores[0] > float("-inf")


def float64_draw_agrees(
    token: int, logits: torch.Tensor, temperature: float, top_k: int, top_p: float, u: float, tol: float
) -> bool:
    """Whether ``token`` is what inverse-CDF sampling in float64 gives for the uniform ``u``, up to
    ``tol`` on the CDF (and on the top-p cut): the scores sorted ascending (tied scores in decreasing
    id, as the sampler orders them), top-k then top-p as in transformers, then the first kept
    position whose CDF exceeds u."""
    row = logits.float()
    if temperature <= 0:
        return token == int(torch.argmax(row))
    vocab = row.shape[0]
    ascending, reversed_order = torch.sort((row / temperature).flip(0), stable=True)
    order = vocab - 1 - reversed_order  # ties: lower ids count as better
    k = min(top_k, vocab) if top_k > 0 else vocab
    kth = ascending[vocab - k]
    cut_k = int((ascending < kth).sum())
    probs = ascending.double().masked_fill(ascending < kth, float("-inf")).softmax(-1)
    cdf = probs.cumsum(-1)
    if top_p < 1.0:
        lim = 1.0 - top_p
        firsts = range(int((cdf <= lim - tol).sum()), int((cdf <= lim + tol).sum()) + 1)
    else:
        firsts = range(0, 1)
    position = int((order == token).nonzero()[0, 0])
    for cut_p in firsts:
        first = min(max(cut_k, cut_p), vocab - 1)
        if position < first:
            continue
        base = float(cdf[first - 1]) if first > 0 else 0.0
        span = float(cdf[-1]) - base
        below = (float(cdf[position - 1]) - base) / span if position > first else 0.0
        upto = (float(cdf[position]) - base) / span
        if below - tol <= u < upto + tol:
            return True
    return False


def mixed_params(rows: int, generator: torch.Generator, device: str | torch.device = "cpu"):
    """Per-row parameters mixing greedy, top-k, top-p and both, seeds over the whole int64 range and
    counters past 2**32."""
    temperature = torch.tensor([0.0, 0.6, 1.0, 1.4, -1.0, 0.9, 0.7, 1.1], dtype=torch.float32).repeat(rows)
    top_k = torch.tensor([0, 0, 5, 1, 3, 50, 0, 20], dtype=torch.int64).repeat(rows)
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.5, 0.2, 0.8, 0.3, 1.0], dtype=torch.float32).repeat(rows)
    order = torch.randperm(8 * rows, generator=generator)[:rows]
    seed = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=generator, dtype=torch.int64)
    counter = torch.randint(0, 2**40, (rows,), generator=generator, dtype=torch.int64)
    return [t.to(device) for t in (temperature[order], top_k[order], top_p[order], seed, counter)]


def max_z(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest standardised deviation of observed frequencies from expected probabilities (float64)."""
    n = float(counts.sum())
    freq = counts.double() / n
    spread = (expected * (1 - expected) / n).sqrt().clamp(min=1e-12)
    return float(((freq - expected).abs() / spread).max())


# --- Philox ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("ctr", "key", "want"), PHILOX_KAT)
def test_philox_known_answers(ctr, key, want):
    words = [torch.tensor([v], dtype=torch.int64) for v in (*key, *ctr)]
    assert [int(w) for w in philox4x32(*words)] == list(want)
    assert philox_python(key, ctr) == list(want)


def test_philox_matches_python_reference_on_random_words():
    gen = torch.Generator().manual_seed(7)
    words = torch.randint(0, 2**32, (6, 200), generator=gen, dtype=torch.int64)
    out = torch.stack(philox4x32(*words))
    for i in range(words.shape[1]):
        key = (int(words[0, i]), int(words[1, i]))
        ctr = tuple(int(w) for w in words[2:, i])
        assert out[:, i].tolist() == philox_python(key, ctr)


def test_philox_uniform_keys_counter_and_stream():
    seed = torch.tensor([5, 5 + 2**32, -5, 5, 5, 5], dtype=torch.int64)
    counter = torch.tensor([9, 9, 9, 9 + 2**32, 10, 9], dtype=torch.int64)
    u = philox_uniform(seed, counter, stream=0)
    assert u.dtype == torch.float32 and u.shape == (6,)
    assert len(set(u[:5].tolist())) == 5  # both seed halves and both counter halves matter
    assert float(u[5]) == float(u[0])  # and nothing else
    assert float(philox_uniform(seed[:1], counter[:1], stream=1)[0]) != float(u[0])
    word0 = philox_python((5, 0), (9, 0, 0, 0))[0]
    assert float(u[0]) == (word0 >> 8) / 2**24
    many = philox_uniform(torch.full((20000,), 3, dtype=torch.int64), torch.arange(20000), stream=2)
    assert float(many.min()) >= 0.0 and float(many.max()) < 1.0
    assert abs(float(many.mean()) - 0.5) < 0.01
    assert torch.histc(many, bins=10, min=0, max=1).min() > 1800  # 2000 expected per bin


# --- batch invariance and counters --------------------------------------------------------------------


def test_same_token_alone_and_anywhere_in_a_batch():
    gen = torch.Generator().manual_seed(11)
    vocab = 1003  # not a multiple of any vector width: rows start at every alignment in the batch
    for _trial in range(6):
        logits = torch.randn(32, vocab, generator=gen) * 3
        params = mixed_params(32, gen)
        batch = sample_rows(logits, *params)
        for i in range(32):
            alone = sample_rows(logits[i : i + 1], *(p[i : i + 1] for p in params))
            assert int(alone[0]) == int(batch[i])
        perm = torch.randperm(32, generator=gen)
        shuffled = sample_rows(logits[perm], *(p[perm] for p in params))
        assert torch.equal(shuffled, batch[perm])


def test_slot_sampling_draws_what_sample_rows_draws():
    """``SlotSampling`` prepares each slot's draw parameters at ``set`` (and moves them with
    ``copy_row``): its draws are ``sample_rows``' and ``draw_rows``' tokens with the raw ones."""
    from omnirt.stages.draws import SlotSampling

    gen = torch.Generator().manual_seed(5)
    rows, vocab = 16, 300
    temperature, top_k, top_p, seed, _ = mixed_params(rows, gen)
    slots = SlotSampling(rows + 1, torch.device("cpu"))
    for i in range(rows):
        slots.set(i, temperature=float(temperature[i]), top_k=int(top_k[i]), top_p=float(top_p[i]),
                  seed=int(seed[i]))  # fmt: skip
    slots.counter[:rows] = torch.arange(rows) * 7
    for _ in range(3):
        logits = torch.randn(rows, vocab, generator=gen) * 3
        want = sample_rows(logits, temperature, top_k, top_p, seed, slots.counter[:rows], 2)
        assert torch.equal(slots.draw(logits, 0, 2), want)
        uniform = torch.rand(rows, generator=gen)
        want = draw_rows(logits, temperature, top_k, top_p, uniform)
        assert torch.equal(slots.draw_with(logits, uniform), want)
        slots.advance(torch.ones(rows, dtype=torch.bool))
    slots.copy_row(3, rows)  # the spare slot takes row 3: parameters, seed, counter and all
    logits = torch.randn(rows + 1, vocab, generator=gen)
    drawn = slots.draw(logits[[3, 3]].contiguous(), 3, 2), slots.draw(logits[[3]], rows, 2)
    assert int(drawn[0][0]) == int(drawn[1][0])
    with pytest.raises(SamplerInputError, match="rows"):
        draw_prepared(logits, slots.params(slice(0, 2)), torch.rand(rows + 1))


def test_counters_seeds_and_streams_change_the_draw():
    vocab = 1000
    logits = torch.zeros(1000, vocab)
    one = torch.ones(1000)
    off_k, off_p = torch.zeros(1000, dtype=torch.int64), torch.ones(1000)
    seed = torch.full((1000,), 42, dtype=torch.int64)
    by_counter = sample_rows(logits, one, off_k, off_p, seed, torch.arange(1000))
    by_seed = sample_rows(logits, one, off_k, off_p, torch.arange(1000), torch.zeros(1000, dtype=torch.int64))
    # uniform over 1000 tokens: 1000 draws hit about 632 distinct ones
    assert len(set(by_counter.tolist())) > 560
    assert len(set(by_seed.tolist())) > 560
    again = sample_rows(logits, one, off_k, off_p, seed, torch.arange(1000))
    assert torch.equal(again, by_counter)
    other_stream = sample_rows(logits, one, off_k, off_p, seed, torch.arange(1000), stream=3)
    assert int((other_stream == by_counter).sum()) < 20


# --- greedy rows ---------------------------------------------------------------------------------------


def test_greedy_rows_are_argmax():
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(16, 500, generator=gen) * 4).to(torch.bfloat16)
    rows = 16
    seed = torch.arange(rows)
    counter = torch.arange(rows) * 7
    argmax = torch.argmax(logits.float(), dim=-1)
    greedy = sample_rows(
        logits,
        torch.tensor([0.0, -1.0] * 8),
        torch.tensor([0, 5] * 8),
        torch.tensor([1.0, 0.5] * 8),
        seed,
        counter,
    )
    assert torch.equal(greedy, argmax)
    fine = logits.float() + torch.randn(rows, 500, generator=gen) * 1e-3
    for temperature, top_k, top_p in ((1.3, 1, 1.0), (0.8, 0, 0.0), (2.0, 1, 0.3)):
        picked = sample_rows(
            fine,
            torch.full((rows,), temperature),
            torch.full((rows,), top_k, dtype=torch.int64),
            torch.full((rows,), top_p),
            seed,
            counter,
        )
        assert torch.equal(picked, torch.argmax(fine, dim=-1))


# --- the kept set ------------------------------------------------------------------------------------


def _top_p_removed(cdf: torch.Tensor, top_p: torch.Tensor) -> list[int]:
    """How many sorted positions (from the worst up) top-p removes, per row."""
    return torch.searchsorted(cdf, _top_p_cut(top_p), right=True)[:, 0].tolist()


def _kept_from_sampler(logits, temperature, top_k, top_p):
    order, _, first = _filtered_cdf(logits, draw_params(temperature, top_k, top_p))
    positions = torch.arange(logits.shape[1]).expand_as(order)
    kept = torch.zeros_like(order, dtype=torch.bool)
    return kept.scatter_(1, logits.shape[1] - 1 - order, positions >= first)


@pytest.mark.parametrize("vocab", [257, 40])  # 40: top_k 50 is more than the vocabulary
def test_kept_set_equals_transformers_warpers(vocab):
    gen = torch.Generator().manual_seed(5)
    rows = 96
    logits = torch.randn(rows, vocab, generator=gen) * torch.rand(rows, 1, generator=gen) * 6
    logits[:8, : vocab // 2] = logits[:8, vocab // 2 : 2 * (vocab // 2)]  # ties in some rows
    temperature, top_k, top_p, _, _ = mixed_params(rows, gen)
    temperature = temperature.abs() + 0.05
    kept = _kept_from_sampler(logits, temperature, top_k, top_p)
    for i in range(rows):
        want = reference_kept(logits[i], float(temperature[i]), int(top_k[i]), float(top_p[i]))
        if i >= 8:
            assert torch.equal(kept[i], want), i
            continue
        # ties: transformers' unstable sort orders tied scores as it happens to; the sets may differ
        # only by tokens tied with the worst kept score, and never in size
        scores = logits[i] / temperature[i]
        assert int(kept[i].sum()) == int(want.sum())
        boundary = scores[kept[i]].min()
        assert bool((scores[kept[i] ^ want] == boundary).all())
        kept_tied = (kept[i] & (scores == boundary)).nonzero()[:, 0]
        tied = (scores == boundary).nonzero()[:, 0]
        assert kept_tied.tolist() == tied[: len(kept_tied)].tolist()  # the lowest ids among the tied


def test_kept_set_at_the_top_p_boundary():
    """top_p placed exactly at, and one float32 step either side of, a cumulative probability: the
    rounding of transformers' float32 cumsum decides, and the sampler's fixed-point rule mirrors it."""
    gen = torch.Generator().manual_seed(9)
    vocab = 64
    checked = 0
    for _ in range(12):
        row = torch.randn(vocab, generator=gen) * 2
        cum = torch.sort(row).values.softmax(-1).cumsum(-1)  # what transformers compares
        for position in (vocab - 2, vocab - 5, vocab - 12, vocab // 2):
            lim = cum[position]
            for boundary in (
                lim,
                torch.nextafter(lim, torch.tensor(0.0)),
                torch.nextafter(lim, torch.tensor(1.0)),
            ):
                top_p = 1.0 - boundary
                kept = _kept_from_sampler(
                    row[None], torch.ones(1), torch.zeros(1, dtype=torch.int64), top_p[None]
                )
                want = reference_kept(row, 1.0, 0, float(top_p))
                assert torch.equal(kept[0], want)
                checked += 1
    assert checked == 12 * 4 * 3


def test_samples_lie_in_the_kept_set_and_follow_the_float64_inverse_cdf():
    gen = torch.Generator().manual_seed(13)
    vocab = 300
    rows = 400
    logits = torch.randn(rows, vocab, generator=gen) * 3
    temperature, top_k, top_p, seed, counter = mixed_params(rows, gen)
    tokens = sample_rows(logits, temperature, top_k, top_p, seed, counter)
    uniforms = philox_uniform(seed, counter, 0)
    assert tokens.dtype == torch.int64 and tokens.shape == (rows,)
    for i in range(rows):
        t, k, p = float(temperature[i]), int(top_k[i]), float(top_p[i])
        if t > 0:
            assert bool(reference_kept(logits[i], t, k, p)[tokens[i]])
        assert float64_draw_agrees(int(tokens[i]), logits[i], t, k, p, float(uniforms[i]), tol=1e-6)


def _round_to_float32(c: int) -> int:
    """A non-negative integer rounded to 24 significant bits, ties to even (Python ints: exact)."""
    drop = c.bit_length() - 24
    if drop <= 0:
        return c
    q, r = divmod(c, 1 << drop)
    half = 1 << (drop - 1)
    if r > half or (r == half and q & 1):
        q += 1
    return q << drop


def test_top_p_rule_mirrors_float32_rounding_of_the_cumulative():
    """A fixed-point cumulative ``c`` (units of 2**-60) is removed iff float32(c) <= 1 - top_p, as
    transformers' float32 cumsum decides: checked around the rounding midpoint, ties included."""
    top_p = torch.tensor([0.9, 0.8, 0.5, 0.3, 0.25, 0.1, 0.95, 0.123456, 0.7, 0.999], dtype=torch.float32)
    lim = 1.0 - top_p
    parities = {int(b) & 1 for b in lim.view(torch.int32)}
    assert parities == {0, 1}  # odd and even mantissas: both tie directions
    rows = []
    for value in lim.tolist():  # float32 values, exact as Python floats
        lim_int = int(value * 2**60)
        assert lim_int == value * 2**60
        step = 1 << (lim_int.bit_length() - 24)  # float32 spacing just above lim, in units of 2**-60
        mid = lim_int + step // 2
        rows.append([lim_int - 1, lim_int, mid - 1, mid, mid + 1, lim_int + step])
    cdf = torch.tensor(rows, dtype=torch.int64)
    removed = _top_p_removed(cdf, top_p)
    for row, value, count in zip(rows, lim.tolist(), removed, strict=True):
        want = sum(_round_to_float32(c) <= int(value * 2**60) for c in row)
        assert count == want
    assert _top_p_removed(cdf, torch.ones(len(rows))) == [0] * len(rows)


def test_scale_by_uniform_is_exact():
    gen = torch.Generator().manual_seed(17)
    span = torch.randint(0, 2**61, (500,), generator=gen, dtype=torch.int64)
    span[:3] = torch.tensor([0, 2**60, 2**61 - 1])
    m = torch.randint(0, 2**24, (500,), generator=gen, dtype=torch.int64)
    m[:3] = torch.tensor([2**24 - 1, 2**24 - 1, 2**24 - 1])
    got = _scale_by_uniform(span, m).tolist()
    assert got == [(a * b) >> 24 for a, b in zip(span.tolist(), m.tolist(), strict=True)]


# --- the drawn distribution ------------------------------------------------------------------------------

N_DRAWS = 4000
Z_BOUND = 4.5  # over about ten tokens a correct sampler exceeds this once in ~10**4 seeds


def _expected(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    kept = reference_kept(logits, temperature, top_k, top_p)
    scores = (logits.double() / temperature).masked_fill(~kept, float("-inf"))
    return scores.softmax(-1)


def test_empirical_frequencies_match_the_kept_set_softmax():
    logits = torch.tensor([2.0, 1.8, 1.6, 1.4, 1.2, 1.0, 0.8, 0.6, 0.4, 0.2])
    temperature, top_k, top_p = 0.7, 6, 0.8  # keeps 4 tokens; without top-k 5, without top-p 6
    tokens = sample_rows(
        logits.expand(N_DRAWS, -1),
        torch.full((N_DRAWS,), temperature),
        torch.full((N_DRAWS,), top_k, dtype=torch.int64),
        torch.full((N_DRAWS,), top_p),
        torch.full((N_DRAWS,), 2024, dtype=torch.int64),
        torch.arange(N_DRAWS),
    )
    counts = torch.bincount(tokens, minlength=logits.shape[0])
    expected = _expected(logits, temperature, top_k, top_p)
    assert int(counts[expected == 0].sum()) == 0
    assert int((expected > 0).sum()) == 4
    assert max_z(counts, expected) < Z_BOUND
    # the bound has power: samplers that ignore temperature, top-p or top-k would fail it
    for wrong in (
        _expected(logits, 1.0, top_k, top_p),
        _expected(logits, temperature, top_k, 1.0),
        _expected(logits, temperature, 0, top_p),
    ):
        assert not torch.allclose(wrong, expected)
        assert max_z(counts, wrong) > Z_BOUND


def test_draw_rows_uniform_maps_monotonically_onto_the_sorted_kept_set():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).expand(5, -1)
    one = torch.ones(5)
    kept_all = torch.zeros(5, dtype=torch.int64)
    # probabilities ~ (0.032, 0.087, 0.237, 0.644) in ascending score order; CDF (0.032, 0.119, 0.356, 1)
    u = torch.tensor([0.0, 0.05, 0.2, 0.5, 1 - 2**-24])
    assert draw_rows(logits, one, kept_all, one, u).tolist() == [0, 1, 2, 3, 3]
    # equal logits: exact quarters; a uniform on a CDF step takes the next token
    flat = torch.zeros(5, 4)
    u = torch.tensor([0.0, 0.25 - 2**-24, 0.25, 0.5, 0.75])
    assert draw_rows(flat, one, kept_all, one, u).tolist() == [3, 3, 2, 1, 0]  # ties: low ids are "better"
    # top-p 0.5 removes the two worst (cumulative 0.25 and 0.5 <= 0.5), ids 3 and 2
    half = torch.full((5,), 0.5)
    u = torch.tensor([0.0, 0.5 - 2**-24, 0.5, 0.9, 1 - 2**-24])
    assert draw_rows(flat, one, kept_all, half, u).tolist() == [1, 1, 0, 0, 0]


# --- input checks ----------------------------------------------------------------------------------------


def _good(rows: int = 3):
    return (
        torch.zeros(rows, 7),
        torch.ones(rows),
        torch.zeros(rows, dtype=torch.int64),
        torch.ones(rows),
        torch.zeros(rows, dtype=torch.int64),
        torch.zeros(rows, dtype=torch.int64),
    )


@pytest.mark.parametrize(
    ("position", "bad", "message"),
    [
        (0, torch.zeros(7), "logits must be 2-D"),
        (0, torch.zeros(3, 1, 7), "logits must be 2-D"),
        (0, torch.zeros(3, 7, dtype=torch.int64), "logits must be floating point"),
        (0, torch.zeros(3, 0), "empty vocabulary"),
        (1, torch.ones(4), r"temperature must have shape \(3,\)"),
        (2, torch.zeros(3, 1, dtype=torch.int64), r"top_k must have shape \(3,\)"),
        (2, torch.zeros(3), "top_k must be integer"),
        (3, torch.ones(2), r"top_p must have shape \(3,\)"),
        (4, torch.zeros(1, dtype=torch.int64), r"seed must have shape \(3,\)"),
        (5, torch.zeros(5, dtype=torch.int64), r"counter must have shape \(3,\)"),
        (5, torch.zeros(3), "counter must be integer"),
    ],
)
def test_bad_inputs_raise_clear_value_errors(position, bad, message):
    args = list(_good())
    args[position] = bad
    with pytest.raises(ValueError, match=message):
        sample_rows(*args)


def test_bad_stream_and_uniform_shapes_raise():
    args = _good()
    with pytest.raises(SamplerInputError, match="stream must be in"):
        sample_rows(*args, stream=-1)
    with pytest.raises(SamplerInputError, match="stream must be in"):
        sample_rows(*args, stream=2**32)
    with pytest.raises(SamplerInputError, match=r"uniform must have shape \(3,\)"):
        draw_rows(*args[:4], torch.zeros(2))
    with pytest.raises(SamplerInputError, match="differ in shape"):
        philox_uniform(torch.zeros(3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), 0)


def test_empty_batch_gives_no_tokens():
    out = sample_rows(*_good(0))
    assert out.shape == (0,) and out.dtype == torch.int64
