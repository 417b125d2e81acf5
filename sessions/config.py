"""The effective session configuration, its partial deep-merge update, and the session limits.

A ``session.update`` arrives here already type-checked (``realtime/protocol``) as a nested dict of
only the fields the client sent (explicit ``null`` kept). Merging follows PROTOCOL.md: objects
merge key by key; ``""``, ``[]`` and ``null`` clear a field back to its empty / default value.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Literal

from omnirt.codecs.audio import FormatType

from .errors import ErrorCode, SessionError
from .tools import realtime_tools
from .turns import effective_turn_detection
from .voices import VoiceCatalog

Modality = Literal["audio", "text"]
DEFAULT_MODALITIES: tuple[Modality, ...] = ("audio",)


@dataclass(frozen=True)
class SessionLimits:
    """Server-owned limits a session enforces (from the deployment's ServerConfig)."""

    #: Audio held in the input buffer, counted as bytes of 24 kHz PCM16.
    max_input_buffer_bytes: int = 24_000 * 2 * 120
    #: Largest reply (output tokens); also what ``"inf"`` means.
    max_output_tokens: int = 512
    #: Voices the model has, and OpenAI's names as aliases of them (no model voices: any name
    #: is passed through to the model).
    voices: VoiceCatalog = field(default_factory=VoiceCatalog)
    #: Server VAD: input audio not yet scored before appends get ``input_backpressure``.
    max_vad_backlog_ms: int = 5_000
    #: Images the conversation may hold at once, and the largest one (decoded bytes).
    max_images: int = 16
    max_image_bytes: int = 10 * 1024 * 1024
    #: Out-of-band responses running at once (each takes a model slot).
    max_out_of_band_responses: int = 2
    #: Items the conversation may hold, and what they may hold together (characters of text,
    #: bytes of audio and images: :func:`~.items.item_bytes`).
    max_items: int = 1000
    max_conversation_bytes: int = 64 * 1024 * 1024
    #: The model's context (tokens): a prompt of more than ``max_prompt_chars`` of it in text
    #: cannot fit, and is refused before the engine tokenises it (:mod:`omnirt.stages.prompt_size`).
    max_context_tokens: int = 4096


@dataclass
class SessionConfig:
    model: str
    voice: str
    instructions: str = ""
    output_modalities: list[Modality] = field(default_factory=lambda: list(DEFAULT_MODALITIES))
    input_format: FormatType = "audio/pcm"
    output_format: FormatType = "audio/pcm"
    transcription: dict[str, Any] | None = None
    noise_reduction: dict[str, Any] | None = None
    turn_detection: dict[str, Any] | None = None
    speed: float = 1.0
    #: Function tools as the client sent them (``{"type": "function", "name", ...}``).
    tools: list[dict[str, Any]] = field(default_factory=list)
    #: ``auto | none | required`` or ``{"type": "function", "name": ...}``.
    tool_choice: str | dict[str, Any] = "auto"
    max_output_tokens: int | Literal["inf"] = "inf"
    #: ``auto``, ``disabled`` or ``{"type": "retention_ratio", "retention_ratio": ..., "token_limits":
    #: {"post_instructions": ...}}`` (see :func:`~.context.stage_truncation`).
    truncation: str | dict[str, Any] = "auto"

    def merged(self, patch: dict[str, Any], *, limits: SessionLimits, voice_locked: bool) -> SessionConfig:
        """A new config with ``patch`` applied; raises :class:`SessionError` and changes nothing
        when the patch asks for something this server cannot do."""
        # Shallow: every field a patch sets is replaced whole, never changed in place.
        c = copy.copy(self)
        if "instructions" in patch:
            c.instructions = patch["instructions"] or ""
        if "output_modalities" in patch:
            c.output_modalities = list(patch["output_modalities"] or DEFAULT_MODALITIES)
        if "max_output_tokens" in patch:
            value = patch["max_output_tokens"]
            c.max_output_tokens = "inf" if value is None else value
        if "truncation" in patch:
            c.truncation = patch["truncation"] or "auto"
        if "tools" in patch:
            c.tools = [{"type": "function", **tool} for tool in patch["tools"] or []]
        if "tool_choice" in patch:
            c.tool_choice = patch["tool_choice"] or "auto"
        if "tools" in patch or "tool_choice" in patch:
            # Each alone: clients set tool_choice before their tools (pipecat and livekit send it
            # in their first update, the tools in a later one), so the two are matched when a
            # response is created.
            realtime_tools(c.tools, c.tool_choice, "session", match=False)
        if "audio" in patch:
            audio = patch["audio"] or {"input": None, "output": None}
            if "input" in audio:
                self._merge_input(c, audio["input"])
            if "output" in audio:
                self._merge_output(c, audio["output"], limits, voice_locked)
        return c

    def _merge_input(self, c: SessionConfig, patch: dict[str, Any] | None) -> None:
        if patch is None:
            patch = {"format": None, "transcription": None, "noise_reduction": None, "turn_detection": None}
        if "format" in patch:
            c.input_format = _format_type(patch["format"], c.input_format)
        if "transcription" in patch:
            # Replaced whole; ``{}`` turns it on with the defaults, ``null`` off.
            value = patch["transcription"]
            c.transcription = dict(value) if isinstance(value, dict) else None
        if "noise_reduction" in patch:
            c.noise_reduction = patch["noise_reduction"] or None
        if "turn_detection" in patch:
            # Replaced whole (not merged), with defaults filled in; the session builds the policy.
            c.turn_detection = effective_turn_detection(patch["turn_detection"])

    def _merge_output(
        self, c: SessionConfig, patch: dict[str, Any] | None, limits: SessionLimits, voice_locked: bool
    ) -> None:
        if patch is None:
            patch = {"format": None, "speed": None}
        if "format" in patch:
            c.output_format = _format_type(patch["format"], c.output_format)
        if "speed" in patch:
            c.speed = 1.0 if patch["speed"] is None else float(patch["speed"])
        if patch.get("voice") is not None:
            voice = patch["voice"]
            if isinstance(voice, dict):
                voice = voice.get("id", "")
            param = "session.audio.output.voice"
            model_voice = limits.voices.resolve(voice, param)
            # Locked is the voice heard: another name of the same model voice is no change.
            if voice_locked and model_voice != limits.voices.resolve(c.voice, param):
                raise SessionError(
                    ErrorCode.CANNOT_UPDATE_VOICE,
                    "Cannot update a conversation's voice if assistant audio is present.",
                    param,
                )
            c.voice = voice


def _format_type(value: dict[str, Any] | None, current: FormatType) -> FormatType:
    if not value:
        return "audio/pcm"
    return value.get("type") or current
