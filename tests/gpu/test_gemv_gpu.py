"""kernels/gemv.py on the GPU (marker ``gpu``; results in docs/benchmarks.md): few-row products at
the code predictor's and talker's real shapes against the fp32 product of the same inputs (one
rounding: within one output ulp), the gated unit read in as ``kernels/swiglu.py`` rounds it, the
same bits on every call, and replay from a CUDA graph tracking new inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from omnirt.kernels.gemv import gemv
from omnirt.kernels.swiglu import swiglu

from .speech_decoders import code_predictor_decoder

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# (N, K, gated): code predictor qkv, o, gate_up, down; talker qkv, o
SHAPES = [(4096, 1024, False), (1024, 2048, False), (6144, 1024, False), (1024, 3072, True),
          (2560, 1024, False)]  # fmt: skip


def _inputs(rows: int, n: int, k: int, gated: bool, dtype: torch.dtype, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, 2 * k if gated else k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(dtype)
    return x, w


def _fp32_product(x: torch.Tensor, w: torch.Tensor, gated: bool) -> torch.Tensor:
    if gated:
        k = x.shape[1] // 2
        x = swiglu(x[:, :k], x[:, k:])  # the rounded gated unit the kernel reads
    return F.linear(x.double(), w.double())


@pytest.mark.parametrize("split", [1, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 3, 8, 16])
@pytest.mark.parametrize(("n", "k", "gated"), SHAPES)
def test_one_rounding_of_the_exact_product(n, k, gated, rows, dtype, split):
    x, w = _inputs(rows, n, k, gated, dtype, seed=rows + n)
    launch = (16, 256, 4, 3, split)
    got = gemv(x, w, gated=gated, launch=launch)
    want = _fp32_product(x, w, gated)
    # fp32 accumulation over K, one rounding: the error is the output's half ulp plus the sum's
    ulp = torch.finfo(dtype).eps * want.abs()
    slack = 64 * torch.finfo(torch.float32).eps * (x.float().abs().max() * w.float().abs().sum(1))
    assert ((got.double() - want).abs() <= ulp + slack.double()).all()
    for _ in range(3):  # the same bits on every call (split parts added in one order)
        assert torch.equal(got, gemv(x, w, gated=gated, launch=launch))


@pytest.mark.parametrize("split", [1, 4])
@pytest.mark.parametrize(("n", "k", "gated"), SHAPES[:2] + SHAPES[3:4])
def test_graph_replay_tracks_new_inputs(n, k, gated, split):
    x, w = _inputs(8, n, k, gated, torch.bfloat16, seed=5)
    launch = (16, 256, 4, 3, split)
    static = x.clone()
    for _ in range(2):
        gemv(static, w, gated=gated, launch=launch)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv(static, w, gated=gated, launch=launch)
        again = gemv(static, w, gated=gated, launch=launch)  # the counters reset within a replay
    for seed in (6, 7, 8):
        fresh, _ = _inputs(8, n, k, gated, torch.bfloat16, seed=seed)
        static.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        want = gemv(fresh, w, gated=gated, launch=launch)
        assert torch.equal(out, want) and torch.equal(again, want)


def test_one_row_decoder_step_takes_the_kernel_for_the_attention_output(monkeypatch):
    """A ``SlotDecoder`` step of one slot at the code predictor's real shapes (random weights, bf16)
    runs each layer's attention output through the kernel (``MergedLayer.attention_output``) and
    stays within bf16 rounding of the step through ``o_proj`` (cuBLAS); at two rows, cuBLAS."""
    from omnirt.kernels import settings
    from omnirt.stages.speech import merged

    decoder = code_predictor_decoder(layers=3, slots=2)
    calls = {"kernel": 0}
    kernel = merged.few_rows.gemv

    def counted(*args, **kwargs):
        calls["kernel"] += 1
        return kernel(*args, **kwargs)

    monkeypatch.setattr(merged.few_rows, "gemv", counted)
    g = torch.Generator(device="cuda").manual_seed(1)
    for rows, want_calls in ((1, 3), (2, 0)):
        x = torch.randn(rows, 1024, device="cuda", generator=g).to(torch.bfloat16)
        active = torch.ones(rows, dtype=torch.bool, device="cuda")
        positions = torch.zeros(rows, dtype=torch.long, device="cuda")
        outs = []
        for setting in ("auto", "off"):
            monkeypatch.setattr(settings, "FUSED", setting)
            decoder.lengths.zero_()
            calls["kernel"] = 0
            outs.append(decoder.step(x, positions, active, 17).float())
            assert calls["kernel"] == (want_calls if setting == "auto" else 0)
        torch.testing.assert_close(outs[0], outs[1], rtol=0.05, atol=0.05)
