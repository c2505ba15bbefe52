"""Engine: one thread owns the model and runs steps: scheduler -> runner -> output processor.

Each step is one `model.forward` holding one token of every decoding sequence plus prompt chunks
(at most `batch_size` prompt tokens), so the MoE reads each expert's weights once for all slots
(continuous batching). `LLM.generate` drives the same steps from its own thread (`run`): there
is one decode loop in the project.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

from hybridmoe.engine.output import Metrics, OutputProcessor, find_stop, safe_prefix_len
from hybridmoe.engine.request import EngineEvent, GenerationRequest, ModelInfo, Sequence, Usage
from hybridmoe.engine.runner import ModelRunner
from hybridmoe.engine.scheduler import MIN_SAVED_TOKENS, Admission, CacheConfig, CachedPrompt, Checkpoint, Scheduler
from hybridmoe.engine.speculative import SHARED_STEP_STRETCH, SequenceDrafts, SpeculativeSettings, StepCosts

__all__ = [
    "CacheConfig", "Engine", "EngineClosedError", "EngineEvent", "GenerationRequest", "Metrics", "ModelInfo",
    "QueueFullError", "RequestHandle", "SlotError", "Usage", "find_stop", "safe_prefix_len",
]

log = logging.getLogger(__name__)
T = TypeVar("T")


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_queue`; the server answers 503."""


class EngineClosedError(RuntimeError):
    """The engine was shut down."""


class SlotError(ValueError):
    """A slot action names a slot that does not exist or is busy."""


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


class Engine:
    """Continuous-batching engine over `llm.model` (see module docstring).

    `llm` provides `.model` (`make_cache(max_ctx)`, `cache_layout()`, `forward(chunks)`) and
    `.tokenizer`. Serve with `start()` ... `close()`, or drive it with `run(request)`.
    """

    def __init__(
        self,
        llm: Any,
        n_parallel: int,
        ctx_size_per_slot: int,
        max_queue: int,
        batch_size: int = 2048,
        cache: CacheConfig | None = None,
        speculative: SpeculativeSettings = SpeculativeSettings(),
    ) -> None:
        if n_parallel < 1:
            raise ValueError(f"n_parallel must be >= 1, got {n_parallel}")
        if ctx_size_per_slot < 2:
            raise ValueError(f"context per slot must be >= 2 tokens, got {ctx_size_per_slot}")
        if max_queue < 0 or batch_size < 1:
            raise ValueError(f"max_queue must be >= 0 and batch_size >= 1, got {max_queue}, {batch_size}")
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self.model_info = _model_info(llm)
        self.n_parallel = n_parallel
        self.ctx_size_per_slot = ctx_size_per_slot
        self.max_queue = max_queue
        self.batch_size = batch_size
        self.metrics = Metrics()
        self.speculative = speculative
        self.step_costs = StepCosts()  # measured step times, for the draft length choice
        self.runner = ModelRunner(llm.model, self.tokenizer, n_parallel, ctx_size_per_slot)
        self.scheduler = Scheduler(n_parallel, batch_size, self.runner.geometry(), cache or CacheConfig())
        self.output = OutputProcessor(self.tokenizer, self.metrics)
        self._inbox: list[Sequence] = []
        self._calls: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []
        self.states_changed = 0  # requests ended so far: the slots' states are not what they were
        self.last_finished = time.monotonic()
        self._cv = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._model_identity: dict[str, Any] | None = None

    # ---- caller side (any thread) ---------------------------------------------------------------
    def start(self) -> Engine:
        self._thread = threading.Thread(target=self._loop, name="hybridmoe-engine", daemon=True)
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
        if not -1 <= request.id_slot < self.n_parallel:
            raise ValueError(f"id_slot must be -1 (any) or a slot id 0..{self.n_parallel - 1}, got {request.id_slot}")
        handle = RequestHandle(request, loop)
        with self._cv:
            if self._closing:
                raise EngineClosedError("the engine is shut down")
            n_free = sum(s.seq is None for s in self.scheduler.slots)
            if len(self._inbox) + len(self.scheduler.waiting) - n_free >= self.max_queue:
                self.metrics.requests_rejected_total += 1
                raise QueueFullError(
                    f"server busy: {len(self._inbox) + len(self.scheduler.waiting)} requests already wait "
                    f"for one of {self.n_parallel} slots"
                )
            self._inbox.append(Sequence(request, handle))
            self.metrics.requests_total += 1
            self._cv.notify_all()
        return handle

    def generate(self, request: GenerationRequest) -> list[EngineEvent]:
        """All events of one request (blocking); drives the steps itself if not started."""
        if self._thread is not None:
            return list(self.submit(request))
        return self.run(request)

    def run(self, request: GenerationRequest) -> list[EngineEvent]:
        """Submit and run steps on this thread until the request ends (no engine thread)."""
        handle = self.submit(request)
        while not handle.finished:
            self.step()
        return list(handle)

    def call(self, fn: Callable[[], T], timeout: float | None = 60.0) -> T:
        """Run `fn` on the engine thread between steps (slot files, erase) and return its result."""
        if self._thread is None:
            return fn()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._closing:
                raise EngineClosedError("the engine is shut down")
            self._calls.append((fn, fut))
            self._cv.notify_all()
        return fut.result(timeout)

    # ---- slot files (llama-server's /slots/{id}?action=...) -------------------------------------------
    def save_slot(self, slot_id: int, path: str) -> dict[str, Any]:
        """Write an idle slot's tokens and KV state (with its checkpoints) to `path`."""
        return self.call(lambda: self._save_slot(slot_id, path))

    def restore_slot(self, slot_id: int, path: str) -> dict[str, Any]:
        """Load a file written by `save_slot` (same model, context and KV type) into an idle slot.
        Raises slot_files.SlotFileError for a file that does not fit, before the slot is touched."""
        return self.call(lambda: self._restore_slot(slot_id, path))

    def erase_slot(self, slot_id: int) -> dict[str, Any]:
        return self.call(lambda: self._erase_slot(slot_id))

    def _idle_slot(self, slot_id: int) -> Any:
        if not 0 <= slot_id < self.n_parallel:
            raise SlotError(f"slot {slot_id} does not exist (slots 0..{self.n_parallel - 1})")
        slot = self.scheduler.slots[slot_id]
        if slot.seq is not None:
            raise SlotError(f"slot {slot_id} is processing a request")
        return slot

    def _identity(self) -> dict[str, Any]:
        from hybridmoe.engine import slot_files

        if self._model_identity is None:
            dtype = self.runner.model.cache_layout().dtype
            self._model_identity = slot_files.model_identity(self.llm.file, self.ctx_size_per_slot, dtype)
        return self._model_identity

    def _save_slot(self, slot_id: int, path: str) -> dict[str, Any]:
        from hybridmoe.engine import slot_files

        slot = self._idle_slot(slot_id)
        t0 = time.perf_counter()
        state = slot_files.SlotState(list(slot.tokens), self.runner.snapshot(slot_id, full_layers=True),
                                     [c.data for c in slot.checkpoints])
        n = slot_files.save(path, self._identity(), state)
        return {"n_saved": len(slot.tokens), "n_written": n, "save_ms": (time.perf_counter() - t0) * 1e3}

    def _restore_slot(self, slot_id: int, path: str) -> dict[str, Any]:
        from hybridmoe.engine import slot_files

        slot = self._idle_slot(slot_id)
        t0 = time.perf_counter()
        state, n_read = slot_files.load(path, self._identity())
        try:
            self.runner.restore(slot_id, state.snapshot)
            checks = [self.runner.cache(slot_id).check_snapshot(c) for c in state.checkpoints]
        except ValueError as e:  # shapes that do not fit this cache: refuse, leave nothing half-made
            self.scheduler.forget(slot)
            self.runner.drop_cache(slot_id)
            raise slot_files.SlotFileError(f"{path}: {e}") from None
        self.scheduler.restored(slot, state.tokens, state.snapshot.ring_lo, checks)
        return {"n_restored": len(state.tokens), "n_read": n_read, "restore_ms": (time.perf_counter() - t0) * 1e3}

    def _erase_slot(self, slot_id: int) -> dict[str, Any]:
        slot = self._idle_slot(slot_id)
        n = len(slot.tokens)
        self.scheduler.forget(slot)
        self.runner.drop_cache(slot_id)
        return {"n_erased": n}

    # ---- the prompt cache across restarts (serve --prompt-cache-dir) ------------------------------------
    def prompt_states(self) -> list[Any]:
        """The slots' and the RAM cache's states as prompt_store.Kept. Read on the engine thread
        between steps while it runs; a slot's state is copied only when `take` is called, and only
        if the slot still holds the same tokens."""
        from hybridmoe.engine import prompt_store

        def on_engine_thread(fn: Callable[[], T]) -> T:
            return self.call(fn) if self._thread is not None and self._thread.is_alive() else fn()

        def taker(slot_id: int, tokens: list[int]) -> Callable[[], Any]:
            def copy() -> Any:
                slot = self.scheduler.slots[slot_id]
                return self.runner.snapshot(slot_id, full_layers=True) if slot.tokens == tokens else None
            return lambda: on_engine_thread(copy)

        def collect() -> list[prompt_store.Kept]:
            sched = self.scheduler
            states = [prompt_store.Kept(list(s.tokens), None, [c.data for c in s.checkpoints], s.last_used,
                                        self.runner.cache(s.id).snapshot_nbytes(), taker(s.id, list(s.tokens)))
                      for s in sched.slots if len(s.tokens) >= MIN_SAVED_TOKENS]
            return states + [prompt_store.Kept(list(e.tokens), e.data, [c.data for c in e.checkpoints], e.last_used)
                             for e in sched.prompt_cache.entries]

        return on_engine_thread(collect)

    def save_prompt_cache(self, directory: str) -> tuple[int, int]:
        """Write the states worth keeping to `directory` (prompt_store.save); (files, bytes written)."""
        from hybridmoe.engine import prompt_store

        return prompt_store.save(directory, self._identity(), self.prompt_states(), self.scheduler.prompt_cache.limit)

    def load_prompt_cache(self, directory: str) -> tuple[int, int]:
        """Before start(): the states `save_prompt_cache` wrote into the RAM cache, as far as its
        limit allows (files for another model, context or KV type are skipped). Returns (entries, bytes)."""
        from hybridmoe.engine import prompt_store

        cache = self.scheduler.prompt_cache
        n = 0
        for k in prompt_store.load(directory, self._identity(), self.runner.cache(0).check_snapshot):
            checkpoints = [Checkpoint(c.length, c.ring_lo, c.nbytes, c) for c in k.checkpoints
                           if c.length <= len(k.tokens)]
            n += cache.put(CachedPrompt(k.tokens, k.snapshot.ring_lo, k.snapshot.nbytes, k.snapshot, checkpoints))
        return n, cache.nbytes

    def status(self) -> dict[str, Any]:
        """Snapshot for /slots and /metrics (read without stopping the engine)."""
        slots = []
        for s in self.scheduler.slots:
            seq = s.seq
            slots.append({
                "id": s.id,
                "n_ctx": self.ctx_size_per_slot,
                "is_processing": seq is not None,
                "n_cached_tokens": len(s.tokens),
                "n_checkpoints": len(s.checkpoints),
                "checkpoint_bytes": s.checkpoint_bytes,
                "id_task": seq.request.request_id if seq is not None else None,
                "n_decoded": seq.n_generated if seq is not None else 0,
                "n_prompt_cached": seq.n_cached if seq is not None else 0,  # prompt tokens reused from a cache
                "n_prompt_tokens": len(seq.prompt) if seq is not None else 0,
                "n_prompt_pending": len(seq.pending) if seq is not None else 0,  # not yet fed
                "max_tokens": seq.request.params.max_tokens if seq is not None else -1,
                "sampling": seq.request.params if seq is not None else None,
                "n_probs": (seq.request.logprobs or 0) if seq is not None else 0,
                "speculative": self.speculative.enabled,
            })
        with self._cv:
            waiting = len(self._inbox) + len(self.scheduler.waiting)
        return {"slots": slots, "requests_waiting": waiting, "memory": self.scheduler.memory()}

    # ---- engine thread ----------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._closing and not self._inbox and not self._calls and not self._busy():
                    self._cv.wait()
                if self._closing:
                    break
            self.step()
        for seq in self.scheduler.running():
            self._finish(seq, "cancelled")
        with self._cv:
            pending = self._inbox + list(self.scheduler.waiting)
            self._inbox.clear()
            self.scheduler.waiting.clear()
            calls, self._calls = self._calls, []
        for seq in pending:
            seq.sink.push(EngineEvent(finish_reason="cancelled"))
        for _, fut in calls:
            fut.set_exception(EngineClosedError("the engine is shut down"))

    def idle_seconds(self) -> float:
        """Seconds since the last request ended; 0 while any runs or waits."""
        with self._cv:
            if self._inbox or self._busy():
                return 0.0
            return time.monotonic() - self.last_finished

    def _busy(self) -> bool:
        return bool(self.scheduler.waiting) or bool(self.scheduler.running())

    def step(self) -> None:
        """One iteration: queued calls, admissions, one forward, sampling and output."""
        with self._cv:
            inbox, self._inbox = self._inbox, []
            calls, self._calls = self._calls, []
        for fn, fut in calls:
            try:
                fut.set_result(fn())
            except Exception as e:  # the caller gets the error; the engine goes on
                fut.set_exception(e)
        for seq in inbox:
            if seq.sink.cancelled.is_set():
                seq.sink.push(EngineEvent(finish_reason="cancelled"))
            else:
                self.scheduler.waiting.append(seq)
        for seq in self.scheduler.running():
            if seq.sink.cancelled.is_set():
                self._finish(seq, "cancelled")
            elif seq.sink.reasoning_end.is_set():
                seq.sink.reasoning_end.clear()
                if seq.budget is not None:
                    seq.budget.end_now()
        for adm in self.scheduler.admit():
            adm.seq.sink.slot_id = adm.slot.id
            self._admit(adm)
        try:
            self._forward()
        except Exception as e:  # one bad step must not kill the server: fail those requests
            log.exception("engine step failed")
            for seq in self.scheduler.running():
                slot = self.scheduler.slots[seq.slot_id]
                self._finish(seq, "error", error=f"{type(e).__name__}: {e}")
                self.scheduler.forget(slot)
                self.runner.drop_cache(slot.id)

    def _admit(self, adm: Admission) -> None:
        seq, slot = adm.seq, adm.slot
        try:
            if adm.save_first:
                snap = self.runner.snapshot(slot.id, full_layers=True)
                self.scheduler.save_slot(slot, snap, snap.nbytes)
            kept = self.runner.load(adm)
            if kept != adm.reuse.keep:  # the scheduler's arithmetic and the cache disagree: a bug
                log.error("slot %d kept %d tokens, %d planned", slot.id, kept, adm.reuse.keep)
            self.scheduler.loaded(adm, kept)
            self.runner.prepare(seq)
            if self.speculative.enabled:
                seq.drafts = SequenceDrafts(self.speculative)
                seq.drafts.extend(seq.prompt)
            self.output.start(seq)
        except Exception as e:  # e.g. no memory for a KV cache: fail this request, keep serving
            log.exception("could not place a request on slot %d", slot.id)
            self.scheduler.forget(slot)
            self.runner.drop_cache(slot.id)
            self._finish(seq, "error", error=f"{type(e).__name__}: {e}")

    def _forward(self) -> None:
        if self.speculative.enabled:
            self._propose_drafts()
        plan = self.scheduler.plan_step()
        if not plan.batch:
            return
        decoding = [not seq.pending for seq, _ in plan.batch]  # before `fed` empties the prompts
        t0 = time.perf_counter()
        logits = self.runner.forward(plan)  # per entry: each token's logits when decoding, else the last's
        dt = time.perf_counter() - t0
        self.step_costs.record(plan.n_tokens, dt)
        m = self.metrics
        m.n_decode_total += 1
        m.n_busy_slots_total += len(plan.batch)
        m.n_tokens_max = max(m.n_tokens_max, plan.n_tokens)
        n_prefill = sum(len(t) for (seq, t), dec in zip(plan.batch, decoding) if not dec)
        m.prompt_tokens_total += n_prefill
        m.prompt_seconds_total += dt * n_prefill / plan.n_tokens
        m.tokens_predicted_seconds_total += dt * (plan.n_tokens - n_prefill) / plan.n_tokens
        off = 0
        for (seq, toks), dec in zip(plan.batch, decoding):
            n_rows = len(toks) if dec else 1
            rows, off = logits[off : off + n_rows], off + n_rows
            slot = self.scheduler.slots[seq.slot_id]
            if self.scheduler.fed(seq, toks):
                snap = self.runner.snapshot(slot.id, full_layers=False)
                self.scheduler.add_checkpoint(slot, snap, snap.nbytes)
            if seq.pending:
                continue
            if n_rows > 1:
                self._verify(seq, rows, toks)
            else:
                self._on_logits(seq, rows[0], self.runner.cache_length(seq.slot_id) < self.ctx_size_per_slot)

    def _propose_drafts(self) -> None:
        """Each decoding sequence's draft for this step, cut to what the measured costs make pay."""
        running = self.scheduler.running()
        decoding = [s for s in running if not s.pending and s.next_token is not None]
        base = len(decoding) + min(self.batch_size, sum(len(s.pending) for s in running))
        shared = base > 1 and self.step_costs.known()  # others wait for this step: bound its stretch
        cap = SHARED_STEP_STRETCH * self.step_costs.estimate(base) if shared else None
        for seq in decoding:
            left = seq.request.params.max_tokens - seq.n_generated - 1  # the sampled token is counted
            room = min(self.scheduler.draft_room(seq, self.ctx_size_per_slot), left)
            base += len(seq.drafts.propose(self.step_costs, base, room, cap))

    def _verify(self, seq: Sequence, rows: Any, toks: list[int]) -> None:
        """Sample each position of a step that fed a draft; keep the draft while the sampler draws
        it, then cut the cache back to what was kept."""
        draft, drafts = toks[1:], seq.drafts
        start = self.runner.cache_length(seq.slot_id) - len(toks)  # the length before this step
        accepted_before = drafts.n_accepted
        drafts.n_drafted += len(draft)
        drafts.n_verifications += 1
        kept = 0
        for i, row in enumerate(rows):
            proposed = draft[i] if i < len(draft) else None
            token = self._on_logits(seq, row, start + 1 + i < self.ctx_size_per_slot, proposed)
            if token is None or proposed is None or token != proposed:
                break
            kept += 1
        drafts.verified(kept)
        m = self.metrics
        m.n_draft_tokens_total += len(draft)
        m.n_draft_accepted_total += drafts.n_accepted - accepted_before
        m.n_drafts_total += 1
        n = start + 1 + kept
        if n < start + len(toks):
            kept_len = self.runner.truncate(seq.slot_id, n)
            if kept_len != n:  # draft_room keeps rollbacks possible: this is a bug, not a request error
                log.error("slot %d rolled back to %d tokens, %d asked", seq.slot_id, kept_len, n)
            self.scheduler.rolled_back(seq, kept_len)

    def _on_logits(self, seq: Sequence, row: Any, room_left: bool, proposed: int | None = None) -> int | None:
        """Sample the next token (`proposed`: the draft's token for this position); returns it, or
        None when the request ended (or failed) with it."""
        forced = seq.budget.next_forced() if seq.budget is not None else None
        try:
            token, lp = self.runner.sample(seq, row) if forced is None else self.runner.force(seq, row, forced)
        except Exception as e:  # a constraint with nothing left to allow, odd settings: this request only
            log.exception("sampling failed for request %s", seq.request.request_id)
            self._finish(seq, "error", error=f"sampling: {e}")
            return None
        if seq.budget is not None:
            seq.budget.seen(token)
        if seq.drafts is not None:
            seq.drafts.sampled(token)
            if token == proposed:  # counted before the output can end the request and report it
                seq.drafts.n_accepted += 1
        reason = self.output.on_token(seq, token, lp, room_left)
        if reason is not None:
            self._finish(seq, reason, stop_token_id=token if token in seq.stop_ids else None)
            return None
        seq.next_token = token
        return token

    def _finish(self, seq: Sequence, reason: str, stop_token_id: int | None = None, error: str | None = None) -> None:
        # Free the slot before the caller hears of the end: a finished response implies an idle slot.
        with self._cv:
            self.scheduler.release(seq)
            self.states_changed += 1
            self.last_finished = time.monotonic()
        self.output.finish(seq, reason, stop_token_id, error)


# llama.cpp's names for a file's tokenizer model and general.file_type (llama.h), as /v1/models shows them
_VOCAB_TYPES = {"no_vocab": 0, "llama": 1, "gpt2": 2, "bert": 3, "t5": 4, "rwkv": 5, "plamo2": 6}
_FTYPE_NAMES = {0: "all F32", 1: "F16", 7: "Q8_0", 32: "BF16", 38: "MXFP4 MoE"}


def _model_info(llm: Any) -> ModelInfo:
    cfg, mf = llm.config, llm.file
    n_params = sum(math.prod(t.ne) for t in mf.tensors.values())
    size = sum(os.path.getsize(f.path) for f in mf.files)
    meta = mf.metadata
    return ModelInfo(str(llm.path), llm.chat_template, cfg.vocab_size, cfg.context_length, cfg.hidden, n_params, size,
                     vocab_type=_VOCAB_TYPES.get(str(meta.get("tokenizer.ggml.model"))),
                     ftype=_FTYPE_NAMES.get(meta.get("general.file_type")))
