"""The one consumer of request handles: submitting an API request's engine requests (n choices,
several prompts), merging their events through the reply builders, client disconnects, engine
errors, shutdown, the counters behind /metrics, prompt progress, SSE framing and keep-alive pings.

The APIs hand it a `Generation` and a renderer and get back replies (JSON answers) or a
streaming response; no other module iterates a `RequestHandle`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi.responses import StreamingResponse

from hybridmoe.engine.engine import (
    Engine,
    EngineEvent,
    GenerationRequest,
    PromptProgress,
    QueueFullError,
    RequestHandle,
)
from hybridmoe.server.metrics import ServerCounters
from hybridmoe.server.protocol import APIError, bad_request
from hybridmoe.server.reply import Reply, ReplyBuilder, ReplyEvent

log = logging.getLogger(__name__)

Disconnected = Callable[[], Awaitable[bool]]
DISCONNECT_POLL_S = 0.25
SSE_PING = ":\n\n"  # an SSE comment: clients ignore it, proxies and HTTP clients see the stream alive


@dataclass(frozen=True)
class SSEvent:
    """One server-sent event: a JSON object (or a bare string such as `[DONE]`), optionally named."""

    data: dict[str, Any] | str
    event: str | None = None

    def frame(self) -> str:
        data = self.data if isinstance(self.data, str) else json.dumps(self.data, ensure_ascii=False)
        return (f"event: {self.event}\n" if self.event else "") + f"data: {data}\n\n"


class StreamRenderer(Protocol):
    """An API's stream: what comes first, per reply events or progress of choice i, and last."""

    def opening(self) -> list[SSEvent]: ...

    def progress(self, choice: int, p: PromptProgress) -> list[SSEvent]: ...

    def events(self, choice: int, events: list[ReplyEvent]) -> list[SSEvent]: ...

    def closing(self) -> list[SSEvent]: ...


@dataclass
class Generation:
    """One API request's engine requests and the builder of each one's reply."""

    requests: list[GenerationRequest]
    handles: list[RequestHandle]
    builders: list[ReplyBuilder]

    def cancel(self) -> None:
        for h in self.handles:
            h.cancel()  # no-op for finished requests; frees the slots of a client that went away


class InFlight:
    """Handles of submitted requests (weakly held: a finished one drops out by itself), so that
    shutdown can end them after its grace period, each with a final event."""

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


class Consumer:
    def __init__(self, engine: Engine, counters: ServerCounters) -> None:
        self.engine = engine
        self.counters = counters
        self.inflight = InFlight()

    def submit(self, requests: Sequence[GenerationRequest], builders: Sequence[ReplyBuilder]) -> Generation:
        """All of the requests or none (a full queue: 503)."""
        handles: list[RequestHandle] = []
        try:
            loop = asyncio.get_running_loop()
            for r in requests:
                handles.append(self.inflight.add(self.engine.submit(r, loop=loop)))
        except (QueueFullError, ValueError) as e:
            for h in handles:
                h.cancel()
            if isinstance(e, QueueFullError):
                raise APIError(503, str(e), type="unavailable_error", code="server_busy") from None
            raise bad_request(str(e)) from None
        return Generation(list(requests), handles, list(builders))

    async def replies(self, gen: Generation, disconnected: Disconnected | None) -> list[Reply]:
        """The finished replies (a JSON answer); a client that goes away cancels them. Raises the
        error of a failed reply (engine error, shutdown) or of a cancelled one."""
        watch = asyncio.create_task(self._watch(gen, disconnected)) if disconnected is not None else None
        try:
            async for _ in self._merged(gen, progress=False):
                pass
        finally:
            if watch is not None:
                watch.cancel()
        replies = [b.reply for b in gen.builders]
        for r in replies:
            failure = self.failure(r)
            if failure is not None:
                raise failure
            if r.finish_reason == "cancelled":
                raise APIError(500, "generation was cancelled", type="server_error")
        return replies

    def stream(self, gen: Generation, renderer: StreamRenderer, ping_interval: float,
               progress: bool = False) -> StreamingResponse:
        """The renderer's events as SSE, with pings whenever it has been silent for `ping_interval`."""
        async def frames() -> AsyncIterator[str]:
            try:
                for e in renderer.opening():
                    yield e.frame()
                async for i, item in self._merged(gen, progress):
                    is_progress = isinstance(item, PromptProgress)
                    out = renderer.progress(i, item) if is_progress else renderer.events(i, item)
                    for e in out:
                        yield e.frame()
                for e in renderer.closing():
                    yield e.frame()
            finally:
                gen.cancel()

        return StreamingResponse(with_pings(frames(), ping_interval), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    def failure(self, reply: Reply) -> APIError | None:
        """The error a finished reply stands for: a failed generation, or one ended by shutdown."""
        if reply.finish_reason == "error":
            return APIError(500, f"generation failed: {reply.error}", type="server_error")
        if reply.finish_reason == "cancelled" and self.inflight.stopping:
            n = reply.usage.completion_tokens if reply.usage else 0
            return APIError(503, f"the server is shutting down; generation stopped after {n} tokens",
                            type="unavailable_error", code="server_shutting_down")
        return None

    # ---- the loop -----------------------------------------------------------------------------
    async def _merged(self, gen: Generation, progress: bool
                      ) -> AsyncIterator[tuple[int, list[ReplyEvent] | PromptProgress]]:
        """(choice, reply events) for every engine event until all requests have finished; with
        `progress`, also (choice, PromptProgress) as the engine pushes it, after each prompt chunk
        (the last, processed == total, before the first token). Each request is pumped into one
        queue by its own task, so the choices' events interleave as they come."""
        queue: asyncio.Queue[tuple[int, EngineEvent | None]] = asyncio.Queue()

        async def pump(i: int, h: RequestHandle) -> None:
            try:
                async for ev in h:
                    await queue.put((i, ev))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(gen.handles)]
        live = len(gen.handles)
        try:
            while live:
                i, ev = await queue.get()
                if ev is None:
                    live -= 1
                elif ev.progress is not None:
                    if progress:
                        yield i, ev.progress
                else:
                    if ev.finish_reason is not None:
                        self._finished(gen, i, ev)
                    yield i, gen.builders[i].push(ev)
            self._note_anomalies(gen)
        finally:
            for t in tasks:
                t.cancel()
            gen.cancel()

    def _finished(self, gen: Generation, i: int, ev: EngineEvent) -> None:
        if ev.usage is not None:
            self.counters.record(ev.usage)
        gen.builders[i].reply.slot_id = gen.handles[i].slot_id

    def _note_anomalies(self, gen: Generation) -> None:
        """One warning per request whose output the chat format could not fully parse."""
        found = list(dict.fromkeys(a for b in gen.builders for a in b.reply.anomalies))
        if found:
            log.warning("request %s: malformed model output, passed on as text: %s",
                        gen.requests[0].request_id, "; ".join(found[:5]))

    async def _watch(self, gen: Generation, disconnected: Disconnected) -> None:
        while True:
            if await disconnected():
                gen.cancel()
                return
            await asyncio.sleep(DISCONNECT_POLL_S)


async def with_pings(stream: AsyncIterator[str], interval_s: float) -> AsyncIterator[str]:
    """`stream`, with an SSE_PING whenever it has been silent for `interval_s` (<= 0: never), as
    llama-server's --sse-ping-interval: a long prompt on a few CPU cores can take minutes before
    the first token, longer than many proxies and clients wait for data."""
    it = stream.__aiter__()
    if interval_s <= 0:
        try:
            async for item in it:
                yield item
        finally:
            await _close(it)
        return
    pending: asyncio.Future[str] = asyncio.ensure_future(it.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield SSE_PING
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            yield item
            pending = asyncio.ensure_future(it.__anext__())
    finally:  # the client left (or the stream ended): stop the inner stream, which frees its slot
        if not pending.done():
            pending.cancel()
            try:
                await pending
            except BaseException:  # noqa: BLE001 - only waiting for the cancelled step to unwind
                pass
        await _close(it)


async def _close(it: AsyncIterator[str]) -> None:
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        await aclose()
