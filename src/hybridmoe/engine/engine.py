"""Engine: one thread owns the model and runs steps: scheduler -> runner -> output processor.

Each step is one `model.forward` holding one token of every decoding sequence plus prompt chunks
(at most `batch_size` prompt tokens), so the MoE reads each expert's weights once for all slots
(continuous batching). `LLM.generate` drives the same steps from its own thread (`run`): there
is one decode loop in the project. Slot state lives in `Slot`s (engine/slot.py); what is written
to disk and read back, in `Persistence` (engine/persistence.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from hybridmoe.engine.errors import EngineClosedError, QueueFullError, SlotError
from hybridmoe.engine.handle import RequestHandle
from hybridmoe.engine.mailbox import Mailbox
from hybridmoe.engine.output import Metrics, OutputProcessor, find_stop, safe_prefix_len
from hybridmoe.engine.persistence import Persistence
from hybridmoe.engine.request import EngineEvent, GenerationRequest, PromptProgress, SequenceState, Usage
from hybridmoe.engine.runner import ModelRunner
from hybridmoe.engine.scheduler import Admission, CacheConfig, Scheduler
from hybridmoe.engine.slot import Slot
from hybridmoe.engine.speculative import SequenceDrafts, SpeculativeSettings, StepCosts, propose_drafts
from hybridmoe.models.load import LoadedModel

__all__ = [
    "CacheConfig", "Engine", "EngineClosedError", "EngineEvent", "GenerationRequest", "Metrics", "PromptProgress",
    "QueueFullError", "RequestHandle", "SlotError", "Usage", "find_stop", "safe_prefix_len",
]

log = logging.getLogger(__name__)
T = TypeVar("T")


class Engine:
    """Continuous-batching engine over a loaded model (see module docstring). Serve with
    `start()` ... `close()`, or drive it with `run(request)`."""

    def __init__(
        self,
        loaded: LoadedModel,
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
        cache = cache or CacheConfig()
        model, layout = loaded.model, loaded.model.cache_layout()
        self.tokenizer = loaded.tokenizer
        self.model_info = loaded.info
        self.n_parallel = n_parallel
        self.ctx_size_per_slot = ctx_size_per_slot
        self.max_queue = max_queue
        self.batch_size = batch_size
        self.metrics = Metrics()
        self.speculative = speculative
        self.step_costs = StepCosts()  # measured step times, for the draft length choice
        self.slots = [Slot(i, ctx_size_per_slot, model.make_cache, cache.ctx_checkpoints) for i in range(n_parallel)]
        self.runner = ModelRunner(model, self.tokenizer)
        self.scheduler = Scheduler(self.slots, batch_size, layout.geometry(ctx_size_per_slot), cache)
        self.persistence = Persistence(loaded.file, ctx_size_per_slot, layout.dtype, self.slots,
                                       self.scheduler.prompt_cache, self._on_engine_thread)
        self.output = OutputProcessor(self.tokenizer, self.metrics)
        self.mailbox = Mailbox()
        self.states_changed = 0  # requests ended so far: the slots' states are not what they were
        self.last_finished = time.monotonic()
        self._thread: threading.Thread | None = None

    # ---- caller side (any thread) ---------------------------------------------------------------
    def start(self) -> Engine:
        self._thread = threading.Thread(target=self._loop, name="hybridmoe-engine", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 10.0) -> None:
        self.mailbox.close()
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
        with self.mailbox.lock:
            n_waiting = len(self.mailbox.requests) + len(self.scheduler.waiting)
            full = n_waiting - len(self.scheduler.free_slots()) >= self.max_queue
            if full and not self.mailbox.closed:  # closed: post raises EngineClosedError
                self.metrics.requests_rejected_total += 1
                raise QueueFullError(f"server busy: {n_waiting} requests already wait for one of "
                                     f"{self.n_parallel} slots")
            self.mailbox.post(SequenceState(request, handle))
            self.metrics.requests_total += 1
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
        return fn() if self._thread is None else self.mailbox.call(fn, timeout)

    def _on_engine_thread(self, fn: Callable[[], T]) -> T:
        return self.call(fn) if self._thread is not None and self._thread.is_alive() else fn()

    # ---- slot actions (llama-server's /slots/{id}?action=...): Persistence's, between steps ------------
    def save_slot(self, slot_id: int, path: str) -> dict[str, Any]:
        return self.call(lambda: self.persistence.save_slot(slot_id, path))

    def restore_slot(self, slot_id: int, path: str) -> dict[str, Any]:
        return self.call(lambda: self.persistence.restore_slot(slot_id, path))

    def erase_slot(self, slot_id: int) -> dict[str, Any]:
        return self.call(lambda: self.persistence.erase_slot(slot_id))

    def status(self) -> dict[str, Any]:
        """Snapshot for /slots and /metrics (read without stopping the engine)."""
        slots = [{**s.status(), "speculative": self.speculative.enabled} for s in self.slots]
        with self.mailbox.lock:
            waiting = len(self.mailbox.requests) + len(self.scheduler.waiting)
        return {"slots": slots, "requests_waiting": waiting, "memory": self.scheduler.memory()}

    # ---- engine thread ----------------------------------------------------------------------------
    def _loop(self) -> None:
        while self.mailbox.wait(self._busy):
            self.step()
        for seq in self.scheduler.running():
            self._finish(seq, "cancelled")
        for seq in [*self.scheduler.waiting, *self.mailbox.drain()]:
            seq.sink.push(EngineEvent(finish_reason="cancelled"))
        self.scheduler.waiting.clear()

    def idle_seconds(self) -> float:
        """Seconds since the last request ended; 0 while any runs or waits."""
        with self.mailbox.lock:
            if self.mailbox.requests or self._busy():
                return 0.0
            return time.monotonic() - self.last_finished

    def _busy(self) -> bool:
        return bool(self.scheduler.waiting) or bool(self.scheduler.running())

    def step(self) -> None:
        """One iteration: queued calls, admissions, one forward, sampling and output."""
        for seq in self.mailbox.take():
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
            self._admit(adm)
        try:
            self._forward()
        except Exception as e:  # one bad step must not kill the server: fail those requests
            log.exception("engine step failed")
            for seq in self.scheduler.running():
                self._fail(seq, e)

    def _admit(self, adm: Admission) -> None:
        seq = adm.seq
        seq.sink.slot_id = adm.slot.id
        try:
            self.scheduler.load(adm)
            self.runner.prepare(seq)
            if self.speculative.enabled:
                seq.drafts = SequenceDrafts.for_prompt(self.speculative, seq.prompt)
            self.output.start(seq)
        except Exception as e:  # e.g. no memory for a KV cache: fail this request, keep serving
            log.exception("could not place a request on slot %d", adm.slot.id)
            self._fail(seq, e)

    def _forward(self) -> None:
        if self.speculative.enabled:
            propose_drafts(self.scheduler, self.step_costs, self.ctx_size_per_slot)
        plan = self.scheduler.plan_step()
        if not plan.batch:
            return
        decoding = [not seq.pending for seq, _ in plan.batch]  # before `fed` empties the prompts
        # per entry: each token's logits when decoding (sampled token and draft), else the last's
        chunks = [self.slots[seq.slot_id].feed(toks, len(toks) if dec else 1)
                  for (seq, toks), dec in zip(plan.batch, decoding)]
        t0 = time.perf_counter()
        logits = self.runner.forward(chunks)
        dt = time.perf_counter() - t0
        self.step_costs.record(plan.n_tokens, dt)
        n_prefill = sum(len(t) for (seq, t), dec in zip(plan.batch, decoding) if not dec)
        self.metrics.step(len(plan.batch), plan.n_tokens, n_prefill, dt)
        off = 0
        for (seq, toks), dec in zip(plan.batch, decoding):
            n_rows = len(toks) if dec else 1
            rows, off = logits[off : off + n_rows], off + n_rows
            self.scheduler.fed(seq, toks)
            if not dec:
                self.output.prompt_fed(seq)
            if seq.pending:
                continue
            if n_rows > 1:
                self._verify(seq, rows, toks)
            else:
                self._on_logits(seq, rows[0], len(self.slots[seq.slot_id].tokens) < self.ctx_size_per_slot)

    def _verify(self, seq: SequenceState, rows: Any, toks: list[int]) -> None:
        """Sample each position of a step that fed a draft; keep the draft while the sampler draws
        it, then roll the slot back to what was kept."""
        drafts, slot, n_draft = seq.drafts, self.slots[seq.slot_id], len(toks) - 1
        start = len(slot.tokens) - len(toks)  # the length before this step
        accepted_before = drafts.n_accepted
        kept = drafts.verify(rows, lambda i, row, proposed: self._on_logits(
            seq, row, start + 1 + i < self.ctx_size_per_slot, proposed))
        self.metrics.verification(n_draft, drafts.n_accepted - accepted_before)
        if kept < n_draft:
            slot.roll_back(start + 1 + kept)

    def _on_logits(self, seq: SequenceState, row: Any, room_left: bool, proposed: int | None = None) -> int | None:
        """Sample the next token (`proposed`: the draft's token for this position); returns it, or
        None when the request ended (or failed) with it."""
        try:
            token, lp = self.runner.next_token(seq, row)
        except Exception as e:  # a constraint with nothing left to allow, odd settings: this request only
            log.exception("sampling failed for request %s", seq.request.request_id)
            self._finish(seq, "error", error=f"sampling: {e}")
            return None
        if seq.drafts is not None:  # before the output can end the request and report the counts
            seq.drafts.sampled(token, proposed)
        reason = self.output.on_token(seq, token, lp, room_left)
        if reason is not None:
            self._finish(seq, reason, stop_token_id=token if token in seq.stop_ids else None)
            return None
        seq.next_token = token
        return token

    def _finish(self, seq: SequenceState, reason: str, stop_token_id: int | None = None,
                error: str | None = None) -> None:
        # Free the slot before the caller hears of the end: a finished response implies an idle slot.
        with self.mailbox.lock:
            self.scheduler.release(seq)
            self.states_changed += 1
            self.last_finished = time.monotonic()
        self.output.finish(seq, reason, stop_token_id, error)

    def _fail(self, seq: SequenceState, e: Exception) -> None:
        """End a request whose slot state cannot be trusted: the slot forgets it, the caller gets the error."""
        self.slots[seq.slot_id].forget()
        self._finish(seq, "error", error=f"{type(e).__name__}: {e}")
