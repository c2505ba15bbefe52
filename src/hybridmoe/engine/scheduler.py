"""The scheduler: which request runs on which slot, what it reuses, which tokens go into a step.

Plain Python over token lists and byte counts (no torch): KV states appear only as opaque handles
(`data`) that the runner makes and consumes. Reuse comes from three places, best first:
  - a slot's live state, rolled back to the shared prefix when its sliding-window ring allows;
  - a checkpoint of the ring layers taken at the end of each prompt (and every
    `checkpoint_every` tokens inside a long one), for prompts that diverge further back;
  - the RAM prompt cache: states of conversations whose slot was taken by another, LRU by bytes.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from hybridmoe.engine.request import Sequence
from hybridmoe.models.kv_window import WindowGeometry

MIN_SAVED_TOKENS = 16  # shorter states are cheaper to recompute than to keep


@dataclass(frozen=True)
class CacheConfig:
    """Prompt-reuse settings (llama-server's flags and meanings)."""

    ctx_checkpoints: int = 32  # --ctx-checkpoints: per slot (and per cached prompt)
    checkpoint_every: int = 2048  # --checkpoint-min-step: spacing of checkpoints inside a long prompt
    cache_ram_bytes: int | None = 8192 * 2**20  # --cache-ram: None = no limit, 0 = no RAM cache


@dataclass(eq=False)  # identity: the data are tensors
class Checkpoint:
    """The ring layers' state after `pos` tokens (the full layers are taken from the live state)."""

    pos: int
    ring_lo: int
    nbytes: int
    data: Any


@dataclass
class SlotState:
    id: int
    tokens: list[int] = field(default_factory=list)  # ids whose KV the slot's cache holds
    ring_lo: int = 0
    checkpoints: list[Checkpoint] = field(default_factory=list)
    seq: Sequence | None = None
    last_used: float = 0.0

    @property
    def checkpoint_bytes(self) -> int:
        return sum(c.nbytes for c in self.checkpoints)


@dataclass(eq=False)  # identity: the data are tensors
class CachedPrompt:
    """A whole KV state kept in RAM after its slot went to another conversation."""

    tokens: list[int]
    ring_lo: int
    state_bytes: int
    data: Any
    checkpoints: list[Checkpoint]
    last_used: float = field(default_factory=time.monotonic)

    @property
    def nbytes(self) -> int:
        return self.state_bytes + sum(c.nbytes for c in self.checkpoints)


class PromptCache:
    """Cached prompts, least recently used dropped first once over `limit` bytes (None: no limit)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.entries: list[CachedPrompt] = []

    @property
    def enabled(self) -> bool:
        return self.limit is None or self.limit > 0

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def covers(self, tokens: Seq[int]) -> bool:
        """Some entry already holds `tokens` as a prefix (saving them again would add nothing)."""
        n = len(tokens)
        return any(len(e.tokens) >= n and e.tokens[:n] == list(tokens) for e in self.entries)

    def put(self, entry: CachedPrompt) -> bool:
        if not self.enabled or (self.limit is not None and entry.nbytes > self.limit):
            return False
        # Entries that are prefixes of the new one are subsumed by it.
        self.entries = [e for e in self.entries
                        if not (len(e.tokens) <= len(entry.tokens) and entry.tokens[: len(e.tokens)] == e.tokens)]
        self.entries.append(entry)
        if self.limit is not None:
            while self.nbytes > self.limit:
                self.entries.remove(min(self.entries, key=lambda e: e.last_used))
        return True

    def take(self, entry: CachedPrompt) -> None:
        # Sequences admitted in one round can pick the same entry (n > 1 choices, identical
        # prompts): each slot copies it in (restore copies), so a second take finds it gone.
        if entry in self.entries:
            self.entries.remove(entry)

    def clear(self) -> None:
        self.entries.clear()


@dataclass
class Reuse:
    """Where an admitted sequence's first `keep` prompt tokens come from."""

    keep: int = 0
    entry: CachedPrompt | None = None  # a RAM-cache entry to load into the slot first
    checkpoint: Checkpoint | None = None  # then this checkpoint (of the slot or of the entry)


@dataclass
class Admission:
    seq: Sequence
    slot: SlotState
    reuse: Reuse
    save_first: bool  # move the slot's current state to the RAM cache before it is overwritten


@dataclass
class StepPlan:
    """One model step: per sequence the tokens to feed (decoding sequences first)."""

    batch: list[tuple[Sequence, list[int]]]

    @property
    def n_tokens(self) -> int:
        return sum(len(t) for _, t in self.batch)


def common_prefix(a: Seq[int], b: Seq[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def best_reuse(tokens: list[int], ring_lo: int, checkpoints: list[Checkpoint], prompt: list[int],
               geometry: WindowGeometry) -> tuple[int, Checkpoint | None]:
    """Most prompt tokens a state (and its checkpoints) can serve, and the checkpoint to go through.

    At least one prompt token is always left to compute (its logits start the reply)."""
    shared = min(common_prefix(tokens, prompt), len(prompt) - 1)
    best, via = 0, None
    for pos, lo, ck in [(len(tokens), ring_lo, None)] + [(c.pos, c.ring_lo, c) for c in checkpoints]:
        n = min(shared, pos)
        if n > best and geometry.can_roll_back(lo, pos, n):
            best, via = n, ck
    return best, via


class Scheduler:
    """Slots, the waiting queue and the RAM prompt cache; owned by the engine thread."""

    def __init__(self, n_slots: int, batch_size: int, geometry: WindowGeometry, config: CacheConfig) -> None:
        self.slots = [SlotState(i) for i in range(n_slots)]
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.batch_size = batch_size
        self.geometry = geometry
        self.config = config
        self.prompt_cache = PromptCache(config.cache_ram_bytes)

    # ---- admission ------------------------------------------------------------------------------
    def free_slots(self) -> list[SlotState]:
        return [s for s in self.slots if s.seq is None]

    def running(self) -> list[Sequence]:
        return [s.seq for s in self.slots if s.seq is not None]

    def admit(self) -> list[Admission]:
        """Place waiting sequences on free slots, choosing the most reuse (FIFO order). One that
        asks for a slot (llama-server's id_slot) waits for that slot; the ones behind it go on."""
        out: list[Admission] = []
        still: collections.deque[Sequence] = collections.deque()
        while self.waiting:
            seq = self.waiting.popleft()
            wanted = seq.request.id_slot
            if not self.free_slots() or (wanted >= 0 and self.slots[wanted].seq is not None):
                still.append(seq)
                continue
            adm = self._place(seq)
            adm.slot.seq = seq
            seq.slot_id = adm.slot.id
            out.append(adm)
        self.waiting = still
        return out

    def _place(self, seq: Sequence) -> Admission:
        wanted = seq.request.id_slot
        free = [self.slots[wanted]] if wanted >= 0 else self.free_slots()
        prompt = seq.prompt
        if not seq.request.cache_prompt:
            slot = min(free, key=lambda s: (len(s.tokens) > 0, s.last_used))
            return Admission(seq, slot, Reuse(), self._worth_saving(slot, 0))
        # Best live slot: most reuse, then least recently used.
        scored = [(best_reuse(s.tokens, s.ring_lo, s.checkpoints, prompt, self.geometry), s) for s in free]
        (keep, ck), slot = max(scored, key=lambda x: (x[0][0], -x[1].last_used))
        reuse = Reuse(keep, None, ck)
        for e in self.prompt_cache.entries:
            k, eck = best_reuse(e.tokens, e.ring_lo, e.checkpoints, prompt, self.geometry)
            if k > reuse.keep:
                reuse = Reuse(k, e, eck)
        if reuse.entry is not None:  # load into the free slot whose state is worth least
            slot = min(free, key=lambda s: (len(s.tokens) > 0, s.last_used))
        kept_of_slot = 0 if reuse.entry is not None else reuse.keep
        return Admission(seq, slot, reuse, self._worth_saving(slot, kept_of_slot))

    def _worth_saving(self, slot: SlotState, kept: int) -> bool:
        lost = len(slot.tokens) - kept
        return (self.prompt_cache.enabled and lost > 0 and len(slot.tokens) >= MIN_SAVED_TOKENS
                and not self.prompt_cache.covers(slot.tokens))

    def save_slot(self, slot: SlotState, data: Any, state_bytes: int) -> None:
        """Move the slot's state (made by the runner) and its checkpoints to the RAM cache."""
        self.prompt_cache.put(CachedPrompt(list(slot.tokens), slot.ring_lo, state_bytes, data,
                                           list(slot.checkpoints)))

    def loaded(self, adm: Admission, kept: int) -> None:
        """The runner has put the admission's state in its slot, `kept` tokens long."""
        slot, seq, r = adm.slot, adm.seq, adm.reuse
        if r.entry is not None:
            self.prompt_cache.take(r.entry)
            slot.tokens, slot.ring_lo, slot.checkpoints = list(r.entry.tokens), r.entry.ring_lo, list(r.entry.checkpoints)
        if r.checkpoint is not None:
            slot.ring_lo = r.checkpoint.ring_lo
            slot.tokens = slot.tokens[: r.checkpoint.pos]
        del slot.tokens[kept:]
        slot.ring_lo = 0 if kept == 0 else slot.ring_lo
        slot.checkpoints = [c for c in slot.checkpoints if c.pos <= kept]
        seq.n_cached = kept
        seq.pending = list(seq.prompt[kept:])

    # ---- steps ------------------------------------------------------------------------------------
    def plan_step(self) -> StepPlan:
        """Decode tokens first (one per decoding sequence, with its speculative draft), then
        prompt chunks up to the budget."""
        batch: list[tuple[Sequence, list[int]]] = []
        for seq in self.running():
            if not seq.pending and seq.next_token is not None:
                draft = seq.drafts.draft if seq.drafts is not None else []
                batch.append((seq, [seq.next_token, *draft]))
        budget = self.batch_size
        for seq in self.running():
            if seq.pending and budget > 0:
                part = seq.pending[:budget]
                budget -= len(part)
                batch.append((seq, part))
        return StepPlan(batch)

    def fed(self, seq: Sequence, tokens: list[int]) -> bool:
        """Record tokens fed to the sequence's slot; True when a checkpoint should be taken now:
        the prompt has just been processed, or a long prompt has gone `checkpoint_every` further."""
        slot = self.slots[seq.slot_id]
        slot.tokens.extend(tokens)
        slot.ring_lo = self.geometry.lo_after(slot.ring_lo, len(slot.tokens))
        if not seq.pending:
            seq.next_token = None
            return False
        del seq.pending[: len(tokens)]
        if self.geometry.window == 0 or self.config.ctx_checkpoints <= 0:
            return False
        last = max((c.pos for c in slot.checkpoints), default=0)
        done = not seq.pending
        return len(slot.tokens) > last and (done or len(slot.tokens) - last >= self.config.checkpoint_every)

    def rolled_back(self, seq: Sequence, n: int) -> None:
        """The slot's cache was cut back to its first n tokens (a rejected draft's tail)."""
        slot = self.slots[seq.slot_id]
        del slot.tokens[n:]
        slot.checkpoints = [c for c in slot.checkpoints if c.pos <= n]

    def draft_room(self, seq: Sequence, ctx_size: int) -> int:
        """Most draft tokens the sequence's next step may carry: the context (one token kept
        free, as llama-server does), and a rollback its sliding-window ring can always undo."""
        slot = self.slots[seq.slot_id]
        n = len(slot.tokens) + 1  # after the sampled token
        room = ctx_size - n - 1
        if self.geometry.window and self.geometry.ring < ctx_size:  # else it never wraps
            room = min(room, self.geometry.ring - self.geometry.window)
        return max(0, room)

    def add_checkpoint(self, slot: SlotState, data: Any, nbytes: int) -> None:
        slot.checkpoints.append(Checkpoint(len(slot.tokens), slot.ring_lo, nbytes, data))
        while len(slot.checkpoints) > self.config.ctx_checkpoints:
            slot.checkpoints.pop(0)

    def restored(self, slot: SlotState, tokens: list[int], ring_lo: int, checkpoints: list[tuple[Any, int]]) -> None:
        """A slot file's state is now in the slot; `checkpoints` are (snapshot, nbytes) pairs."""
        slot.tokens, slot.ring_lo, slot.checkpoints = list(tokens), ring_lo, []
        for data, nbytes in checkpoints:
            if data.length <= len(tokens):
                slot.checkpoints.append(Checkpoint(data.length, data.ring_lo, nbytes, data))
        del slot.checkpoints[: max(0, len(slot.checkpoints) - self.config.ctx_checkpoints)]

    def release(self, seq: Sequence) -> None:
        slot = self.slots[seq.slot_id]
        slot.seq = None
        slot.last_used = time.monotonic()

    def forget(self, slot: SlotState) -> None:
        """The slot's cache is gone or unreliable (a failed step, an erase): nothing to reuse."""
        slot.tokens, slot.ring_lo, slot.checkpoints = [], 0, []

    # ---- reporting --------------------------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        return {
            "checkpoint_bytes": sum(s.checkpoint_bytes for s in self.slots),
            "n_checkpoints": sum(len(s.checkpoints) for s in self.slots),
            "prompt_cache_bytes": self.prompt_cache.nbytes,
            "prompt_cache_entries": len(self.prompt_cache.entries),
            "prompt_cache_limit_bytes": -1 if self.prompt_cache.limit is None else self.prompt_cache.limit,
        }
