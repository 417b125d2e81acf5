"""A MoE layer's (token, expert) pairs grouped by expert in one launch.

transformers' ``grouped_mm`` experts sort the flat expert ids of a step's pairs (``torch.sort``),
count them per expert (``torch.histc``, ``torch.cumsum``) and invert the permutation (``arange``
and a scatter) around the two grouped matmuls. In a decode step of a few rows those are five
launches a layer, the sort alone 27 us on the H200 at 128 rows (a radix sort's fixed passes):
7% of the GPU time of a 128-session tick (``docs/benchmarks.md``). Here one program loads the
ids, sorts ``expert * BLOCK + index`` in registers (so the order is stable), and writes the
permutation, its inverse and the per-expert end offsets.

The grouped matmuls compute each row alone, whatever its place in its expert's group, so the
experts' output is bitwise the same as with ``torch.sort``'s order (``tests/gpu``).
"""

from __future__ import annotations

import torch

from . import settings
from .settings import HAVE_TRITON, kernel_device

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _group_kernel(ids_ptr, perm_ptr, inv_ptr, ends_ptr, pairs, EXPERTS: tl.constexpr,
                      BINS: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        valid = i < pairs
        expert = tl.load(ids_ptr + i, mask=valid, other=EXPERTS).to(tl.int32)
        key = tl.sort(expert * BLOCK + i)  # padding (expert EXPERTS) sorts last
        perm = key % BLOCK
        tl.store(perm_ptr + i, perm.to(tl.int64), mask=valid)
        tl.store(inv_ptr + perm, i.to(tl.int64), mask=valid)  # inv[perm[j]] = j
        bins = tl.arange(0, BINS)
        counts = tl.histogram(tl.where(valid, expert, 0), BINS)
        counts -= tl.where(bins == 0, BLOCK - pairs, 0)  # the padding counted in bin 0
        tl.store(ends_ptr + bins, tl.cumsum(counts, 0).to(tl.int32), mask=bins < EXPERTS)


#: ``(perm, inverse, ends)``: see :func:`group_by_expert`.
Grouping = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

#: The most pairs one program groups (a prompt piece of 512 tokens x 8 experts x 2 prompts).
MAX_PAIRS = 8192
#: The most keys a thread of the grouping kernel holds. Triton's compile of ``tl.sort`` grows with
#: the keys a thread sorts in its registers (8,192 pairs for sm_90 with Triton 3.6: 4.6 s at 32 keys
#: a thread, 2.1 s at 8; ``benchmarks/kernel_compile.py``), so large buckets take more warps.
KEYS_PER_THREAD = 8
#: One program's most warps (1,024 threads).
MAX_WARPS = 32
#: Overrides the warps of :func:`launch_config` (``benchmarks/kernels.py --moe-group`` sets it, as
#: ``rms_norm.WARPS``).
WARPS: int | None = None


def group_by_expert_reference(ids: torch.Tensor, experts: int) -> Grouping:
    """``(perm, inverse, ends)`` of the flat expert ids ``ids`` [S] as transformers' grouped_mm
    experts compute them: ``ids[perm]`` ascending, ``inverse[perm] = arange(S)``, ``ends`` [E]
    int32 the cumulative count of pairs per expert (a sort that is not stable: another order
    within an expert than :func:`group_by_expert`'s)."""
    _, perm = torch.sort(ids)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.shape[0], device=ids.device)
    counts = torch.bincount(ids, minlength=experts)[:experts]
    return perm, inverse, torch.cumsum(counts, 0, dtype=torch.int32)


def kernel_applies(ids: torch.Tensor) -> bool:
    """Whether :func:`group_by_expert` launches the kernel for ``ids`` (CUDA, Triton, at most
    :data:`MAX_PAIRS` pairs; bitwise the experts' output, so on unless ``FUSED`` is ``off``)."""
    return kernel_device(ids) and settings.wanted(True) and 0 < ids.numel() <= MAX_PAIRS


def group_by_expert(ids: torch.Tensor, experts: int) -> Grouping:
    """``(perm, inverse, ends)`` of ``ids`` [S] (int64 expert ids of the (token, expert) pairs,
    each in ``0..experts-1``): ``perm`` [S] the pairs grouped by expert, ascending and stable;
    ``inverse`` [S] its inverse; ``ends`` [experts] int32, where each expert's group ends. One
    launch where :func:`kernel_applies`, else :func:`group_by_expert_reference`. No host sync."""
    if ids.dim() != 1:
        raise ValueError(f"ids must be flat [S], got {tuple(ids.shape)}")
    if not kernel_applies(ids):
        return group_by_expert_reference(ids, experts)
    return settings.dispatch(torch.ops.omnirt.group_by_expert, group_by_expert_triton, ids, experts)


def group_by_expert_triton(ids: torch.Tensor, experts: int) -> Grouping:
    """The kernel itself (CUDA tensors, or CPU ones under ``TRITON_INTERPRET=1``: the tests)."""
    pairs = ids.shape[0]
    if not HAVE_TRITON or not 0 < pairs <= MAX_PAIRS:
        raise ValueError(f"the kernel groups 1 to {MAX_PAIRS} pairs with Triton, got {pairs}")
    perm = torch.empty(pairs, dtype=torch.int64, device=ids.device)
    inverse = torch.empty_like(perm)
    ends = torch.empty(experts, dtype=torch.int32, device=ids.device)
    constants, options = launch_config(pairs, experts)
    _group_kernel[(1,)](ids.contiguous(), perm, inverse, ends, pairs, **constants, **options)
    return perm, inverse, ends


def launch_config(pairs: int, experts: int) -> tuple[dict[str, int], dict[str, int]]:
    """The grouping kernel's compile-time constants and launch options for ``pairs`` pairs over
    ``experts`` experts (:func:`group_by_expert_triton` launches with them;
    ``benchmarks/kernel_compile.py`` compiles with them)."""
    block = max(16, triton.next_power_of_2(pairs))
    constants = dict(EXPERTS=experts, BINS=triton.next_power_of_2(experts), BLOCK=block)
    warps = WARPS or min(MAX_WARPS, max(4, block // (32 * KEYS_PER_THREAD)))
    return constants, dict(num_warps=warps)



@torch.library.custom_op("omnirt::group_by_expert", mutates_args=())
def _group_by_expert_op(ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return group_by_expert_triton(ids, experts)


@_group_by_expert_op.register_fake
def _group_by_expert_fake(ids, experts):
    pairs = ids.shape[0]
    return (ids.new_empty(pairs, dtype=torch.int64), ids.new_empty(pairs, dtype=torch.int64),
            ids.new_empty(experts, dtype=torch.int32))
