"""kernels/moe_route.py on the GPU (marker ``gpu``; results in docs/benchmarks.md): the grouping
kernel against ``torch.sort``'s grouping, and the speech models' experts
(``stages/speech/experts.py``) against transformers' ``grouped_mm`` experts, bitwise, at the real
thinker's and talker's expert shapes, from one token to a batched prompt piece, eagerly and
replayed from a CUDA graph; the time a 128-row layer's experts take both ways is printed."""

from __future__ import annotations

import time

import pytest
import torch
from omnirt.kernels.moe_route import MAX_PAIRS, group_by_expert, group_by_expert_reference, kernel_applies

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("experts", [4, 60, 128])
@pytest.mark.parametrize("pairs", [1, 6, 48, 1024, 1536, 4096, MAX_PAIRS])
def test_the_kernel_groups_as_the_sort_does_on_the_gpu(pairs: int, experts: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(pairs + experts)
    ids = torch.randint(0, experts, (pairs,), device="cuda", generator=g)
    assert kernel_applies(ids)
    perm, inverse, ends = group_by_expert(ids, experts)
    ref_perm, _, ref_ends = group_by_expert_reference(ids, experts)
    assert torch.equal(ends, ref_ends) and torch.equal(ids[perm], ids[ref_perm])
    assert torch.equal(inverse[perm], torch.arange(pairs, device="cuda"))
    assert torch.equal(perm, torch.sort(ids, stable=True).indices)  # stable


def _experts(kind: str):
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTextConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextExperts

    # the published config's thinker and talker experts
    hidden, inner, top = (2048, 768, 8) if kind == "thinker" else (1024, 384, 6)
    config = Qwen3OmniMoeTextConfig(
        hidden_size=hidden, moe_intermediate_size=inner, num_experts=128, num_experts_per_tok=top
    )
    experts = Qwen3OmniMoeThinkerTextExperts(config).to("cuda", torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(1)
    for p in experts.parameters():
        p.data.normal_(0, 0.02, generator=g)
    return experts, hidden, top


@pytest.mark.parametrize("kind", ["thinker", "talker"])
def test_the_speech_experts_equal_transformers_grouped_mm_bitwise(kind: str) -> None:
    from omnirt.stages.speech.experts import grouped_experts_forward
    from transformers.integrations.moe import grouped_mm_experts_forward

    experts, hidden, top = _experts(kind)
    g = torch.Generator(device="cuda").manual_seed(2)
    timings = {}
    with torch.no_grad():
        for tokens in (1, 8, 32, 128, 1024):
            x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
            logits = torch.randn(tokens, 128, device="cuda", generator=g)
            weights, index = torch.topk(logits.softmax(-1), top, dim=-1)
            weights = (weights / weights.sum(-1, keepdim=True)).to(torch.bfloat16)
            want = grouped_mm_experts_forward(experts, x, index, weights)
            got = grouped_experts_forward(experts, x, index, weights)
            assert torch.equal(got, want), f"{kind}, {tokens} tokens"
            static = {"x": x.clone(), "index": index.clone(), "weights": weights.clone()}
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                grouped_experts_forward(experts, static["x"], static["index"], static["weights"])
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph):
                out = grouped_experts_forward(experts, static["x"], static["index"], static["weights"])
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want), f"{kind}, {tokens} tokens: graph"
            if tokens == 128:
                for name, fn in (("sort", grouped_mm_experts_forward), ("kernel", grouped_experts_forward)):
                    for _ in range(3):
                        fn(experts, x, index, weights)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(20):
                        fn(experts, x, index, weights)
                    torch.cuda.synchronize()
                    timings[name] = (time.perf_counter() - t0) / 20 * 1e3
    print(f"\n[gpu] {kind} experts, 1 to 1024 tokens: == grouped_mm bitwise (eager and graph); 128 tokens "
          f"eager: sort {timings['sort']:.3f} ms, kernel {timings['kernel']:.3f} ms")
