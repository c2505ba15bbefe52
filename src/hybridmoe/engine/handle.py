"""What `Engine.submit` returns: events cross from the engine thread to the caller through its queue."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Iterator

from hybridmoe.engine.request import EngineEvent, GenerationRequest


class RequestHandle:
    """The caller's side of one request: iterate events (sync or async); `cancel()` frees the slot."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop | None) -> None:
        self.request = request
        self._loop = loop
        self._aq: asyncio.Queue[EngineEvent] | None = asyncio.Queue() if loop is not None else None
        self._q: queue.Queue[EngineEvent] = queue.Queue()
        self.cancelled = threading.Event()
        self.reasoning_end = threading.Event()  # end_reasoning() was asked; the engine acts between steps
        self.finished = False
        self.slot_id = -1  # the slot it was placed in (set at admission; stays after the end)

    def cancel(self) -> None:
        self.cancelled.set()

    def end_reasoning(self) -> bool:
        """Ask the engine to close the thinking the reply is in (its reasoning budget, given at submit,
        spent at once). False when the request has no budget to close with or has ended."""
        if self.request.reasoning_budget is None or self.finished:
            return False
        self.reasoning_end.set()
        return True

    def push(self, ev: EngineEvent) -> None:
        if ev.finish_reason is not None:
            self.finished = True
        if self._aq is None:
            self._q.put(ev)
            return
        try:
            self._loop.call_soon_threadsafe(self._aq.put_nowait, ev)
        except RuntimeError:  # loop closed: the caller is gone
            self.cancelled.set()

    def __iter__(self) -> Iterator[EngineEvent]:
        while True:
            ev = self._q.get()
            yield ev
            if ev.finish_reason is not None:
                return

    async def __aiter__(self) -> AsyncIterator[EngineEvent]:
        assert self._aq is not None, "submit(..., loop=) was not given an event loop"
        while True:
            ev = await self._aq.get()
            yield ev
            if ev.finish_reason is not None:
                return
