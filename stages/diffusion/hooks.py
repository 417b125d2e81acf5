"""Whether a diffusers model's whole ``forward`` is wrapped by something the split pieces of a
call would skip (a diffusers cache hook, accelerate's offload hook)."""

from __future__ import annotations

import torch


def forward_is_wrapped(module: torch.nn.Module) -> bool:
    """True when ``module`` has a model-level hook (diffusers ``HookRegistry`` hooks, as the cache
    techniques register, or an accelerate ``_hf_hook``): calling its submodules one by one would
    bypass it, so its calls must run whole."""
    registry = getattr(module, "_diffusers_hook", None)
    if registry is not None and getattr(registry, "hooks", None):
        return True
    if getattr(module, "is_cache_enabled", False):
        return True
    return hasattr(module, "_hf_hook")
