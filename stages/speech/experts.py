"""The speech models' MoE experts: transformers' ``grouped_mm`` experts with the pairs grouped by
expert in one launch (:mod:`omnirt.kernels.moe_route`) instead of a sort, a histogram, a
cumulative sum and a scatter.

Registered with transformers' ``ExpertsInterface`` as :data:`IMPLEMENTATION`, set on the model
by the loader (``model.set_experts_implementation``). The arithmetic is transformers': the same
gathers, the two grouped matmuls, the gate, the routing weights and the sum over each token's
experts in its order, so the output equals ``grouped_mm``'s bitwise. What the kernel does not
cover (CPU tensors, expert parallelism, biases, more pairs than it groups) runs transformers'
``grouped_mm`` forward itself.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.integrations.moe import ExpertsInterface, _grouped_linear, grouped_mm_experts_forward

from ...kernels.moe_route import group_by_expert, kernel_applies

#: The name the loader sets (``model.set_experts_implementation``).
IMPLEMENTATION = "omnirt_grouped_mm"


def grouped_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """``grouped_mm_experts_forward`` with :func:`~omnirt.kernels.moe_route.group_by_expert`."""
    expert_ids = top_k_index.reshape(-1)
    plain = self.has_gate and not self.has_bias and not self._is_expert_parallel
    if not plain or not kernel_applies(expert_ids):
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    num_tokens, hidden_dim = hidden_states.shape
    num_top_k = top_k_index.shape[-1]
    perm, inverse, ends = group_by_expert(expert_ids, self.num_experts)
    grouped = hidden_states[perm // num_top_k]
    weights = top_k_weights.reshape(-1)[perm]
    out = _grouped_linear(grouped, self.gate_up_proj, ends, is_transposed=self.is_transposed)
    out = self._apply_gate(out)
    out = _grouped_linear(out, self.down_proj, ends, is_transposed=self.is_transposed)
    if self.has_post_expert_norm:
        out = self.post_expert_norm(out)
    weighted = (out * weights.unsqueeze(-1))[inverse]
    return weighted.view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden_states.dtype)


ExpertsInterface.register(IMPLEMENTATION, grouped_experts_forward)
