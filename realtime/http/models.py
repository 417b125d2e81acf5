"""``GET /v1/models`` and ``GET /v1/models/{id}``: the models this server has loaded, one per
pipeline (speech first; then the image and video models), each with its pipeline's kind."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from omnirt.stages.types import ModelInfo
from starlette.requests import Request
from starlette.responses import JSONResponse

from ..config import ServerConfig
from ..redact import public_source
from .access import require_api_key
from .errors import model_not_found


def model_card(
    info: ModelInfo, created: int, voice_aliases: Mapping[str, str] | None = None, kind: str | None = None
) -> dict[str, Any]:
    """The OpenAI model object, plus what a client of this server needs to know about it.

    ``random_weights`` is true for the embedded default: replies are then noise, by design.
    ``voice_aliases`` (alias -> the model's voice) are the other names a realtime session takes.
    ``kind`` is the kind of the pipeline that serves it ("speech", "image", "video", ...).
    ``source`` is the model folder's name, never its path (which stays in the server's log).
    ``quantization`` is ``none`` or the W8A8 format of its linear layers (``int8``, ``fp8``).
    """
    return {
        "id": info.id,
        "object": "model",
        "created": created,
        "owned_by": "omnirt",
        "kind": kind,
        "architecture": info.architecture,
        "source": public_source(info.source),
        "random_weights": info.random_weights,
        "voices": list(info.voices),
        "voice_aliases": dict(voice_aliases or {}),
        "max_context_tokens": info.max_context_tokens,
        "quantization": info.quantization,
    }


class Models:
    def __init__(
        self,
        infos: Sequence[ModelInfo],
        config: ServerConfig,
        voice_aliases: Mapping[str, Mapping[str, str]] | None = None,
        kinds: Mapping[str, str] | None = None,
    ) -> None:
        """``kinds``: model id -> the kind of the pipeline serving it."""
        #: Per model id: the voice aliases its realtime sessions accept.
        self.voice_aliases = dict(voice_aliases or {})
        self.kinds = dict(kinds or {})
        self.infos: dict[str, ModelInfo] = {}
        for info in infos:
            self.infos.setdefault(info.id, info)  # two pipelines of one model: listed once
        self.config = config
        self.created = int(time.time())

    async def list(self, request: Request) -> JSONResponse:
        require_api_key(request, self.config.api_keys)
        cards = [self._card(info) for info in self.infos.values()]
        return JSONResponse({"object": "list", "data": cards})

    async def retrieve(self, request: Request) -> JSONResponse:
        require_api_key(request, self.config.api_keys)
        model = request.path_params["model"]
        info = self.infos.get(model)
        if info is None:
            raise model_not_found(model)
        return JSONResponse(self._card(info))

    def _card(self, info: ModelInfo) -> dict[str, Any]:
        return model_card(info, self.created, self.voice_aliases.get(info.id), self.kinds.get(info.id))
