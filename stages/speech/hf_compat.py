"""Small shims over where transformers keeps the thinker's parts (its text model moved under
``thinker.model.language_model``; ``get_rope_index`` onto the inner model)."""

from __future__ import annotations

from typing import Any

from torch import nn


def thinker_text_model(thinker: nn.Module) -> nn.Module:
    """The thinker's decoder (``embed_tokens``, ``layers``, ``norm``, ``rotary_emb``)."""
    inner = thinker.model
    return getattr(inner, "language_model", inner)


def thinker_rope_index(thinker: nn.Module) -> Any:
    """The thinker's ``get_rope_index`` (on its inner model in newer releases)."""
    found = getattr(thinker.model, "get_rope_index", None)
    return found if found is not None else thinker.get_rope_index
