"""The batched sampler on CUDA: Philox known answers, no host syncs, CUDA-graph replay equal to eager,
the same token for a row alone and in a batch at the real vocabulary, and CUDA tokens against CPU;
the one-launch draw (kernels/draw.py) bit for bit the tensor chain on CUDA, its softmax ATen's.

Run on the lent GPU: ``pytest -m gpu -s tests/gpu/test_sampler_gpu.py``. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from omnirt.kernels import draw as draw_kernel
from omnirt.stages.sampling import (
    DrawParams,
    _draw_chain,
    _filtered_cdf,
    draw_params,
    draw_prepared,
    philox4x32,
    philox_uniform,
    sample_rows,
)

from tests.kernels.test_draw import PARAM_FIELDS, chain_softmax_input, draw_inputs, kernel_draw
from tests.speech.test_sampler import PHILOX_KAT, float64_draw_agrees, mixed_params, philox_python

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

VOCAB = 152064  # the Qwen3-Omni thinker vocabulary


def _inputs(rows: int, vocab: int, seed: int, dtype: torch.dtype = torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
    return logits.cuda(), mixed_params(rows, gen, "cuda")


@pytest.mark.parametrize(("ctr", "key", "want"), PHILOX_KAT)
def test_philox_known_answers_on_cuda(ctr, key, want):
    words = [torch.tensor([v], dtype=torch.int64, device="cuda") for v in (*key, *ctr)]
    assert [int(w) for w in philox4x32(*words)] == list(want)


def test_philox_on_cuda_equals_cpu():
    gen = torch.Generator().manual_seed(1)
    words = torch.randint(0, 2**32, (6, 4096), generator=gen, dtype=torch.int64)
    cpu = torch.stack(philox4x32(*words))
    assert torch.equal(torch.stack(philox4x32(*words.cuda())).cpu(), cpu)
    for i in range(0, 4096, 512):
        assert cpu[:, i].tolist() == philox_python(
            (int(words[0, i]), int(words[1, i])), tuple(int(w) for w in words[2:, i])
        )
    seed, counter = words[0] - 2**31, words[1] * 1000
    assert torch.equal(philox_uniform(seed.cuda(), counter.cuda(), 5).cpu(), philox_uniform(seed, counter, 5))


def test_sample_rows_makes_no_host_sync():
    logits, params = _inputs(32, VOCAB, seed=0)
    sample_rows(logits, *params)  # first call: lazy CUDA initialisation outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = sample_rows(logits, *params)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tokens.shape == (32,) and tokens.dtype == torch.int64 and tokens.is_cuda


def test_graph_replay_equals_eager():
    rows = 32
    logits, (temperature, top_k, top_p, seed, counter) = _inputs(rows, VOCAB, seed=1)
    steps = [_inputs(rows, VOCAB, seed=100 + step)[0] for step in range(5)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the capture stream (allocator, lazy kernels)
        for _ in range(3):
            sample_rows(logits, temperature, top_k, top_p, seed, counter)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sample_rows(logits, temperature, top_k, top_p, seed, counter)
    start = counter.clone()
    replays = []
    for step, new_logits in enumerate(steps):
        logits.copy_(new_logits)  # new logits and counters copied into the static inputs
        counter.copy_(start + step + 1)
        graph.replay()
        torch.cuda.set_sync_debug_mode("error")
        try:
            eager = sample_rows(logits, temperature, top_k, top_p, seed, counter)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(captured, eager), step
        replays.append(captured.clone())
    sampled = temperature > 0
    assert not torch.equal(replays[0][sampled], replays[1][sampled])  # the counters moved the draws


@pytest.mark.parametrize("vocab", [VOCAB, 3072, 2048, 1000])  # thinker, talker, code predictor, small
def test_same_token_alone_and_anywhere_in_a_batch_on_cuda(vocab):
    logits, params = _inputs(32, vocab, seed=2)
    logits[:4, : vocab // 2] = logits[:4, vocab // 2 : 2 * (vocab // 2)]  # ties in some rows
    batch = sample_rows(logits, *params)
    for i in range(32):
        alone = sample_rows(logits[i : i + 1].clone(), *(p[i : i + 1].clone() for p in params))
        assert int(alone[0]) == int(batch[i]), i
    perm = torch.randperm(32, device="cuda")
    assert torch.equal(sample_rows(logits[perm], *(p[perm] for p in params)), batch[perm])
    big = torch.cat([logits] * 8)  # 256 rows: other kernel configurations for the batch
    assert torch.equal(sample_rows(big, *(torch.cat([p] * 8) for p in params))[:32], batch)


def test_cuda_tokens_match_cpu_tokens():
    """Same float32 logits on both devices. The sort, the integer CDF and the draw are exact, but the
    softmax (exp and its row sum) may differ by an ulp between the CPU and CUDA kernels, which moves
    the fixed-point CDF by ~1e-7: a uniform that close to a CDF step (or a top-p cut that close to a
    cumulative) may pick the neighbouring token. So: nearly every row equal, and every row on both
    devices where the float64 inverse CDF puts it within 1e-5."""
    rows, vocab = 2048, 64
    logits, params = _inputs(rows, vocab, seed=3, dtype=torch.float32)
    cuda = sample_rows(logits, *params).cpu()
    cpu_params = [p.cpu() for p in params]
    cpu = sample_rows(logits.cpu(), *cpu_params)
    assert int((cuda == cpu).sum()) >= rows - 4
    temperature, top_k, top_p, seed, counter = cpu_params
    uniforms = philox_uniform(seed, counter, 0)
    for i in range(rows):
        t, k, p, u = float(temperature[i]), int(top_k[i]), float(top_p[i]), float(uniforms[i])
        for token in (int(cpu[i]), int(cuda[i])):
            assert float64_draw_agrees(token, logits[i].cpu(), t, k, p, u, tol=1e-5), i


def test_philox_kernel_is_the_tensor_chain_and_replays_from_a_graph():
    """kernels/philox.py on CUDA: the samplers' dispatcher takes it, its uniforms are the tensor
    chain's bits (negative seeds, counters past 2**62, the predictor's 15 draws a row), and a
    captured launch reads new counters on replay."""
    from omnirt.kernels.philox import kernel_applies
    from omnirt.stages.sampling import philox_uniforms

    gen = torch.Generator().manual_seed(11)
    seeds = torch.randint(-(2**63), 2**63 - 1, (128,), generator=gen, dtype=torch.int64).cuda()
    counters = torch.randint(0, 2**40, (128,), generator=gen, dtype=torch.int64).cuda()
    counters[0] = 2**62 + 5

    def chain(draws: int, stream: int) -> torch.Tensor:
        count = counters[:, None] * draws + torch.arange(draws, device="cuda")
        return philox_uniform(seeds[:, None].expand(128, draws), count, stream)

    for draws, stream in ((1, 0), (15, 2), (7, 2**32 - 1)):
        assert kernel_applies(seeds, counters, draws, stream)
        assert torch.equal(philox_uniforms(seeds, counters, draws, stream), chain(draws, stream))
    philox_uniforms(seeds, counters, 15, 2)  # compiled before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = philox_uniforms(seeds, counters, 15, 2)
    for _ in range(3):
        counters.add_(1)
        graph.replay()
        assert torch.equal(out, chain(15, 2))


# --- kernels/draw.py: the code predictor's draw in one launch ---------------------------------------


def _draw_batches(vocab: int, dtype: torch.dtype, seed: int, sizes=(128,) * 24 + (37, 1)):
    """``draw_inputs`` batches on CUDA (3110 rows by default): the parameter grid over spread, flat,
    tied, partly -inf and signed-zero logits."""
    for i, rows in enumerate(sizes):
        yield draw_inputs(rows, vocab, seed=seed + i, dtype=dtype, device="cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [2048, 1000, 64])
def test_draw_kernel_is_the_cuda_chain(vocab, dtype):
    """kernels/draw.py against ``draw_prepared``'s tensor chain on CUDA (ATen's sort, softmax,
    cumsum ...), token for token, over the grid of temperatures (0, 0.7, 1, 1.3), top-k (off, 1, 50,
    V, V + 5) and top-p (1, 0.8, 0.3, 1e-4); the dispatcher takes the kernel."""
    drawn = moved = 0
    for logits, params, uniform in _draw_batches(vocab, dtype, seed=vocab):
        tensors = [getattr(params, name) for name in PARAM_FIELDS]
        assert draw_kernel.kernel_applies(logits, *tensors, uniform)
        got = kernel_draw(logits, params, uniform)
        want = _draw_chain(logits, params, uniform)
        assert torch.equal(got, want), (got != want).nonzero()[:, 0].tolist()
        assert torch.equal(draw_prepared(logits, params, uniform), got)
        drawn += int(params.sampled.sum())
        moved += int((got != torch.argmax(logits, dim=-1)).sum())
    assert moved > drawn // 4  # draws, not only the best token


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [2048, 1025, 1000, 64, 7])
def test_draw_kernel_softmax_is_atens_bitwise(vocab, dtype):
    """The kernel's probabilities are ``torch.softmax``'s on CUDA bit for bit (``softmax_warp_forward``:
    its summation order, ``expf``, the IEEE division), on the scores the chain hands it."""
    for logits, params, uniform in _draw_batches(vocab, dtype, seed=10 * vocab, sizes=(128,) * 4 + (5,)):
        probs = torch.full(logits.shape, float("nan"), device="cuda")
        kernel_draw(logits, params, uniform, probs=probs)
        want = chain_softmax_input(logits, params).softmax(dim=-1)
        assert torch.equal(probs.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("vocab", [2048, 1000])
def test_draw_kernel_at_a_cut_on_the_cuda_cdf(vocab):
    """Top-p's cut exactly on the chain's CUDA CDF at a kept position (and one below), uniform 0: one
    unit of the fixed-point CDF moves the token, and the kernel's is the chain's."""
    rows = 128
    gen = torch.Generator().manual_seed(vocab)
    for dtype in (torch.bfloat16, torch.float32):
        logits = (torch.randn(rows, vocab, generator=gen) * 2).to(dtype).cuda()
        ones = torch.ones(rows, device="cuda")
        plain = draw_params(ones, torch.zeros(rows, dtype=torch.int64, device="cuda"), ones)
        _, cdf, _ = _filtered_cdf(logits, plain)
        on_cdf = cdf.gather(1, (vocab - 2 - torch.arange(rows, device="cuda") % 30)[:, None])
        uniform = torch.zeros(rows, device="cuda")
        drawn = []
        for cut in (on_cdf, on_cdf - 1):
            params = DrawParams(plain.sampled, plain.scale, plain.top_k, cut)
            got = kernel_draw(logits, params, uniform)
            assert torch.equal(got, _draw_chain(logits, params, uniform))
            drawn.append(got)
        assert bool((drawn[0] != drawn[1]).all())


def test_draw_kernel_reads_strided_views_on_cuda():
    """Parameters as every other row of slot buffers, uniforms a column of [B, 15], logits a column
    slice of a wider buffer: the tokens of contiguous copies, and the chain's."""
    rows, vocab = 37, 2048
    logits, params, uniform = draw_inputs(2 * rows, vocab, seed=3, dtype=torch.bfloat16, device="cuda")
    wide = torch.full((rows, vocab + 9), float("nan"), dtype=torch.bfloat16, device="cuda")
    wide[:, 4 : 4 + vocab] = logits[1::2]
    views = DrawParams(*(getattr(params, name)[1::2] for name in PARAM_FIELDS))
    uniforms = torch.rand(rows, 15, device="cuda")
    uniforms[:, 3] = uniform[1::2]
    got = kernel_draw(wide[:, 4 : 4 + vocab], views, uniforms[:, 3])
    copies = DrawParams(*(t.contiguous() for t in vars(views).values()))
    assert torch.equal(got, kernel_draw(logits[1::2].contiguous(), copies, uniform[1::2].contiguous()))
    assert torch.equal(got, _draw_chain(wide[:, 4 : 4 + vocab], views, uniforms[:, 3]))


def test_draw_kernel_refuses_3000_and_the_dispatcher_falls_back():
    logits, params, uniform = draw_inputs(64, 3000, seed=7, dtype=torch.bfloat16, device="cuda")
    tensors = [getattr(params, name) for name in PARAM_FIELDS]
    assert not draw_kernel.kernel_applies(logits, *tensors, uniform)
    with pytest.raises(ValueError, match="1 to 2048"):
        draw_kernel.draw(logits, *tensors, uniform)
    assert torch.equal(draw_prepared(logits, params, uniform), _draw_chain(logits, params, uniform))


def test_draw_kernel_replays_from_a_graph_and_makes_no_host_sync():
    """The code predictor's use: per-slot parameters (``SlotSampling`` views), 15 draws a frame from
    one Philox call's uniforms, captured in a CUDA graph. Replays with new logits and counters draw
    the chain's tokens; an eager frame makes no host sync."""
    from omnirt.stages.draws import PREDICTOR_STREAM, SlotSampling

    rows, vocab, groups = 8, 2048, 15
    slots = SlotSampling(rows + 4, torch.device("cuda"))
    for i in range(rows):
        slots.set(i, temperature=(0.0, 0.9, 1.0, 0.7)[i % 4], top_k=(0, 50, 0, 5)[i % 4],
                  top_p=(1.0, 0.8, 0.9, 1.0)[i % 4], seed=1000 + i)  # fmt: skip
    gen = torch.Generator().manual_seed(12)
    logits = (torch.randn(groups, rows, vocab, generator=gen) * 3).to(torch.bfloat16).cuda()
    params = slots.params(slice(0, rows))
    column = slots.uniforms(rows, groups, PREDICTOR_STREAM)[:, 0]  # a strided view, as the predictor's
    assert draw_kernel.kernel_applies(logits[0], *(getattr(params, n) for n in PARAM_FIELDS), column)

    def frame() -> torch.Tensor:
        uniforms = slots.uniforms(rows, groups, PREDICTOR_STREAM)
        return torch.stack([slots.draw_with(logits[g], uniforms[:, g]) for g in range(groups)])

    def chain() -> torch.Tensor:
        uniforms = slots.uniforms(rows, groups, PREDICTOR_STREAM)
        return torch.stack([_draw_chain(logits[g], params, uniforms[:, g]) for g in range(groups)])

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the capture stream (compilation, allocator)
        for _ in range(3):
            frame()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = frame()
    replays = []
    active = torch.ones(rows, dtype=torch.bool, device="cuda")
    for _ in range(4):
        logits.copy_((torch.randn(groups, rows, vocab, generator=gen) * 3).to(torch.bfloat16))
        slots.advance(active)
        graph.replay()
        assert torch.equal(captured, chain())
        assert torch.equal(captured, frame())
        replays.append(captured.clone())
    sampled = torch.tensor([i % 4 != 0 for i in range(rows)], device="cuda")
    assert not torch.equal(replays[0][:, sampled], replays[1][:, sampled])  # new logits and counters
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        frame()
    finally:
        torch.cuda.set_sync_debug_mode("default")
