"""The model's context for a response: instructions plus the conversation, as typed messages."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
from omnirt.stages.types import (
    AudioPart,
    ContextMessage,
    ImagePart,
    Part,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    Truncation,
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
    """History as the model sees it (see :func:`build_context`)."""
    return build_context(instructions, items)[0]


def build_context(
    instructions: str, items: Iterable[Item]
) -> tuple[list[ContextMessage], list[tuple[str, ...]]]:
    """History as the model sees it: user audio/text/images, assistant text or the transcript of
    what it said (as truncated), function calls and their outputs. Items still streaming are left
    out. With it, the ids of the items behind each message (none behind the instructions), which
    say what a truncation that leaves messages out leaves out.

    A function call joins the assistant message right before it (the reply's text, or the calls
    before it), as one assistant turn that says something and calls; each output is a ``tool``
    message of its own."""
    messages: list[ContextMessage] = []
    ids: list[tuple[str, ...]] = []
    if instructions:
        messages.append(ContextMessage("system", (TextPart(instructions),)))
        ids.append(())
    head = len(messages)
    for item in items:
        if item.status == "in_progress":
            continue
        if isinstance(item, MessageItem):
            parts = tuple(p for p in (_part(c) for c in item.content) if p is not None)
            if parts:
                messages.append(ContextMessage(item.role, parts))
                ids.append((item.id,))
        elif isinstance(item, FunctionCallItem):
            call = ToolCallPart(item.call_id, item.name, item.arguments)
            if len(messages) > head and messages[-1].role == "assistant":
                messages[-1] = ContextMessage("assistant", (*messages[-1].parts, call))
                ids[-1] = (*ids[-1], item.id)
            else:
                messages.append(ContextMessage("assistant", (call,)))
                ids.append((item.id,))
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(ContextMessage("tool", (ToolResultPart(item.call_id, item.output),)))
            ids.append((item.id,))
    return messages, ids


def _part(content: object) -> Part | None:
    if isinstance(content, InputText | OutputText):
        return TextPart(content.text) if content.text else None
    if isinstance(content, InputAudio):
        return AudioPart(np.asarray(content.audio, dtype=np.float32)) if len(content.audio) else None
    if isinstance(content, InputImage):
        return ImagePart(content.data) if content.data else None  # dropped: the bytes cap
    if isinstance(content, OutputAudio):
        return TextPart(content.transcript) if content.transcript else None
    return None


#: The retention ratio of ``truncation: auto``: a full conversation is cut to 80% of its room, so
#: the next turns fit without cutting again and read their prompt's start from the prefix cache
#: (OpenAI's ``auto`` leaves out just enough, and a full conversation is then cut, and read anew,
#: at every turn: ``retention_ratio`` 1.0 does that here).
AUTO_RETENTION = 0.8


def stage_truncation(setting: str | dict[str, Any]) -> Truncation | None:
    """``session.truncation`` as the engine takes it: ``disabled`` is None (a context that does
    not fit fails the response); ``auto`` is a retention ratio of :data:`AUTO_RETENTION`; a
    retention ratio leaves out enough of the oldest messages for the rest to hold that share of
    the room (and bounds the conversation by ``token_limits.post_instructions`` when given)."""
    if setting == "disabled":
        return None
    if setting == "auto":
        return Truncation(retention_ratio=AUTO_RETENTION)
    assert isinstance(setting, dict)
    limits = setting.get("token_limits") or {}
    return Truncation(
        retention_ratio=float(setting["retention_ratio"]), post_instructions=limits.get("post_instructions")
    )
