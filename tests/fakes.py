"""A deterministic stand-in pipeline, for testing the layers above ``stages/`` fast.

It runs inside the real :class:`~omnirt.stages.engine.Engine` and answers each request with
``"You said: <last user text | N ms of audio>."`` one word per step, plus 80 ms of a tone per
word when audio is asked for. Its kind is "speech" (realtime, no deadline), like the pipeline it
stands in for; the prompt work (``prepare``) parses the request and rejects ``"reject me"``.
End-to-end tests use the real speech pipeline instead.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

import numpy as np
from omnirt.stages.pipeline import CallCounter, Priority, RequestRejected
from omnirt.stages.types import (
    SAMPLE_RATE,
    AudioDelta,
    AudioPart,
    Finished,
    GenerationRequest,
    ModelInfo,
    Output,
    Started,
    TextDelta,
    TextPart,
    Usage,
)

FRAME = SAMPLE_RATE * 80 // 1000


@dataclass
class _Active:
    request: GenerationRequest
    words: list[str]
    usage: Usage
    sent: int = 0
    text: str = ""
    started: bool = False
    phase: float = field(default=0.0)


@dataclass(frozen=True)
class _Prepared:
    words: list[str]
    usage: Usage


class EchoPipeline:
    kind = "speech"
    priority = Priority.REALTIME

    def __init__(self, slots: int = 8, step_seconds: float = 0.0) -> None:
        self.info = ModelInfo(
            id="echo-test", architecture="echo", random_weights=True, source="tests", voices=("echo",)
        )
        self.slots = slots
        self.step_seconds = step_seconds
        self.active: dict[str, _Active] = {}
        self.steps = 0
        self.calls: CallCounter = collections.Counter()

    def accepts(self, request: object) -> bool:
        return isinstance(request, GenerationRequest)

    def can_add(self) -> bool:
        return len(self.active) < self.slots

    def next_deadline(self) -> float | None:
        return None

    def step_cost(self) -> float:
        return self.step_seconds

    def prepare(self, request: GenerationRequest) -> _Prepared:
        said = "nothing"
        audio_ms = 0
        for message in request.messages:
            for part in message.parts:
                if message.role == "user" and isinstance(part, TextPart):
                    said = part.text
                if message.role == "user" and isinstance(part, AudioPart):
                    audio_ms = len(part.pcm) * 1000 // SAMPLE_RATE
                    said = f"{audio_ms} ms of audio"
        if said == "reject me":
            raise RequestRejected("the echo pipeline rejects this input")
        words = f"You said: {said}.".split(" ")
        limit = request.max_output_tokens
        usage = Usage(
            input_text_tokens=sum(len(m.parts) for m in request.messages), input_audio_tokens=audio_ms // 40
        )
        if limit is not None and limit < len(words):
            words = words[:limit] + ["\x00length"]
        return _Prepared(words, usage)

    def add(self, request: GenerationRequest, prepared: _Prepared) -> None:
        if request.request_id in self.active:
            raise RequestRejected(f"request id {request.request_id!r} is already active")
        self.active[request.request_id] = _Active(request, list(prepared.words), prepared.usage)

    def has_work(self) -> bool:
        return bool(self.active)

    def step(self) -> list[tuple[str, Output]]:
        if self.step_seconds:
            time.sleep(self.step_seconds)
        self.steps += 1
        self.calls["echo", len(self.active)] += 1
        out: list[tuple[str, Output]] = []
        for rid, a in list(self.active.items()):
            if not a.started:
                a.started = True
                out.append(
                    (rid, Started(Usage(**{k: v for k, v in vars(a.usage).items() if k.startswith("input")})))
                )
            if a.sent >= len(a.words) or a.words[a.sent] == "\x00length":
                reason = "length" if a.sent < len(a.words) else "stop"
                out.append((rid, Finished(reason, a.usage)))
                del self.active[rid]
                continue
            word = a.words[a.sent] if a.sent == 0 else " " + a.words[a.sent]
            a.sent += 1
            a.text += word
            a.usage.output_text_tokens += 1
            out.append((rid, TextDelta(word)))
            if a.request.output_audio:
                t = (np.arange(FRAME) + a.phase) / SAMPLE_RATE
                a.phase += FRAME
                pcm = (0.2 * np.sin(2 * np.pi * 440 * t) * 32767).astype(np.int16)
                a.usage.output_audio_tokens += 1
                out.append((rid, AudioDelta(pcm, len(a.text))))
        return out

    def remove(self, request_id: str) -> Usage | None:
        a = self.active.pop(request_id, None)
        return a.usage if a else None
