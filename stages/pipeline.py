"""What the engine needs of a model pipeline.

A pipeline holds the models and the per-request GPU state (slots). The engine thread is its
only caller: ``add`` admits a request, ``step`` advances every admitted request by one
scheduler tick (batched into shared model calls), ``remove`` drops a request at once (cancel),
freeing its slot. A request ends when ``step`` returns a :class:`Finished` for it; the pipeline
has then already freed its state.
"""

from __future__ import annotations

from typing import Protocol

from .types import GenerationRequest, ModelInfo, Output, Usage


class RequestRejected(ValueError):
    """The request cannot run (bad input, over a limit). The message is shown to the client."""


class Pipeline(Protocol):
    info: ModelInfo

    def can_add(self) -> bool:
        """True when a slot is free for one more request."""
        ...

    def add(self, request: GenerationRequest) -> None:
        """Admit a request; raises :class:`RequestRejected` for input it cannot serve."""
        ...

    def has_work(self) -> bool: ...

    def step(self) -> list[tuple[str, Output]]:
        """One tick: advance all admitted requests; outputs tagged by request id, in order."""
        ...

    def remove(self, request_id: str) -> Usage | None:
        """Drop a request now (cancel). Returns its usage so far, or None if unknown."""
        ...
