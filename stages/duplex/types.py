"""The request a duplex session makes of the engine: one whole conversation, fed live."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..live import LiveInput

if TYPE_CHECKING:
    from .lm import DuplexSampling


@dataclass
class DuplexRequest:
    """A full-duplex conversation: 24 kHz mono input pushed into ``input`` as it arrives, one
    80 ms frame of model audio (and maybe text) out per frame of input, until the input ends
    (``Finished("stop")``) or the request is cancelled. Open it with ``EngineClient.open``."""

    request_id: str
    input: LiveInput
    #: None: the pipeline's default sampling (server configuration).
    sampling: DuplexSampling | None = None
