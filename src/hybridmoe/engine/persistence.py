"""What leaves RAM and comes back: slot files and the prompt store, over the engine's slots.

llama-server's `/slots/{id}?action=save|restore|erase` act on one idle slot (engine/slot_files.py
is the file format); `serve --prompt-cache-dir` keeps the slots' and the RAM cache's states across
restarts (engine/prompt_store.py chooses and writes them). Slots are only touched on the engine
thread: the engine runs the slot actions there, and `on_engine_thread` takes a slot's copy there.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch

from hybridmoe.engine import prompt_store, slot_files
from hybridmoe.engine.errors import SlotError
from hybridmoe.engine.scheduler import MIN_SAVED_TOKENS, CachedPrompt, Checkpoint, PromptCache
from hybridmoe.engine.slot import Slot
from hybridmoe.gguf.reader import ModelFile
from hybridmoe.models.kv_cache import KVSnapshot


class Persistence:
    def __init__(self, model_file: ModelFile, n_ctx: int, kv_dtype: torch.dtype, slots: list[Slot],
                 prompt_cache: PromptCache, on_engine_thread: Callable[[Callable[[], Any]], Any]) -> None:
        self.model_file, self.n_ctx, self.kv_dtype = model_file, n_ctx, kv_dtype
        self.slots, self.prompt_cache = slots, prompt_cache
        self.on_engine_thread = on_engine_thread

    @functools.cached_property
    def identity(self) -> dict[str, Any]:
        """What a saved state must match to be used here (model, context per slot, KV type)."""
        return slot_files.model_identity(self.model_file, self.n_ctx, self.kv_dtype)

    # ---- slot actions (engine thread) -------------------------------------------------------------
    def idle_slot(self, slot_id: int) -> Slot:
        """The slot a slot action names; SlotError when there is none or it runs a request."""
        if not 0 <= slot_id < len(self.slots):
            raise SlotError(f"slot {slot_id} does not exist (slots 0..{len(self.slots) - 1})")
        slot = self.slots[slot_id]
        if slot.seq is not None:
            raise SlotError(f"slot {slot_id} is processing a request")
        return slot

    def save_slot(self, slot_id: int, path: str) -> dict[str, Any]:
        """Write an idle slot's tokens and KV state (with its checkpoints) to `path`."""
        slot = self.idle_slot(slot_id)
        t0 = time.perf_counter()
        state = slot_files.SavedSlot(list(slot.tokens), slot.snapshot(), [c.data for c in slot.checkpoints])
        n = slot_files.save(path, self.identity, state)
        return {"n_saved": len(slot.tokens), "n_written": n, "save_ms": (time.perf_counter() - t0) * 1e3}

    def restore_slot(self, slot_id: int, path: str) -> dict[str, Any]:
        """Load a file `save_slot` wrote (same model, context and KV type) into an idle slot. Raises
        slot_files.SlotFileError for a file that does not fit, leaving the slot empty at worst."""
        slot = self.idle_slot(slot_id)
        t0 = time.perf_counter()
        state, n_read = slot_files.load(path, self.identity)
        try:
            slot.restore(state.tokens, state.snapshot, state.checkpoints)
        except ValueError as e:  # shapes that do not fit this cache
            raise slot_files.SlotFileError(f"{path}: {e}") from None
        return {"n_restored": len(state.tokens), "n_read": n_read, "restore_ms": (time.perf_counter() - t0) * 1e3}

    def erase_slot(self, slot_id: int) -> dict[str, Any]:
        slot = self.idle_slot(slot_id)
        n = len(slot.tokens)
        slot.forget()
        return {"n_erased": n}

    # ---- the prompt store (serve --prompt-cache-dir) ---------------------------------------------------
    def prompt_states(self) -> list[prompt_store.Kept]:
        """The slots' and the RAM cache's states worth keeping. A slot's state is copied only when
        `take` is called, and only if the slot still holds the same tokens."""

        def taker(slot: Slot, tokens: list[int]) -> Callable[[], KVSnapshot | None]:
            return lambda: self.on_engine_thread(lambda: slot.snapshot() if slot.tokens == tokens else None)

        def collect() -> list[prompt_store.Kept]:
            states = [prompt_store.Kept(list(s.tokens), None, [c.data for c in s.checkpoints], s.last_used,
                                        s.snapshot_nbytes(), taker(s, list(s.tokens)))
                      for s in self.slots if len(s.tokens) >= MIN_SAVED_TOKENS]
            return states + [prompt_store.Kept(list(e.tokens), e.data, [c.data for c in e.checkpoints], e.last_used)
                             for e in self.prompt_cache.entries]

        return self.on_engine_thread(collect)

    def save_prompt_cache(self, directory: str) -> tuple[int, int]:
        """Write the states worth keeping to `directory` (prompt_store.save); (files, bytes written)."""
        return prompt_store.save(directory, self.identity, self.prompt_states(), self.prompt_cache.limit)

    def load_prompt_cache(self, directory: str) -> tuple[int, int]:
        """Before the engine starts: the states `save_prompt_cache` wrote into the RAM cache, as far
        as its limit allows (files for another model, context or KV type are skipped). Returns
        (entries, bytes)."""
        cache = self.prompt_cache
        n = 0
        for k in prompt_store.load(directory, self.identity, self.slots[0].cache.check_snapshot):
            checkpoints = [Checkpoint(c.length, c.ring_lo, c.nbytes, c) for c in k.checkpoints
                           if c.length <= len(k.tokens)]
            n += cache.put(CachedPrompt(k.tokens, k.snapshot.ring_lo, k.snapshot.nbytes, k.snapshot, checkpoints))
        return n, cache.nbytes
