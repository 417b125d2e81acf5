"""kernels/moe_route.py on the CPU: the grouping kernel under Triton's interpreter against
transformers' sort-based grouping (the same groups, stable, the inverse, the ends), the checks,
the dispatcher, and the speech models' experts falling back to transformers' forward where the
kernel does not run."""

from __future__ import annotations

import pytest
import torch
from omnirt.kernels.moe_route import (
    MAX_PAIRS,
    group_by_expert,
    group_by_expert_reference,
    group_by_expert_triton,
    kernel_applies,
)

from .conftest import interpreted


def _check(ids: torch.Tensor, experts: int, grouping, stable: bool = True) -> None:
    perm, inverse, ends = grouping
    ref_perm, _, ref_ends = group_by_expert_reference(ids, experts)
    assert perm.dtype == inverse.dtype == torch.int64 and ends.dtype == torch.int32
    assert torch.equal(ends, ref_ends)
    assert torch.equal(ids[perm], ids[ref_perm])  # grouped by expert, ascending
    assert torch.equal(inverse[perm], torch.arange(ids.shape[0]))
    for e in ids.unique() if stable else ():
        mine = perm[ids[perm] == e]
        assert bool(torch.all(mine[1:] > mine[:-1]))  # stable within an expert


@interpreted
@pytest.mark.parametrize(
    ("pairs", "experts"),
    [(1, 4), (8, 4), (37 * 6, 128), (128 * 8, 128), (1000, 60), (MAX_PAIRS, 128)],
)
def test_the_kernel_groups_as_the_sort_does(pairs: int, experts: int) -> None:
    g = torch.Generator().manual_seed(pairs)
    ids = torch.randint(0, experts, (pairs,), generator=g)
    _check(ids, experts, group_by_expert_triton(ids, experts))


@interpreted
def test_experts_no_pair_chose_end_where_the_last_group_ends() -> None:
    ids = torch.tensor([5, 5, 0, 7, 5, 0])
    perm, _, ends = group_by_expert_triton(ids, 9)
    assert ends.tolist() == [2, 2, 2, 2, 2, 5, 5, 6, 6]
    assert perm.tolist() == [2, 5, 0, 1, 4, 3]


@interpreted
def test_the_custom_op_schema_and_fake() -> None:
    ids = torch.randint(0, 8, (40,))
    torch.library.opcheck(
        torch.ops.omnirt.group_by_expert.default, (ids, 8), test_utils=("test_schema", "test_faketensor")
    )
    perm, inverse, ends = torch.ops.omnirt.group_by_expert(ids, 8)
    _check(ids, 8, (perm, inverse, ends))


def test_the_dispatcher_sorts_on_the_cpu_and_refuses_what_the_kernel_cannot_take() -> None:
    ids = torch.randint(0, 16, (64,))
    assert not kernel_applies(ids)  # CPU tensors never reach the kernel from the dispatcher
    _check(ids, 16, group_by_expert(ids, 16), stable=False)  # torch.sort's order
    with pytest.raises(ValueError, match="flat"):
        group_by_expert(ids.view(8, 8), 16)
    with pytest.raises(ValueError, match=f"1 to {MAX_PAIRS} pairs"):
        group_by_expert_triton(torch.zeros(MAX_PAIRS + 1, dtype=torch.long), 4)


def test_the_speech_experts_run_transformers_grouped_mm_where_the_kernel_does_not() -> None:
    """On the CPU the registered experts give transformers' ``grouped_mm`` output bitwise (its
    own forward runs)."""
    from omnirt.stages.speech.experts import IMPLEMENTATION, grouped_experts_forward
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, grouped_mm_experts_forward
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTextConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextExperts

    assert ALL_EXPERTS_FUNCTIONS[IMPLEMENTATION] is grouped_experts_forward
    config = Qwen3OmniMoeTextConfig(
        hidden_size=32, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2
    )
    experts = Qwen3OmniMoeThinkerTextExperts(config)
    g = torch.Generator().manual_seed(0)
    for p in experts.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.1
    x = torch.randn(5, 32, generator=g)
    index = torch.randint(0, 8, (5, 2), generator=g)
    weights = torch.rand(5, 2, generator=g)
    assert torch.equal(grouped_experts_forward(experts, x, index, weights),
                       grouped_mm_experts_forward(experts, x, index, weights))
