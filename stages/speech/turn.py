"""One admitted request of the speech pipeline: its slot, prompt, reply so far and talker state."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..types import GenerationRequest, Usage
from .constrain import ReplyConstraint
from .prefill import PrefillJob
from .prompt import PromptInputs
from .talker import TalkerState
from .text_out import TextOut
from .tool_calls import CallSplitter


@dataclass(eq=False)
class Turn:
    request: GenerationRequest
    slot: int
    prompt: PromptInputs
    usage: Usage
    max_tokens: int
    text: TextOut
    prefilled: bool = False
    thinker_done: bool = False
    reason: str = "stop"
    reply: list[int] = field(default_factory=list)  # reply token ids for the talker (its text)
    reply_at: list[int] = field(default_factory=list)  # each one's index among the reply's tokens
    spoken: int = 0  # reply tokens of text (outside tool calls)
    constraint: ReplyConstraint | None = None
    splitter: CallSplitter | None = None  # with tools: which tokens are calls
    job: PrefillJob | None = None  # the prompt's prefill, once started
    talker: TalkerState | None = None
    audio_frames_sent: int = 0  # frames whose audio has gone out in AudioDeltas
    audio_seconds: float = 0.0  # of audio gone out
    audio_started: float | None = None  # time.monotonic() when its first audio went out
    held: bool = False  # no decode steps while held (its client is behind; ``hold``)
    drawn: list[int] = field(default_factory=list)  # every reply token drawn (the slot feeds them)
    admitted: float = field(default_factory=time.monotonic)  # when the pipeline took it
    ticks: int = 0  # steps of the pipeline since, while not held
