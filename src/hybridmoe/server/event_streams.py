"""Merging the events of several engine requests (n > 1 choices, several prompts) into one stream,
with llama-server's `prompt_progress` reports while prompts are being processed.

Each request's events are pumped into one queue by its own task, so waiting with a timeout (to
poll prompt progress) never cancels an event iterator half-way.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from hybridmoe.engine.engine import EngineEvent, RequestHandle

PROGRESS_POLL_S = 0.1


@dataclass
class Progress:
    """llama-server's prompt_progress: overall progress is processed/total."""

    total: int
    cache: int
    processed: int
    time_ms: float

    def to_json(self) -> dict[str, Any]:
        return {"total": self.total, "cache": self.cache, "processed": self.processed, "time_ms": int(self.time_ms)}


def _slot_of(engine: Any, request_id: str) -> dict[str, Any] | None:
    for s in engine.status()["slots"]:
        if s.get("id_task") == request_id:
            return s
    return None


async def merged_events(handles: Sequence[RequestHandle], engine: Any = None,
                        progress: bool = False) -> AsyncIterator[tuple[int, EngineEvent | Progress]]:
    """(index, event) for every request until all have finished; with `progress`, (index, Progress)
    items while a prompt is processed, the last with processed == total just before its first token."""
    queue: asyncio.Queue[tuple[int, EngineEvent | None]] = asyncio.Queue()

    async def pump(i: int, h: RequestHandle) -> None:
        try:
            async for ev in h:
                await queue.put((i, ev))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    t0 = time.perf_counter()
    started = [False] * len(handles)
    seen = [-1] * len(handles)
    live = len(handles)
    try:
        while live:
            try:
                i, ev = await asyncio.wait_for(queue.get(), PROGRESS_POLL_S) if progress else await queue.get()
            except asyncio.TimeoutError:
                for k, h in enumerate(handles):
                    p = None if started[k] else _progress(engine, h, t0)
                    if p is not None and p.processed != seen[k]:
                        seen[k] = p.processed
                        yield k, p
                continue
            if ev is None:
                live -= 1
                continue
            if progress and not started[i]:
                started[i] = True
                total = len(handles[i].request.prompt_ids)
                if seen[i] != total and ev.finish_reason in (None, "stop", "length"):
                    cache = ev.usage.cached_tokens if ev.usage is not None else _cached(engine, handles[i])
                    yield i, Progress(total, cache, total, (time.perf_counter() - t0) * 1e3)
            yield i, ev
    finally:
        for t in tasks:
            t.cancel()
        for h in handles:
            h.cancel()  # no-op for finished requests; frees the slots of a client that went away


def _cached(engine: Any, h: RequestHandle) -> int:
    s = _slot_of(engine, h.request.request_id) if engine is not None else None
    return int(s.get("n_prompt_cached", 0)) if s is not None else 0


def _progress(engine: Any, h: RequestHandle, t0: float) -> Progress | None:
    s = _slot_of(engine, h.request.request_id) if engine is not None else None
    if s is None:
        return None
    total = len(h.request.prompt_ids)
    processed = min(int(s["n_cached_tokens"]), total)
    return Progress(total, int(s.get("n_prompt_cached", 0)), processed, (time.perf_counter() - t0) * 1e3)


SSE_PING = ":\n\n"  # an SSE comment: clients ignore it, proxies and HTTP clients see the stream alive


async def with_pings(stream: AsyncIterator[str], interval_s: float) -> AsyncIterator[str]:
    """`stream`, with an SSE_PING whenever it has been silent for `interval_s` (<= 0: never), as
    llama-server's --sse-ping-interval: a long prompt on a few CPU cores can take minutes before
    the first token, longer than many proxies and clients wait for data."""
    if interval_s <= 0:
        async for item in stream:
            yield item
        return
    it = stream.__aiter__()
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
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()
