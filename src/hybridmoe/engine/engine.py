"""Engine: one thread owns the model; HTTP handlers submit requests and read per-request events.

Each step is one `model.forward` call holding one token of every decoding slot plus prefill chunks
of newly admitted requests (at most `batch_size` prompt tokens), so the MoE reads each expert's
weights once for all slots (continuous batching). A request is placed on the free slot whose cached
tokens share the longest prefix with its prompt; that prefix is kept (`cache.truncate`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridmoe.engine.json_constraint import FirstByteIndex, JsonConstraint
from hybridmoe.engine.json_schema import SchemaState
from hybridmoe.engine.sampling import Sampler, SamplingParams, TokenLogprobs
from hybridmoe.models.gpt_oss import SeqChunk
from hybridmoe.tokenizer.tokenizer import IncrementalDecoder

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_queue`; the server answers 503."""


class EngineClosedError(RuntimeError):
    """The engine was shut down."""


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stop: Sequence[str] = ()
    logprobs: int | None = None  # None: no logprobs; k >= 0: chosen token's logprob + top k
    # Test hook: these ids replace the sampler's choices in order (the model still runs), so the
    # harmony/tool-call paths can be exercised through a real server with a random model.
    forced_tokens: Sequence[int] | None = None
    json_mode: bool = False  # sample only tokens that continue a JSON object (then end)
    json_schema: dict | None = None  # json_schema.compile_schema's output: JSON mode for that schema
    json_end_ids: Sequence[int] | None = None  # JSON mode ends with one of these (default: the stop ids)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class EngineEvent:
    """One generated token (`token_id`, `text` delta), or the final event (`finish_reason` set)."""

    token_id: int | None = None
    text: str = ""  # complete UTF-8 only; held back while it could still start a stop string
    logprob: TokenLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    stop_token_id: int | None = None  # the end-of-generation id that ended it (not in the text)
    timings: dict[str, float] | None = None
    usage: Usage | None = None
    error: str | None = None


class RequestHandle:
    """The caller's side of one request: iterate events (sync or async); `cancel()` frees the slot."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop | None) -> None:
        self.request = request
        self._loop = loop
        self._aq: asyncio.Queue[EngineEvent] | None = asyncio.Queue() if loop is not None else None
        self._q: queue.Queue[EngineEvent] = queue.Queue()
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()

    def _push(self, ev: EngineEvent) -> None:
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


def safe_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of `text` that cannot be the start of a stop string (the rest is held back)."""
    keep = len(text)
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                keep = min(keep, len(text) - n)
                break
    return keep


class _Active:
    """Per-request generation state, owned by the engine thread."""

    def __init__(self, handle: RequestHandle, tokenizer: Any, eog_ids: frozenset[int],
                 json_index: Callable[[], FirstByteIndex]) -> None:
        req = handle.request
        self.handle = handle
        self.req = req
        self.sampler = Sampler(req.params)
        self.decoder = IncrementalDecoder(tokenizer)
        self.stop_ids = frozenset(req.params.stop_ids) | (frozenset() if req.params.ignore_eos else eog_ids)
        self.constraint = None
        if req.json_mode or req.json_schema is not None:
            state = SchemaState(req.json_schema) if req.json_schema is not None else None
            ends = self.stop_ids if req.json_end_ids is None else frozenset(req.json_end_ids)
            self.constraint = JsonConstraint(tokenizer.token_bytes, ends, tokenizer.special_ids, state, json_index())
        self.pending: list[int] = []  # prompt tokens not yet fed
        self.next_token: int | None = None  # sampled, not yet fed
        self.n_generated = 0
        self.n_cached = 0
        self.held = ""  # decoded text not yet emitted (stop-string hold-back)
        self.t_start = time.perf_counter()
        self.t_first: float | None = None

    def timings(self) -> dict[str, float]:
        now = time.perf_counter()
        t_first = self.t_first or now
        prompt_n = len(self.req.prompt_ids) - self.n_cached
        prompt_ms = (t_first - self.t_start) * 1e3
        predicted_ms = (now - t_first) * 1e3
        return {
            "cache_n": self.n_cached,
            "prompt_n": prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_second": prompt_n * 1e3 / prompt_ms if prompt_ms > 0 else 0.0,
            "predicted_n": self.n_generated,
            "predicted_ms": predicted_ms,
            "predicted_per_second": self.n_generated * 1e3 / predicted_ms if predicted_ms > 0 else 0.0,
        }

    def usage(self) -> Usage:
        return Usage(len(self.req.prompt_ids), self.n_generated, self.n_cached)


@dataclass
class _Slot:
    id: int
    cache: Any = None
    tokens: list[int] = field(default_factory=list)  # ids whose KV is in `cache`
    active: _Active | None = None
    last_used: float = 0.0


@dataclass
class Metrics:
    """Counters for /metrics (llama-server's names are applied by the server)."""

    prompt_tokens_total: int = 0
    prompt_seconds_total: float = 0.0
    tokens_predicted_total: int = 0
    tokens_predicted_seconds_total: float = 0.0
    n_decode_total: int = 0
    n_busy_slots_total: int = 0
    requests_total: int = 0
    requests_rejected_total: int = 0
    n_tokens_max: int = 0


class Engine:
    """Continuous-batching engine over `llm.model` (see module docstring).

    `llm` provides `.model` (`make_cache(max_ctx)`, `forward(chunks) -> logits [n_chunks, V]`) and
    `.tokenizer`. Start with `start()`, stop with `close()`.
    """

    def __init__(
        self,
        llm: Any,
        n_parallel: int,
        ctx_size_per_slot: int,
        max_queue: int,
        batch_size: int = 2048,
    ) -> None:
        if n_parallel < 1:
            raise ValueError(f"n_parallel must be >= 1, got {n_parallel}")
        if ctx_size_per_slot < 2:
            raise ValueError(f"context per slot must be >= 2 tokens, got {ctx_size_per_slot}")
        if max_queue < 0 or batch_size < 1:
            raise ValueError(f"max_queue must be >= 0 and batch_size >= 1, got {max_queue}, {batch_size}")
        self.llm = llm
        self.model = llm.model
        self.tokenizer = llm.tokenizer
        self.eog_ids = frozenset(self.tokenizer.eog_ids)
        self._json_first_bytes: FirstByteIndex | None = None
        self.n_parallel = n_parallel
        self.ctx_size_per_slot = ctx_size_per_slot
        self.max_queue = max_queue
        self.batch_size = batch_size
        self.slots = [_Slot(i) for i in range(n_parallel)]
        self.metrics = Metrics()
        self._waiting: collections.deque[RequestHandle] = collections.deque()
        self._n_free = n_parallel
        self._cv = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None

    # ---- caller side (any thread) ---------------------------------------------------------------
    def start(self) -> Engine:
        self._thread = threading.Thread(target=self._run, name="hybridmoe-engine", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop | None = None) -> RequestHandle:
        """Queue a request; events arrive on the returned handle (async iteration if `loop` given).

        Raises ValueError for an empty or too-long prompt, QueueFullError when `max_queue` requests
        already wait for a slot.
        """
        request.params.validate()
        n = len(request.prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= self.ctx_size_per_slot:
            raise ValueError(
                f"the prompt has {n} tokens; the context of a slot is {self.ctx_size_per_slot} tokens"
            )
        handle = RequestHandle(request, loop)
        with self._cv:
            if self._closing:
                raise EngineClosedError("the engine is shut down")
            if len(self._waiting) - self._n_free >= self.max_queue:
                self.metrics.requests_rejected_total += 1
                raise QueueFullError(
                    f"server busy: {len(self._waiting)} requests already wait for one of {self.n_parallel} slots"
                )
            self._waiting.append(handle)
            self.metrics.requests_total += 1
            self._cv.notify_all()
        return handle

    def generate(self, request: GenerationRequest) -> list[EngineEvent]:
        """Blocking helper: all events of one request."""
        return list(self.submit(request))

    def status(self) -> dict[str, Any]:
        """Snapshot for /slots and /metrics (read without stopping the engine)."""
        slots = []
        for s in self.slots:
            a = s.active
            slots.append(
                {
                    "id": s.id,
                    "n_ctx": self.ctx_size_per_slot,
                    "is_processing": a is not None,
                    "n_cached_tokens": len(s.tokens),
                    "id_task": a.req.request_id if a is not None else None,
                    "n_decoded": a.n_generated if a is not None else 0,
                }
            )
        with self._cv:
            waiting = len(self._waiting)
        return {"slots": slots, "requests_waiting": waiting}

    # ---- engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._closing and not self._waiting and not self._any_active():
                    self._cv.wait()
                if self._closing:
                    break
                self._admit_locked()
            try:
                self._step()
            except Exception as e:  # one bad step must not kill the server: fail those requests
                log.exception("engine step failed")
                for s in self.slots:
                    if s.active is not None:
                        self._finish(s, "error", error=f"{type(e).__name__}: {e}")
                        s.cache, s.tokens = None, []
        for s in self.slots:
            if s.active is not None:
                self._finish(s, "cancelled")
        with self._cv:
            while self._waiting:
                self._waiting.popleft()._push(EngineEvent(finish_reason="cancelled"))

    def _any_active(self) -> bool:
        return any(s.active is not None for s in self.slots)

    def _admit_locked(self) -> None:
        while self._waiting:
            free = [s for s in self.slots if s.active is None]
            if not free:
                return
            handle = self._waiting.popleft()
            if handle.cancelled.is_set():
                handle._push(EngineEvent(finish_reason="cancelled"))
                continue
            prompt = handle.request.prompt_ids
            # Longest shared prefix wins; among equals the least recently used slot.
            slot = max(free, key=lambda s: (_common_prefix(s.tokens, prompt), -s.last_used))
            try:
                self._place(slot, handle)
            except Exception as e:  # e.g. no memory for a KV cache: fail this request, keep serving
                log.exception("could not place a request on slot %d", slot.id)
                slot.cache, slot.tokens, slot.active = None, [], None
                handle._push(EngineEvent(finish_reason="error", error=f"{type(e).__name__}: {e}"))
                continue
            self._n_free -= 1

    def _place(self, slot: _Slot, handle: RequestHandle) -> None:
        prompt = handle.request.prompt_ids
        act = _Active(handle, self.tokenizer, self.eog_ids, self._json_index)
        keep = min(_common_prefix(slot.tokens, prompt), len(prompt) - 1)  # >= 1 token to get logits
        if slot.cache is None:
            slot.cache = self.model.make_cache(self.ctx_size_per_slot)
            keep = 0
        keep = slot.cache.truncate(keep)  # may keep less (sliding-window ring already overwritten)
        slot.tokens = slot.tokens[:keep]
        act.n_cached = keep
        act.pending = list(prompt[keep:])
        slot.active = act

    def _step(self) -> None:
        for s in self.slots:
            if s.active is not None and s.active.handle.cancelled.is_set():
                self._finish(s, "cancelled")
        chunks: list[SeqChunk] = []
        fed: list[tuple[_Slot, list[int]]] = []
        for s in self.slots:  # decode tokens first: one per decoding slot
            a = s.active
            if a is not None and not a.pending and a.next_token is not None:
                chunks.append(SeqChunk(s.cache, [a.next_token]))
                fed.append((s, [a.next_token]))
        budget = self.batch_size
        for s in self.slots:
            a = s.active
            if a is not None and a.pending and budget > 0:
                part = a.pending[:budget]
                budget -= len(part)
                chunks.append(SeqChunk(s.cache, part))
                fed.append((s, part))
        if not chunks:
            return
        t0 = time.perf_counter()
        logits = self.model.forward(chunks)  # [n_chunks, V]
        dt = time.perf_counter() - t0
        m = self.metrics
        m.n_decode_total += 1
        m.n_busy_slots_total += len(chunks)
        m.n_tokens_max = max(m.n_tokens_max, sum(len(t) for _, t in fed))
        n_prefill = sum(len(t) for s, t in fed if s.active.pending)
        for row, (s, toks) in zip(logits, fed):
            a = s.active
            s.tokens.extend(toks)
            if a.pending:
                del a.pending[: len(toks)]
                m.prompt_tokens_total += len(toks)
                if a.pending:
                    continue  # more prompt chunks to go
            else:
                a.next_token = None
            self._on_logits(s, row)
        total = sum(len(t) for _, t in fed)
        if total:
            m.prompt_seconds_total += dt * n_prefill / total
            m.tokens_predicted_seconds_total += dt * (total - n_prefill) / total

    def _json_index(self) -> FirstByteIndex:
        """The vocabulary grouped by first byte, built on the first JSON-mode request (~0.1 s for
        201k tokens, on the engine thread) and kept."""
        if self._json_first_bytes is None:
            tk = self.tokenizer
            self._json_first_bytes = FirstByteIndex(tk.token_bytes, tk.vocab_size, tk.special_ids)
        return self._json_first_bytes

    def _on_logits(self, slot: _Slot, row: torch.Tensor) -> None:
        a = slot.active
        req = a.req
        forced = req.forced_tokens
        if forced is not None and a.n_generated < len(forced):
            token = int(forced[a.n_generated])
        else:
            try:
                token = int(a.sampler.sample(row, a.constraint))
                if a.constraint is not None:
                    a.constraint.advance(token)
            except ValueError as e:  # a constraint with nothing left to allow: this request only
                log.exception("sampling failed for request %s", req.request_id)
                self._finish(slot, "error", error=f"sampling: {e}")
                return
        if a.t_first is None:
            a.t_first = time.perf_counter()
        a.n_generated += 1
        self.metrics.tokens_predicted_total += 1
        lp = Sampler.logprobs(row, token, req.logprobs) if req.logprobs is not None else None
        if token in a.stop_ids:
            self._emit_text(a, token, lp, final=True)
            self._finish(slot, "stop", stop_token_id=token)
            return
        a.held += a.decoder.push(token)
        hit = find_stop(a.held, req.stop)
        if hit is not None:
            a.held = a.held[:hit]
            self._emit_text(a, token, lp, final=True)
            self._finish(slot, "stop")
            return
        out_of_ctx = slot.cache.length >= self.ctx_size_per_slot  # no room to feed it
        if a.n_generated >= req.params.max_tokens or out_of_ctx:
            a.held += a.decoder.flush()
            self._emit_text(a, token, lp, final=True)
            self._finish(slot, "length")
            return
        self._emit_text(a, token, lp, final=False)
        a.next_token = token

    def _emit_text(self, a: _Active, token: int, lp: TokenLogprobs | None, final: bool) -> None:
        n = len(a.held) if final else safe_prefix_len(a.held, a.req.stop)
        text, a.held = a.held[:n], a.held[n:]
        is_stop_token = token in a.stop_ids
        if text or not is_stop_token:
            a.handle._push(EngineEvent(token_id=None if is_stop_token else token, text=text, logprob=lp))

    def _finish(self, slot: _Slot, reason: str, stop_token_id: int | None = None, error: str | None = None) -> None:
        a = slot.active
        final = EngineEvent(finish_reason=reason, stop_token_id=stop_token_id, timings=a.timings(),
                            usage=a.usage(), error=error)
        slot.last_used = time.perf_counter()
        # Free the slot before the caller hears of the end: a finished response implies an idle slot.
        with self._cv:
            self._n_free += 1
            slot.active = None
        a.handle._push(final)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def find_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index of the earliest stop string in `text`, or None."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None
