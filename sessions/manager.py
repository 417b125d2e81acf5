"""Admission of sessions: at most ``max_sessions`` at once, each holding a lease until it ends."""

from __future__ import annotations

import threading


class SessionLease:
    """A held session slot; ``release()`` is idempotent (and runs on ``with`` exit)."""

    def __init__(self, manager: SessionManager) -> None:
        self._manager = manager
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._manager._release()

    def __enter__(self) -> SessionLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class SessionManager:
    def __init__(self, max_sessions: int) -> None:
        self.max_sessions = max_sessions
        self._lock = threading.Lock()
        self._active = 0
        self._total = 0

    @property
    def active(self) -> int:
        return self._active

    @property
    def total(self) -> int:
        """Sessions admitted since start."""
        return self._total

    def admit(self) -> SessionLease | None:
        """A lease, or ``None`` when ``max_sessions`` are already active."""
        with self._lock:
            if self._active >= self.max_sessions:
                return None
            self._active += 1
            self._total += 1
        return SessionLease(self)

    def _release(self) -> None:
        with self._lock:
            self._active -= 1
