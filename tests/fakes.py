"""A deterministic stand-in pipeline, for testing the layers above ``stages/`` fast.

It runs inside the real :class:`~omnirt.stages.engine.Engine` and answers each request with
``"You said: <last user text | N ms of audio>."`` one word per step, plus 80 ms of a tone per
word when audio is asked for. Its kind is "speech" (realtime, no deadline), like the pipeline it
stands in for; the prompt work (``prepare``) parses the request and rejects ``"reject me"``.
End-to-end tests use the real speech pipeline instead.

Tools and structured output, as the real engine honours them (one step per output):

- ``tool_choice`` a :class:`NamedTool`: one call of it, nothing else; ``required``: one call of
  the first tool; ``auto``: ``"Calling NAME."`` and then a call, for every tool whose name the
  last user text holds (none named: the echo as usual); ``none``: never a call.
- A call's arguments are an instance of the tool's parameters schema (:func:`instance`), its
  strings being the last user text.
- After a ``tool`` message the answer is ``"The tool said: <output>."``.
- ``response_format``: the text is an instance of the schema, as JSON, in 8-character pieces.
"""

from __future__ import annotations

import collections
import json
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from omnirt.stages.pipeline import CallCounter, Priority, RequestRejected
from omnirt.stages.types import (
    SAMPLE_RATE,
    AudioDelta,
    AudioPart,
    Finished,
    GenerationRequest,
    ModelInfo,
    NamedTool,
    Output,
    Started,
    TextDelta,
    TextPart,
    ToolCall,
    ToolResultPart,
    ToolSpec,
    Usage,
)

FRAME = SAMPLE_RATE * 80 // 1000


#: A piece of the answer: exact text of one step, a call, or the ``length`` marker.
Piece = str | ToolCall
LENGTH = "\x00length"


def instance(schema: dict[str, Any], text: str) -> Any:
    """A value valid against ``schema`` (the subset tests use): strings are ``text``."""
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return instance(schema[key][0], text)
    kind = schema.get("type", "object")
    if isinstance(kind, list):
        kind = kind[0]
    if kind == "object":
        props = schema.get("properties", {})
        return {name: instance(sub, text) for name, sub in props.items()}
    if kind == "array":
        return [instance(schema.get("items", {}), text)] * max(1, schema.get("minItems", 1))
    return {"string": text, "integer": len(text), "number": 0.5, "boolean": True, "null": None}[kind]


def _call(tool: ToolSpec, said: str) -> ToolCall:
    return ToolCall(tool.name, json.dumps(instance(tool.parameters, said)))


def _words(text: str) -> list[Piece]:
    words = text.split(" ")
    return [w if i == 0 else " " + w for i, w in enumerate(words)]


@dataclass
class _Active:
    request: GenerationRequest
    words: list[Piece]
    usage: Usage
    sent: int = 0
    text: str = ""
    started: bool = False
    phase: float = field(default=0.0)
    held: bool = False


@dataclass(frozen=True)
class _Prepared:
    words: list[Piece]
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
        words = self._answer(request, said)
        limit = request.max_output_tokens
        usage = Usage(
            input_text_tokens=sum(len(m.parts) for m in request.messages), input_audio_tokens=audio_ms // 40
        )
        if limit is not None and limit < len(words):
            words = words[:limit] + [LENGTH]
        return _Prepared(words, usage)

    @staticmethod
    def _answer(request: GenerationRequest, said: str) -> list[Piece]:
        last = request.messages[-1] if request.messages else None
        if last is not None and last.role == "tool":
            outputs = [p.output for p in last.parts if isinstance(p, ToolResultPart)]
            return _words(f"The tool said: {' '.join(outputs)}.")
        choice, tools = request.tool_choice, request.tools
        if isinstance(choice, NamedTool):
            return [_call(next(t for t in tools if t.name == choice.name), said)]
        if choice == "required":
            return [_call(tools[0], said)]
        named = [t for t in tools if t.name in said] if choice == "auto" else []
        if named:
            pieces: list[Piece] = []
            for tool in named:
                words = _words(f"Calling {tool.name}.")
                if pieces:
                    words[0] = " " + words[0]
                pieces += [*words, _call(tool, said)]
            return pieces
        if request.response_format is not None:
            text = json.dumps(instance(request.response_format.schema, said))
            return [text[i : i + 8] for i in range(0, len(text), 8)]
        return _words(f"You said: {said}.")

    def add(self, request: GenerationRequest, prepared: _Prepared) -> None:
        if request.request_id in self.active:
            raise RequestRejected(f"request id {request.request_id!r} is already active")
        self.active[request.request_id] = _Active(request, list(prepared.words), prepared.usage)

    def has_work(self) -> bool:
        return any(not a.held for a in self.active.values())

    def hold(self, request_id: str, held: bool) -> None:
        if request_id in self.active:
            self.active[request_id].held = held

    def step(self) -> list[tuple[str, Output]]:
        if self.step_seconds:
            time.sleep(self.step_seconds)
        self.steps += 1
        self.calls["echo", len(self.active)] += 1
        out: list[tuple[str, Output]] = []
        for rid, a in list(self.active.items()):
            if a.held:
                continue
            if not a.started:
                a.started = True
                out.append(
                    (rid, Started(Usage(**{k: v for k, v in vars(a.usage).items() if k.startswith("input")})))
                )
            if a.sent >= len(a.words) or a.words[a.sent] == LENGTH:
                reason = "length" if a.sent < len(a.words) else "stop"
                out.append((rid, Finished(reason, a.usage)))
                del self.active[rid]
                continue
            piece = a.words[a.sent]
            a.sent += 1
            a.usage.output_text_tokens += 1
            if isinstance(piece, ToolCall):
                out.append((rid, piece))
                continue
            a.text += piece
            out.append((rid, TextDelta(piece)))
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
