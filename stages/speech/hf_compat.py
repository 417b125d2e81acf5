"""Small shims over transformers API differences between the versions we run (5.17 on the GPU
image, 5.24 here): the KV cache output field was renamed ``past_key_values`` ->
``cache``, and the thinker's text model moved under ``thinker.model.language_model``."""

from __future__ import annotations

from typing import Any

from torch import nn


def output_cache(output: Any) -> Any:
    """The KV cache a model forward returned."""
    found = getattr(output, "cache", None)
    return found if found is not None else output.past_key_values


def thinker_text_model(thinker: nn.Module) -> nn.Module:
    """The thinker's decoder (``embed_tokens``, ``layers``, ``norm``, ``rotary_emb``)."""
    inner = thinker.model
    return getattr(inner, "language_model", inner)


def thinker_rope_index(thinker: nn.Module) -> Any:
    """The thinker's ``get_rope_index`` (on its inner model in newer releases)."""
    found = getattr(thinker.model, "get_rope_index", None)
    return found if found is not None else thinker.get_rope_index
