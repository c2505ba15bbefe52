"""A slot: one place a sequence runs, owning both halves of its state.

The token ids its KV cache holds, the cache itself (made on first use, its memory let go by
`forget`) and checkpoints of the cache's sliding-window ring. Every operation changes the halves
together, so they cannot disagree; the scheduler reads `tokens`, `ring_lo` and `checkpoints`
through its torch-free `SlotView` and decides.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridmoe.engine.request import SequenceState
from hybridmoe.engine.scheduler import CachedPrompt, Checkpoint, Reuse
from hybridmoe.models.kv_cache import KVSnapshot, SequenceKVCache
from hybridmoe.models.step import SeqChunk


class Slot:
    """Slot `slot_id`, its cache made by `make_cache(n_ctx)` when first needed."""

    def __init__(self, slot_id: int, n_ctx: int, make_cache: Callable[[int], SequenceKVCache],
                 max_checkpoints: int) -> None:
        self.id = slot_id
        self.n_ctx = n_ctx
        self.max_checkpoints = max_checkpoints
        self.tokens: list[int] = []
        self.checkpoints: list[Checkpoint] = []
        self.seq: SequenceState | None = None
        self.last_used = 0.0
        self._make_cache = make_cache
        self._cache: SequenceKVCache | None = None

    @property
    def cache(self) -> SequenceKVCache:
        if self._cache is None:
            self._cache = self._make_cache(self.n_ctx)
        return self._cache

    @property
    def ring_lo(self) -> int:
        return self._cache.ring_lo if self._cache is not None else 0

    @property
    def checkpoint_bytes(self) -> int:
        return sum(c.nbytes for c in self.checkpoints)

    # ---- a request's life on the slot -------------------------------------------------------------
    def reuse(self, reuse: Reuse) -> int:
        """Hold the first `reuse.keep` tokens of the chosen state: this slot's own, or a RAM-cache
        entry's, through a checkpoint when one is named. Returns the tokens held (the cache's ring
        rule, which the scheduler planned with, decides)."""
        cache = self.cache
        tokens, checkpoints = self.tokens, self.checkpoints
        if reuse.entry is not None:
            cache.restore(reuse.entry.data)
            tokens, checkpoints = reuse.entry.tokens, reuse.entry.checkpoints
        if reuse.checkpoint is not None:
            cache.restore(reuse.checkpoint.data)
        kept = cache.truncate(reuse.keep)
        self.tokens = list(tokens[:kept])
        self.checkpoints = [c for c in checkpoints if c.pos <= kept]
        return kept

    def feed(self, tokens: list[int], n_logits: int) -> SeqChunk:
        """The chunk that writes `tokens` after those held. They count as held from here: a step
        that fails forgets its slots."""
        self.tokens.extend(tokens)
        return SeqChunk(self.cache, tokens, n_logits)

    def add_checkpoint(self) -> None:
        """Keep the ring's state at the current length, the oldest dropped past `max_checkpoints`."""
        snap = self.cache.snapshot(full_layers=False)
        self.checkpoints.append(Checkpoint(len(self.tokens), snap.ring_lo, snap.nbytes, snap))
        del self.checkpoints[: max(0, len(self.checkpoints) - self.max_checkpoints)]

    def roll_back(self, n: int) -> None:
        """Drop every token after the first n (a rejected draft's tail). Scheduler.draft_room keeps
        drafts within what the ring can undo; past that this raises ValueError."""
        if not self.cache.geometry.can_roll_back(self.ring_lo, len(self.tokens), n):
            raise ValueError(f"slot {self.id}: the ring cannot return to {n} of {len(self.tokens)} tokens")
        self.cache.truncate(n)
        del self.tokens[n:]
        self.checkpoints = [c for c in self.checkpoints if c.pos <= n]

    def forget(self) -> None:
        """Nothing here is to be reused (an erase, a failed step): tokens, checkpoints and the
        cache's memory go."""
        self.tokens, self.checkpoints, self._cache = [], [], None

    # ---- whole states (RAM cache, slot files) -------------------------------------------------------
    def snapshot(self) -> KVSnapshot:
        """The whole state, full layers too, copied to RAM."""
        return self.cache.snapshot(full_layers=True)

    def snapshot_nbytes(self) -> int:
        return self.cache.snapshot_nbytes()

    def cached_prompt(self) -> CachedPrompt:
        snap = self.snapshot()
        return CachedPrompt(list(self.tokens), snap.ring_lo, snap.nbytes, snap, list(self.checkpoints))

    def restore(self, tokens: list[int], snapshot: KVSnapshot, checkpoints: list[KVSnapshot]) -> None:
        """Hold a saved state (`tokens` and their KV) and its checkpoints. Raises ValueError, the
        slot left empty, when the shapes do not fit this cache."""
        try:
            self.cache.restore(snapshot)
            checked = [self.cache.check_snapshot(c) for c in checkpoints]
        except ValueError:
            self.forget()
            raise
        self.tokens = list(tokens)
        self.checkpoints = [Checkpoint(c.length, c.ring_lo, nbytes, c) for c, nbytes in checked
                            if c.length <= len(tokens)]
        del self.checkpoints[: max(0, len(self.checkpoints) - self.max_checkpoints)]

    # ---- reporting --------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """One entry of /slots: the cached state and the request running here, if any."""
        seq = self.seq
        return {
            "id": self.id,
            "n_ctx": self.n_ctx,
            "is_processing": seq is not None,
            "n_cached_tokens": len(self.tokens),
            "n_checkpoints": len(self.checkpoints),
            "checkpoint_bytes": self.checkpoint_bytes,
            "id_task": seq.request.request_id if seq is not None else None,
            "n_decoded": seq.n_generated if seq is not None else 0,
            "n_prompt_cached": seq.n_cached if seq is not None else 0,  # prompt tokens reused from a cache
            "n_prompt_tokens": len(seq.prompt) if seq is not None else 0,
            "n_prompt_pending": len(seq.pending) if seq is not None else 0,  # not yet fed
            "max_tokens": seq.request.params.max_tokens if seq is not None else -1,
            "sampling": seq.request.params if seq is not None else None,
            "n_probs": (seq.request.logprobs or 0) if seq is not None else 0,
        }

