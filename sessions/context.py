"""The model's context for a response: instructions plus the conversation, as typed messages."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from omnirt.stages.types import (
    AudioPart,
    ContextMessage,
    ImagePart,
    Part,
    TextPart,
    ToolCallPart,
    ToolResultPart,
)

from .items import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputAudio,
    InputImage,
    InputText,
    Item,
    MessageItem,
    OutputAudio,
    OutputText,
)


def build_messages(instructions: str, items: Iterable[Item]) -> list[ContextMessage]:
    """History as the model sees it: user audio/text/images, assistant text or the transcript of
    what it said (as truncated), function calls and their outputs. Items still streaming are left
    out.

    A function call joins the assistant message right before it (the reply's text, or the calls
    before it), as one assistant turn that says something and calls; each output is a ``tool``
    message of its own."""
    messages: list[ContextMessage] = []
    if instructions:
        messages.append(ContextMessage("system", (TextPart(instructions),)))
    for item in items:
        if item.status == "in_progress":
            continue
        if isinstance(item, MessageItem):
            parts = tuple(p for p in (_part(c) for c in item.content) if p is not None)
            if parts:
                messages.append(ContextMessage(item.role, parts))
        elif isinstance(item, FunctionCallItem):
            call = ToolCallPart(item.call_id, item.name, item.arguments)
            if messages and messages[-1].role == "assistant":
                messages[-1] = ContextMessage("assistant", (*messages[-1].parts, call))
            else:
                messages.append(ContextMessage("assistant", (call,)))
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(ContextMessage("tool", (ToolResultPart(item.call_id, item.output),)))
    return messages


def _part(content: object) -> Part | None:
    if isinstance(content, InputText | OutputText):
        return TextPart(content.text) if content.text else None
    if isinstance(content, InputAudio):
        return AudioPart(np.asarray(content.audio, dtype=np.float32)) if len(content.audio) else None
    if isinstance(content, InputImage):
        return ImagePart(content.data)
    if isinstance(content, OutputAudio):
        return TextPart(content.transcript) if content.transcript else None
    return None
