"""What the beta protocol calls things the GA protocol names otherwise, and how a client asks for it.

Beta clients (the openai SDK's ``client.beta.realtime``, livekit's ``RealtimeModelBeta`` and its
Azure mode) are told apart at the upgrade: the ``OpenAI-Beta: realtime=v1`` header, the
``openai-beta.realtime-v1`` subprotocol (browsers, which cannot set headers), or the Azure
preview API's ``api-version`` query parameter (Azure's preview deployments speak the beta shape).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..models import BETA_SESSION_FIELDS

BETA_HEADER = "openai-beta"
BETA_HEADER_VALUE = "realtime=v1"
BETA_SUBPROTOCOL = "openai-beta.realtime-v1"
AZURE_VERSION_QUERY = "api-version"

#: Beta audio format names and the GA format objects they stand for.
FORMAT_TO_GA: dict[str, dict[str, Any]] = {
    "pcm16": {"type": "audio/pcm", "rate": 24000},
    "g711_ulaw": {"type": "audio/pcmu"},
    "g711_alaw": {"type": "audio/pcma"},
}
FORMAT_TO_BETA: dict[str, str] = {ga["type"]: beta for beta, ga in FORMAT_TO_GA.items()}

#: Assistant content part types (user parts are named alike in both).
PART_TO_GA = {"text": "output_text", "audio": "output_audio"}
PART_TO_BETA = {ga: beta for beta, ga in PART_TO_GA.items()}

#: Server event types renamed in GA (the rest keep their names, or are dropped: ``outbound``).
EVENT_TO_BETA = {
    "conversation.item.added": "conversation.item.created",
    "response.output_audio.delta": "response.audio.delta",
    "response.output_audio.done": "response.audio.done",
    "response.output_audio_transcript.delta": "response.audio_transcript.delta",
    "response.output_audio_transcript.done": "response.audio_transcript.done",
    "response.output_text.delta": "response.text.delta",
    "response.output_text.done": "response.text.done",
}

#: The values the beta session object's ``model`` may hold (an enum in the beta types); a served
#: model of another name is left out of beta session objects.
BETA_MODELS = frozenset(
    (
        "gpt-realtime",
        "gpt-realtime-2025-08-28",
        "gpt-4o-realtime-preview",
        "gpt-4o-realtime-preview-2024-10-01",
        "gpt-4o-realtime-preview-2024-12-17",
        "gpt-4o-realtime-preview-2025-06-03",
        "gpt-4o-mini-realtime-preview",
        "gpt-4o-mini-realtime-preview-2024-12-17",
    )
)

TOOL_CHOICE_MODES = ("auto", "none", "required")

#: Error ``param`` paths: a GA path (and whatever is under it) to its beta name. ``True``: the part
#: under the GA path is kept (``...turn_detection.threshold``); ``False``: the beta field is a
#: scalar standing for the whole GA object (``session.input_audio_format`` for ``...format.type``).
_COLLAPSED = {"voice", "input_audio_format", "output_audio_format"}
PARAM_TO_BETA: list[tuple[str, str, bool]] = sorted(
    [
        (ga, f"session.{beta}", beta not in _COLLAPSED)
        for beta, ga in BETA_SESSION_FIELDS.items()
        if ga is not None
    ]
    + [
        ("response.output_modalities", "response.modalities", True),
        ("response.max_output_tokens", "response.max_response_output_tokens", True),
        ("response.audio.output.voice", "response.voice", False),
        ("response.audio.output.format", "response.output_audio_format", False),
    ],
    key=lambda entry: -len(entry[0]),  # longest first: the most specific path wins
)


def param_to_beta(param: str) -> str:
    for ga, beta, keep_rest in PARAM_TO_BETA:
        if param == ga or param.startswith(ga + "."):
            return beta + param[len(ga) :] if keep_rest else beta
    return param


def beta_requested(headers: Mapping[str, str], query: Mapping[str, str], subprotocols: list[str]) -> bool:
    """Whether a connecting client speaks the beta protocol (see the module docstring)."""
    flags = (part.strip().lower() for part in headers.get(BETA_HEADER, "").split(","))
    return BETA_HEADER_VALUE in flags or BETA_SUBPROTOCOL in subprotocols or AZURE_VERSION_QUERY in query


def modalities_to_beta(modalities: list[str]) -> list[str]:
    """GA ``["audio"]`` (audio with its transcript) is beta ``["text", "audio"]``."""
    return ["text", "audio"] if "audio" in modalities else list(modalities)


def modalities_to_ga(value: Any) -> Any:
    """Beta ``["text", "audio"]`` (or ``["audio"]``) is GA ``["audio"]``; anything not a list of
    names goes on as it is, for the GA validation to name."""
    if isinstance(value, list) and "audio" in value and all(v in ("text", "audio") for v in value):
        return ["audio"]
    return value
