"""What other threads hand the engine thread: new requests, and calls to run between steps.

Its lock also orders what callers read of the engine (queue lengths, idle time) against the
engine thread's releases of slots.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from hybridmoe.engine.errors import EngineClosedError
from hybridmoe.engine.request import SequenceState

T = TypeVar("T")


class Mailbox:
    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.requests: list[SequenceState] = []  # posted, not yet taken by the engine thread
        self.closed = False
        self._calls: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []

    def post(self, seq: SequenceState) -> None:
        """Queue a request and wake the engine thread; the caller holds `lock` (it checked the room)."""
        if self.closed:
            raise EngineClosedError("the engine is shut down")
        self.requests.append(seq)
        self.lock.notify_all()

    def call(self, fn: Callable[[], T], timeout: float | None) -> T:
        """Run `fn` on the engine thread between steps; its result or its exception comes back."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self.lock:
            if self.closed:
                raise EngineClosedError("the engine is shut down")
            self._calls.append((fn, fut))
            self.lock.notify_all()
        return fut.result(timeout)

    def wait(self, busy: Callable[[], bool]) -> bool:
        """Block until there is mail or `busy()`; False once closed."""
        with self.lock:
            while not self.closed and not self.requests and not self._calls and not busy():
                self.lock.wait()
            return not self.closed

    def take(self) -> list[SequenceState]:
        """Run the calls posted so far (each caller gets its result), then the requests posted."""
        with self.lock:
            requests, self.requests = self.requests, []
            calls, self._calls = self._calls, []
        for fn, fut in calls:
            try:
                fut.set_result(fn())
            except Exception as e:  # the caller gets the error; the engine goes on
                fut.set_exception(e)
        return requests

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.lock.notify_all()

    def drain(self) -> list[SequenceState]:
        """After close: the requests never taken; the calls never run fail with EngineClosedError."""
        with self.lock:
            requests, self.requests = self.requests, []
            calls, self._calls = self._calls, []
        for _, fut in calls:
            fut.set_exception(EngineClosedError("the engine is shut down"))
        return requests
