"""uvicorn's server with a bounded shutdown: on SIGTERM it stops accepting at once, lets requests
in flight run for a grace period, then ends them through the engine so each client still gets a
final event (an error saying the server is stopping) rather than a cut connection."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import Any

import uvicorn

log = logging.getLogger("hybridmoe.serve")


class GracefulServer(uvicorn.Server):
    # After the grace period: time left for the final events to reach the clients before uvicorn
    # cancels what still runs (one engine step ends every request).
    FINAL_EVENT_SECONDS = 5.0

    def __init__(self, config: uvicorn.Config, grace: float, state: Any,
                 on_stopped: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self.grace = grace
        self.state = state  # server.app.ServerState: its `service` appears once the model is loaded
        # Run once the requests are over. Here rather than after run(): uvicorn ends a run stopped by
        # a signal by raising that signal again, and the process is gone before run() returns.
        self.on_stopped = on_stopped

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = asyncio.get_running_loop().call_later(self.grace, self.end_requests)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()
        if self.on_stopped is not None:
            self.on_stopped()

    def end_requests(self) -> None:
        service = self.state.service
        n = service.consumer.inflight.end_all() if service is not None else 0
        if n:
            log.warning("shutting down: %d request(s) still running after %.1f s, ending them", n, self.grace)
