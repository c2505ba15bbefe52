"""Requests in flight, so that shutdown can end them after its grace period with a final event
(an error saying the server is stopping) instead of cutting connections."""

from __future__ import annotations

import weakref

from hybridmoe.engine.engine import RequestHandle


class InFlight:
    """Handles of submitted requests (weakly held: a finished one drops out by itself)."""

    def __init__(self) -> None:
        self._handles: weakref.WeakSet[RequestHandle] = weakref.WeakSet()
        self.stopping = False  # set by end_all: a cancelled request was ended by shutdown

    def add(self, handle: RequestHandle) -> RequestHandle:
        self._handles.add(handle)
        return handle

    def end_all(self) -> int:
        """Cancel every request: the engine ends each with a final event at its next step."""
        self.stopping = True
        handles = list(self._handles)
        for h in handles:
            h.cancel()
        return len(handles)
