"""kernels/draw.py on the CPU, under Triton's interpreter: the one-launch draw against the tensor
chain of ``stages.sampling.draw_prepared`` over the parameter grid (temperatures, top-k, top-p),
tied scores at the top-k threshold and the top-p cut, ``-inf`` logits and signed zeros, strided
parameter views; its softmax bitwise ATen's CUDA order (``softmax_warp_forward``), down to a cut
placed exactly on a cumulative probability; the refusals, and the samplers' dispatcher.

On the CPU torch's softmax sums in another order than CUDA's (and takes another ``exp``), so the
bitwise yardstick is the chain with its softmax in CUDA's order
(``kernels.draw.softmax_reference``, with NumPy's ``exp`` as the interpreter's kernel has it); the
chain itself must still draw the same tokens on these rows. tests/gpu/test_sampler_gpu.py holds
the kernel against the chain on CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omnirt.kernels import draw as kernel
from omnirt.kernels import settings
from omnirt.stages import sampling
from omnirt.stages.sampling import DrawParams, draw_params, draw_prepared

from .conftest import interpreted

TEMPERATURES = (0.0, 0.7, 1.0, 1.3)
TOP_PS = (1.0, 0.8, 0.3, 1e-4)
PARAM_FIELDS = ("sampled", "scale", "top_k", "cut")

# --- helpers (also used by tests/gpu/test_sampler_gpu.py) -----------------------------------------


def parameter_grid(vocab: int) -> list[tuple[float, int, float]]:
    """(temperature, top_k, top_p): 0 is greedy; top-k off, 1, 50, the vocabulary and past it."""
    top_ks = (0, 1, 50, vocab, vocab + 5)
    return [(t, k, p) for t in TEMPERATURES for k in top_ks for p in TOP_PS]


def draw_inputs(
    rows: int, vocab: int, seed: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[torch.Tensor, DrawParams, torch.Tensor]:
    """(logits [rows, vocab], DrawParams, uniform [rows]): the parameter grid cycled over the rows in
    a random order; the logits by ``row % 5``: spread out, nearly flat, half-integers (many tied
    scores, so ties straddle the k-th score and the top-p cut), a third ``-inf``, and signed zeros
    tied at the maximum. Some uniforms are 0 and the largest below 1."""
    gen = torch.Generator().manual_seed(seed)
    spread = torch.randn(rows, vocab, generator=gen) * (0.1 + 6 * torch.rand(rows, 1, generator=gen))
    kind = (torch.arange(rows) % 5)[:, None]
    halves = torch.randint(-6, 6, (rows, vocab), generator=gen).float() * 0.5
    gone = torch.rand(rows, vocab, generator=gen) < 0.3
    gone[:, 0] = False  # a row keeps a finite score
    zero = torch.where(torch.rand(rows, vocab, generator=gen) < 0.5, -0.0, 0.0)
    at_top = torch.rand(rows, vocab, generator=gen) < 0.2
    logits = torch.where(kind == 1, spread * 0.01, spread)
    logits = torch.where(kind == 2, halves, logits)
    logits = torch.where((kind == 3) & gone, float("-inf"), logits)
    logits = torch.where(kind == 4, torch.where(at_top, zero, -spread.abs() - 0.25), logits)
    grid = parameter_grid(vocab)
    picks = torch.randperm(rows * len(grid), generator=gen)[:rows] % len(grid)
    t, k, p = zip(*(grid[int(i)] for i in picks), strict=True)
    params = draw_params(torch.tensor(t), torch.tensor(k, dtype=torch.int64), torch.tensor(p))
    uniform = torch.rand(rows, generator=gen)
    uniform[::7] = 0.0
    uniform[3::7] = 1.0 - 2.0**-24
    moved = DrawParams(*(getattr(params, name).to(device) for name in PARAM_FIELDS))
    return logits.to(dtype).to(device), moved, uniform.to(device)


def kernel_draw(
    logits: torch.Tensor, params: DrawParams, uniform: torch.Tensor, probs: torch.Tensor | None = None
) -> torch.Tensor:
    return kernel.draw(logits, *(getattr(params, name) for name in PARAM_FIELDS), uniform, probs=probs)


def chain_softmax_input(logits: torch.Tensor, params: DrawParams) -> torch.Tensor:
    """The sorted scores, those below the k-th set to -inf, that the chain hands its softmax."""
    seen = []

    def softmax(masked: torch.Tensor) -> torch.Tensor:
        seen.append(masked.clone())
        return masked.softmax(dim=-1)

    sampling._filtered_cdf(logits, params, softmax)
    return seen[0]


def _warp_order_chain(logits: torch.Tensor, params: DrawParams, uniform: torch.Tensor) -> torch.Tensor:
    """The chain with its softmax in ATen CUDA's order: the kernel's tokens, bit for bit."""
    return sampling._draw_chain(logits, params, uniform, softmax=kernel.softmax_reference)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


# --- the tokens ----------------------------------------------------------------------------------


@interpreted
@pytest.mark.parametrize("vocab", [2048, 1000, 64, 7, 1])
def test_tokens_are_the_chains_over_the_parameter_grid(vocab):
    rows = len(parameter_grid(vocab))  # 80: every combination once, in a random order
    logits, params, uniform = draw_inputs(rows, vocab, seed=vocab)
    got = kernel_draw(logits, params, uniform)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got, _warp_order_chain(logits, params, uniform))
    assert torch.equal(got, draw_prepared(logits, params, uniform))  # torch's CPU softmax: same tokens here
    greedy = torch.argmax(logits, dim=-1)
    assert torch.equal(got[~params.sampled], greedy[~params.sampled])
    if vocab > 1:  # the draws are not all the best token
        assert bool((got[params.sampled] != greedy[params.sampled]).any())


@interpreted
@pytest.mark.parametrize("rows", [1, 37])
def test_strided_views_of_slot_buffers(rows):
    """Parameters as views of per-slot buffers (``SlotSampling.params``), a uniform column of the
    predictor's [B, 15] uniforms, logits a column slice of a wider buffer: read in place."""
    vocab = 300
    logits, params, uniform = draw_inputs(2 * rows, vocab, seed=rows)
    wide = torch.full((rows, vocab + 9), float("nan"))
    wide[:, 4 : 4 + vocab] = logits[1::2]
    views = DrawParams(*(getattr(params, name)[1::2] for name in PARAM_FIELDS))
    uniforms = torch.rand(rows, 15)
    uniforms[:, 3] = uniform[1::2]
    strided = (wide[:, 4 : 4 + vocab], views, uniforms[:, 3])
    assert strided[0].stride() == (vocab + 9, 1) and views.scale.stride(0) == 2 and strided[2].stride(0) == 15
    copies = DrawParams(*(t.contiguous() for t in vars(views).values()))
    contiguous = (strided[0].contiguous(), copies, uniform[1::2].contiguous())
    got = kernel_draw(*strided)
    assert torch.equal(got, kernel_draw(*contiguous))
    assert torch.equal(got, _warp_order_chain(*contiguous))
    transposed = logits[1::2].t().contiguous().t()  # a column stride of the batch
    assert torch.equal(kernel_draw(transposed, *contiguous[1:]), got)


@interpreted
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the NaN row's sampled path
def test_greedy_is_argmax_with_nan_ties_and_signed_zeros():
    """Greedy rows (and every row's fallback) are ``torch.argmax``: the first NaN, else the first
    maximum; -0.0 ties with +0.0; a row of -inf gives 0."""
    vocab = 40
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(1))
    logits[0, [5, 17]] = float("nan")
    logits[1, [3, 30]] = 9.0
    logits[2] = -1.0
    logits[2, [8, 9, 20]] = torch.tensor([-0.0, 0.0, -0.0])
    logits[3] = float("-inf")
    logits[4, 0] = float("inf")
    logits[5, [vocab - 1]] = 100.0
    params = draw_params(torch.zeros(6), torch.zeros(6, dtype=torch.int64), torch.ones(6))
    got = kernel_draw(logits, params, torch.rand(6))
    assert got.tolist() == [5, 3, 8, 0, 0, vocab - 1]
    assert torch.equal(got, torch.argmax(logits, dim=-1))


@interpreted
def test_ties_straddling_the_kth_score_and_the_top_p_cut():
    """Ten tied best scores of 64: top-k 4 keeps all ten (ties with the k-th are kept); top-p 0.45
    cuts inside the tie, keeping the lowest ids among them; every uniform draws the chain's token."""
    vocab, rows = 64, 120
    row = torch.linspace(-9.0, -3.0, vocab)
    tied = torch.tensor([2, 7, 11, 19, 23, 31, 40, 41, 50, 63])
    row[tied] = 1.5
    logits = row.expand(rows, vocab).contiguous()
    top_k = torch.tensor([4, 0, 4, 0] * 30)
    top_p = torch.tensor([1.0, 0.45, 0.45, 0.05] * 30)
    params = draw_params(torch.full((rows,), 0.9), top_k, top_p)
    uniform = (torch.arange(rows) + 0.5) / rows
    got = kernel_draw(logits, params, uniform)
    assert torch.equal(got, _warp_order_chain(logits, params, uniform))
    assert torch.equal(got, draw_prepared(logits, params, uniform))
    assert set(got[0::4].tolist()) == set(tied.tolist())  # top-k 4 keeps the whole tie
    kept = set(got[1::4].tolist()) | set(got[2::4].tolist())
    assert kept and kept < set(tied.tolist())
    assert kept == set(tied[: len(kept)].tolist())  # the lowest ids of the tie
    assert set(got[3::4].tolist()) == {2}  # the best token alone


# --- the softmax: ATen's CUDA order, bit for bit -----------------------------------------------


def _other_orders(masked: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same softmax summed or divided otherwise: each differs from the reference somewhere on
    the test's rows, so a kernel that sums or divides so fails it."""
    x = masked.numpy()
    with np.errstate(invalid="ignore"):
        e = np.exp(x - x.max(axis=1, keepdims=True))
        sequential = np.zeros((x.shape[0], 1), dtype=np.float32)
        for j in range(x.shape[1]):
            sequential = sequential + e[:, j : j + 1]
        lanes, iters = kernel.warp_layout(x.shape[1])
        padded = np.zeros((x.shape[0], lanes * iters), dtype=np.float32)
        padded[:, : x.shape[1]] = e
        items = padded.reshape(-1, iters, lanes)
        while items.shape[1] > 1:  # each lane's items halved, rather than in order
            half = items.shape[1] // 2
            items = items[:, :half] + items[:, half:]
        warp = items[:, 0]
        while warp.shape[1] > 1:
            half = warp.shape[1] // 2
            warp = warp[:, :half] + warp[:, half:]
        in_order = np.zeros((x.shape[0], lanes), dtype=np.float32)
        for it in range(iters):  # the reference's lane sums, to build its reciprocal
            in_order = in_order + padded[:, it * lanes : (it + 1) * lanes]
        while in_order.shape[1] > 1:
            half = in_order.shape[1] // 2
            in_order = in_order[:, :half] + in_order[:, half:]
        others = {
            "sequential sum": torch.from_numpy(e / sequential),
            "pairwise sum": torch.from_numpy(e / e.sum(axis=1, dtype=np.float32, keepdims=True)),
            "times the reciprocal": torch.from_numpy(e * (np.float32(1.0) / in_order)),
            "torch": masked.softmax(dim=-1),
        }
        if iters > 2:  # (over two items a tree is the order)
            others["each lane's items halved"] = torch.from_numpy(e / warp)
        return others


@interpreted
@pytest.mark.parametrize("vocab", [2048, 1000, 64])
def test_probabilities_are_the_warp_order_softmax_bitwise(vocab):
    rows = 48
    logits, params, uniform = draw_inputs(rows, vocab, seed=100 + vocab)
    probs = torch.full((rows, vocab), float("nan"))
    got = kernel_draw(logits, params, uniform, probs=probs)
    masked = chain_softmax_input(logits, params)
    want = kernel.softmax_reference(masked)
    assert torch.equal(_bits(probs), _bits(want))
    _, cdf, _ = sampling._filtered_cdf(logits, params, kernel.softmax_reference)
    assert torch.equal(torch.cumsum((probs * 2.0**kernel.CDF_BITS).long(), -1), cdf)
    assert torch.equal(got, _warp_order_chain(logits, params, uniform))
    for name, other in _other_orders(masked).items():
        assert not torch.equal(_bits(other), _bits(want)), name


@interpreted
@pytest.mark.parametrize("vocab", [2048, 1000])
def test_a_cut_on_a_cumulative_probability_decides_the_token(vocab):
    """Top-p's cut placed exactly on the CDF at a kept position ``j`` (and one below), uniform 0:
    the token is sorted position ``j + 1`` or ``j``, so one unit of the fixed-point CDF (an ulp of
    any probability up to ``j``) moves it. The kernel draws the warp-order chain's tokens; torch's
    CPU softmax, summed in another order, misses some."""
    rows = 40
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows, vocab, generator=gen) * 2
    plain = draw_params(torch.ones(rows), torch.zeros(rows, dtype=torch.int64), torch.ones(rows))
    order, cdf, _ = sampling._filtered_cdf(logits, plain, kernel.softmax_reference)
    at = vocab - 2 - torch.arange(rows) % 30  # kept positions near the top, where each step is wide
    on_cdf = cdf.gather(1, at[:, None])
    uniform = torch.zeros(rows)
    drawn = {}
    for name, cut in (("on", on_cdf), ("below", on_cdf - 1)):
        params = DrawParams(plain.sampled, plain.scale, plain.top_k, cut)
        got = kernel_draw(logits, params, uniform)
        want = _warp_order_chain(logits, params, uniform)
        assert torch.equal(got, want), name
        position = at + (1 if name == "on" else 0)
        assert torch.equal(got, vocab - 1 - order.gather(1, position[:, None])[:, 0]), name
        drawn[name] = (got, draw_prepared(logits, params, uniform))
    assert bool((drawn["on"][0] != drawn["below"][0]).all())
    misses = sum(int((chain != got).sum()) for got, chain in drawn.values())
    assert misses > 0  # the summation order shows in the tokens


# --- refusals, the empty batch, the dispatcher ---------------------------------------------------


def _good(rows: int = 3, vocab: int = 16) -> dict[str, torch.Tensor]:
    params = draw_params(torch.ones(rows), torch.zeros(rows, dtype=torch.int64), torch.ones(rows))
    return dict(logits=torch.randn(rows, vocab), **vars(params), uniform=torch.rand(rows))


@pytest.mark.parametrize(
    ("name", "bad", "message"),
    [
        ("logits", torch.randn(16), "2-D"),
        ("logits", torch.randn(3, 16, dtype=torch.float64), "float32, float16 or bfloat16"),
        ("logits", torch.randn(3, 2049), "1 to 2048"),
        ("logits", torch.randn(3, 0), "1 to 2048"),
        ("sampled", torch.ones(3, dtype=torch.int64), "sampled must be torch.bool"),
        ("sampled", torch.ones(4, dtype=torch.bool), "sampled must have shape \\(3,\\)"),
        ("scale", torch.ones(3), "scale must have shape \\(3, 1\\)"),
        ("scale", torch.ones(3, 1, dtype=torch.float64), "scale must be torch.float32"),
        ("top_k", torch.zeros(3, dtype=torch.int32), "top_k must be torch.int64"),
        ("cut", torch.zeros(3, dtype=torch.int64), "cut must have shape \\(3, 1\\)"),
        ("cut", torch.zeros(3, 1), "cut must be torch.int64"),
        ("uniform", torch.rand(3, dtype=torch.float64), "uniform must be torch.float32"),
        ("uniform", torch.rand(3, 1), "uniform must have shape \\(3,\\)"),
    ],
)
def test_refuses_what_it_does_not_take(name, bad, message):
    args = _good()
    args[name] = bad
    with pytest.raises(ValueError, match=message):
        kernel.draw(*args.values())
    assert not kernel.kernel_applies(*args.values())


def test_refuses_probs_of_another_shape():
    with pytest.raises(ValueError, match="probs must have shape \\(3, 16\\)"):
        kernel.draw(*_good().values(), probs=torch.empty(3, 15))


def test_warp_layout_is_atens():
    assert [kernel.warp_layout(v) for v in (1, 2, 7, 32, 33, 64, 1000, 1024, 2048)] == [
        (1, 1), (2, 1), (8, 1), (32, 1), (32, 2), (32, 2), (32, 32), (32, 32), (32, 64)
    ]  # fmt: skip


@interpreted
def test_no_rows():
    args = _good(rows=0)
    got = kernel.draw(*args.values())
    assert got.shape == (0,) and got.dtype == torch.int64


def test_the_dispatcher_runs_the_chain_off_cuda_and_when_off():
    logits, params, uniform = draw_inputs(10, 64, seed=4)
    tensors = [getattr(params, name) for name in PARAM_FIELDS]
    assert not kernel.kernel_applies(logits, *tensors, uniform)  # CPU tensors: never from a dispatcher
    assert torch.equal(draw_prepared(logits, params, uniform), sampling._draw_chain(logits, params, uniform))
    before = settings.FUSED
    settings.set_fused("off")
    try:
        assert not kernel.kernel_applies(logits, *tensors, uniform)
    finally:
        settings.set_fused(before)


@interpreted
def test_the_dispatcher_hands_the_kernel_the_parameters_where_it_applies(monkeypatch):
    """Where the kernel applies (CUDA), ``draw_prepared`` returns its tokens for the same tensors;
    the row checks come first."""
    logits, params, uniform = draw_inputs(9, 64, seed=5)
    calls = []
    monkeypatch.setattr(kernel, "kernel_applies", lambda *args: calls.append(args) or True)
    got = draw_prepared(logits, params, uniform)
    assert torch.equal(got, kernel_draw(logits, params, uniform))
    handed = (logits, *vars(params).values(), uniform)
    assert len(calls) == 1 and all(a is b for a, b in zip(calls[0], handed, strict=True))
    with pytest.raises(sampling.SamplerInputError, match="rows"):
        draw_prepared(logits, params, uniform[:5])
