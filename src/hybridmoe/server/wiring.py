"""What each API module's routes are given by app.py: the live service and the stream settings."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybridmoe.server.service import Service


@dataclass(frozen=True)
class Wiring:
    service: Callable[[], Service]  # the loaded model's service; a 503 while it loads or after it failed
    server_ping_interval: float  # --sse-ping-interval (<= 0: never)
    state: Any  # app.ServerState: the serve flags the admin routes report

    def ping_interval(self, req: Any) -> float:
        """A stream's keep-alive interval: the request's sse_ping_interval, else the server's."""
        own = getattr(req, "sse_ping_interval", None)
        return self.server_ping_interval if own is None else own
