"""The scheduler: which request runs on which slot, what it reuses, which tokens go into a step.

Plain Python over token lists and byte counts (no torch): it reads slots through `SlotView` and
asks them to act (engine.slot.Slot does, holding the KV cache; the tests' fakes do with lists), and
KV states appear only as opaque handles (`data`). Reuse comes from three places, best first:
  - a slot's live state, rolled back to the shared prefix when its sliding-window ring allows;
  - a checkpoint of the ring layers taken at the end of each prompt (and every
    `checkpoint_every` tokens inside a long one), for prompts that diverge further back;
  - the RAM prompt cache: states of conversations whose slot was taken by another, LRU by bytes.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from hybridmoe.engine.request import SequenceState
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

    def covers(self, tokens: Sequence[int]) -> bool:
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


class SlotView(Protocol):
    """What the scheduler reads of a slot and asks of it (engine.slot.Slot holds its KV cache too).

    `tokens` are the ids whose KV the slot holds; `ring_lo` the lowest position its sliding-window
    ring still holds; `checkpoints` ring states at earlier lengths, oldest first."""

    id: int
    tokens: list[int]
    checkpoints: list[Checkpoint]
    seq: SequenceState | None
    last_used: float

    @property
    def ring_lo(self) -> int: ...

    def cached_prompt(self) -> CachedPrompt:
        """The whole state and its checkpoints as a RAM-cache entry (a copy)."""
        ...

    def reuse(self, reuse: Reuse) -> int:
        """Hold `reuse.keep` tokens of the chosen state; returns the tokens held."""
        ...

    def add_checkpoint(self) -> None:
        """Keep the ring's state at the current length (the oldest go past the limit)."""
        ...


@dataclass
class Admission:
    seq: SequenceState
    slot: SlotView
    reuse: Reuse
    save_first: bool  # move the slot's current state to the RAM cache before it is overwritten


@dataclass
class StepPlan:
    """One model step: per sequence the tokens to feed (decoding sequences first)."""

    batch: list[tuple[SequenceState, list[int]]]

    @property
    def n_tokens(self) -> int:
        return sum(len(t) for _, t in self.batch)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
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

    def __init__(self, slots: Sequence[SlotView], batch_size: int, geometry: WindowGeometry,
                 config: CacheConfig) -> None:
        self.slots = slots
        self.waiting: collections.deque[SequenceState] = collections.deque()
        self.batch_size = batch_size
        self.geometry = geometry
        self.config = config
        self.prompt_cache = PromptCache(config.cache_ram_bytes)

    # ---- admission ------------------------------------------------------------------------------
    def free_slots(self) -> list[SlotView]:
        return [s for s in self.slots if s.seq is None]

    def running(self) -> list[SequenceState]:
        return [s.seq for s in self.slots if s.seq is not None]

    def admit(self) -> list[Admission]:
        """Place waiting sequences on free slots, choosing the most reuse (FIFO order). One that
        asks for a slot (llama-server's id_slot) waits for that slot; the ones behind it go on."""
        out: list[Admission] = []
        still: collections.deque[SequenceState] = collections.deque()
        while self.waiting:
            seq = self.waiting.popleft()
            wanted = seq.request.id_slot
            if not self.free_slots() or (wanted >= 0 and self.slots[wanted].seq is not None):
                still.append(seq)
                continue
            adm = self._choose(seq)
            adm.slot.seq = seq
            seq.slot_id = adm.slot.id
            out.append(adm)
        self.waiting = still
        return out

    def _choose(self, seq: SequenceState) -> Admission:
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

    def _worth_saving(self, slot: SlotView, kept: int) -> bool:
        lost = len(slot.tokens) - kept
        return (self.prompt_cache.enabled and lost > 0 and len(slot.tokens) >= MIN_SAVED_TOKENS
                and not self.prompt_cache.covers(slot.tokens))

    def load(self, adm: Admission) -> None:
        """Carry an admission out: the slot's old state to the RAM cache when worth keeping, the
        reused prefix into the slot, and the rest of the prompt left to feed."""
        slot, seq, r = adm.slot, adm.seq, adm.reuse
        if adm.save_first:
            self.prompt_cache.put(slot.cached_prompt())
        kept = slot.reuse(r)
        if r.entry is not None:
            self.prompt_cache.take(r.entry)
        seq.n_cached = kept
        seq.pending = list(seq.prompt[kept:])

    # ---- steps ------------------------------------------------------------------------------------
    def plan_step(self) -> StepPlan:
        """Decode tokens first (one per decoding sequence, with its speculative draft), then
        prompt chunks up to the budget."""
        batch: list[tuple[SequenceState, list[int]]] = []
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

    def fed(self, seq: SequenceState, tokens: list[int]) -> None:
        """The step has written `tokens` into the sequence's slot: move its prompt on, and take a
        checkpoint when the prompt is done or a long one has gone `checkpoint_every` further."""
        if not seq.pending:
            seq.next_token = None
            return
        del seq.pending[: len(tokens)]
        if self.geometry.window == 0 or self.config.ctx_checkpoints <= 0:
            return
        slot = self.slots[seq.slot_id]
        last = max((c.pos for c in slot.checkpoints), default=0)
        n = len(slot.tokens)
        if n > last and (not seq.pending or n - last >= self.config.checkpoint_every):
            slot.add_checkpoint()

    def draft_room(self, seq: SequenceState, ctx_size: int) -> int:
        """Most draft tokens the sequence's next step may carry: the context (one token kept
        free, as llama-server does), and a rollback its sliding-window ring can always undo."""
        slot = self.slots[seq.slot_id]
        n = len(slot.tokens) + 1  # after the sampled token
        room = ctx_size - n - 1
        if self.geometry.window and self.geometry.ring < ctx_size:  # else it never wraps
            room = min(room, self.geometry.ring - self.geometry.window)
        return max(0, room)

    def release(self, seq: SequenceState) -> None:
        slot = self.slots[seq.slot_id]
        slot.seq = None
        slot.last_used = time.monotonic()

    # ---- reporting --------------------------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        return {
            "checkpoint_bytes": sum(c.nbytes for s in self.slots for c in s.checkpoints),
            "n_checkpoints": sum(len(s.checkpoints) for s in self.slots),
            "prompt_cache_bytes": self.prompt_cache.nbytes,
            "prompt_cache_entries": len(self.prompt_cache.entries),
            "prompt_cache_limit_bytes": -1 if self.prompt_cache.limit is None else self.prompt_cache.limit,
        }
