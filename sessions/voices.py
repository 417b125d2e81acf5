"""Voices a session accepts: the model's own, plus OpenAI's voice names as documented aliases.

Clients default to OpenAI's names (the Agents SDK to ``ash``, livekit to ``marin``, many apps to
``alloy``). Each alias maps to one of the model's voices: by default the i-th name of
:data:`OPENAI_VOICES` to the model's voice ``i mod n`` (so ``alloy`` is the model's first voice,
and any model with at least one voice serves all ten names); the deployment may map any name
itself (``--voice-alias NAME=VOICE``). The session shows the name the client asked for; only the
engine sees the model's voice. The model's own names always win over an alias of the same name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from .errors import ErrorCode, SessionError

#: OpenAI's built-in voice names, in the order the default mapping assigns them.
OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "sage", "shimmer", "verse", "marin", "cedar")
#: The voice a new session starts with (OpenAI's default).
DEFAULT_VOICE = "alloy"


def default_aliases(model_voices: tuple[str, ...]) -> dict[str, str]:
    """OpenAI's names onto the model's voices by index (none when the model lists no voices)."""
    if not model_voices:
        return {}
    return {
        name: model_voices[i % len(model_voices)]
        for i, name in enumerate(OPENAI_VOICES)
        if name not in model_voices
    }


@dataclass(frozen=True)
class VoiceCatalog:
    """The model's voices and the aliases onto them. No model voices: any name is passed on."""

    model: tuple[str, ...] = ()
    aliases: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def for_model(
        cls, model_voices: tuple[str, ...], overrides: Mapping[str, str] | None = None
    ) -> VoiceCatalog:
        """The default aliases with the deployment's ``overrides`` (alias -> model voice) on top.

        Raises ``ValueError`` for an override naming a voice the model does not have, or
        shadowing one of the model's own names."""
        aliases = default_aliases(model_voices)
        for name, voice in (overrides or {}).items():
            if not name or not voice:
                raise ValueError(f"voice alias {name!r}={voice!r}: both names must be non-empty")
            if name in model_voices:
                raise ValueError(f"voice alias {name!r} is one of the model's own voices")
            if model_voices and voice not in model_voices:
                raise ValueError(
                    f"voice alias {name}={voice}: the model has no voice {voice!r} "
                    f"(it has: {', '.join(model_voices)})"
                )
            aliases[name] = voice
        return cls(tuple(model_voices), MappingProxyType(aliases))

    @property
    def names(self) -> tuple[str, ...]:
        """Every name a client may ask for: the model's voices, then the aliases."""
        return self.model + tuple(a for a in self.aliases if a not in self.model)

    def resolve(self, name: str, param: str) -> str:
        """The model's voice for ``name``; ``invalid_value`` naming ``param`` for an unknown one."""
        if name in self.model:
            return name
        if name in self.aliases:
            return self.aliases[name]
        if not self.model:
            return name
        raise SessionError(
            ErrorCode.INVALID_VALUE,
            f"Invalid value: '{name}'. Supported values are: {', '.join(repr(n) for n in self.names)}.",
            param,
        )
