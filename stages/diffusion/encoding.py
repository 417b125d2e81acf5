"""PNG and MP4 encoding off the engine thread.

Encoding a 1024x1024 PNG took 196 ms and an 81-frame 480p MP4 2.6 s on the H200 machine's CPU
(docs/benchmarks.md): on the engine thread a realtime frame would wait behind them. The runtime
hands the pixels to :class:`MediaEncoder` (a small thread pool: zlib and libx264 release the GIL)
and releases each request's outputs in the order they were made, once encoded; the engine is woken
when one is ready.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..types import Finished, Usage

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Pending:
    future: Future[bytes] | None  # None: ``output`` is ready as it is
    build: Callable[[bytes], Any] | None
    output: Any = None


class MediaEncoder:
    """``workers`` threads encode; 0 encodes inline, in :meth:`submit` (callers that drive a
    pipeline step by step themselves: tests, benchmarks of the models alone)."""

    def __init__(self, workers: int = 2, on_ready: Callable[[], None] | None = None) -> None:
        if workers < 0:
            raise ValueError(f"workers must be 0 or more, got {workers}")
        self.workers = workers
        #: Called (from an encoding thread) whenever an output becomes ready: the engine's wake-up.
        self.on_ready = on_ready
        self._pool: ThreadPoolExecutor | None = None
        self._queues: dict[str, collections.deque[_Pending]] = {}

    def submit(
        self, request_id: str, build: Callable[[bytes], Any], encode: Callable[..., bytes], *args: Any
    ) -> None:
        """Encode ``encode(*args)`` on a worker; its bytes become ``build(bytes)``, the request's
        next output after those submitted before it."""
        if self.workers == 0:
            future: Future[bytes] = Future()
            try:
                future.set_result(encode(*args))
            except Exception as exc:
                future.set_exception(exc)
            self._queues.setdefault(request_id, collections.deque()).append(_Pending(future, build))
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="omnirt-media")
        future = self._pool.submit(encode, *args)
        self._queues.setdefault(request_id, collections.deque()).append(_Pending(future, build))
        future.add_done_callback(self._done)

    def put(self, request_id: str, output: Any) -> None:
        """An output that needs no encoding, released after the request's earlier ones."""
        self._queues.setdefault(request_id, collections.deque()).append(_Pending(None, None, output))
        if self.on_ready is not None:
            self.on_ready()

    def ready(self) -> bool:
        """True when some request's next output can be released."""
        return any(q and _done(q[0]) for q in self._queues.values())

    def busy(self) -> bool:
        """True while some output is still to be released (encoding or ready)."""
        return bool(self._queues)

    def drain(self) -> list[tuple[str, Any]]:
        """Every output that is ready, in order per request. A failed encoding fails its request
        (``Finished`` error) and drops the rest of its outputs."""
        out: list[tuple[str, Any]] = []
        for request_id, queue in list(self._queues.items()):
            while queue and _done(queue[0]):
                pending = queue.popleft()
                if pending.future is None:
                    out.append((request_id, pending.output))
                    continue
                error = pending.future.exception()
                if error is not None:
                    log.error("encoding an output of %s failed: %s", request_id, error)
                    out.append(
                        (request_id, Finished("error", Usage(), f"encoding failed: {error}", "internal"))
                    )
                    queue.clear()
                    break
                assert pending.build is not None
                out.append((request_id, pending.build(pending.future.result())))
            if not queue:
                del self._queues[request_id]
        return out

    def drop(self, request_id: str) -> bool:
        """Forget a request's outputs (cancel): True if it had any."""
        queue = self._queues.pop(request_id, None)
        for pending in queue or ():
            if pending.future is not None:
                pending.future.cancel()
        return queue is not None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _done(self, _: Future[bytes]) -> None:
        if self.on_ready is not None:
            self.on_ready()


def _done(pending: _Pending) -> bool:
    return pending.future is None or pending.future.done()
