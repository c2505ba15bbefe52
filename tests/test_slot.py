"""Slot: its token list and its KV cache move together through every operation (no model: the
chunks a slot hands out are written into the cache here as the model's forward would)."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.engine.scheduler import Reuse
from hybridmoe.engine.slot import Slot
from hybridmoe.models.kv_cache import CacheLayout, SequenceKVCache

WINDOW, SLACK = 8, 4  # the ring keeps 12 positions


def layout(n_kv_heads: int = 1) -> CacheLayout:
    return CacheLayout(n_layers=2, sliding=(True, False), n_kv_heads=n_kv_heads, head_dim=2, window=WINDOW,
                       devices=(torch.device("cpu"),) * 2, slack=SLACK)


def make_slot(max_checkpoints: int = 2, heads: int = 1) -> Slot:
    return Slot(0, 64, lambda n_ctx: SequenceKVCache(layout(heads), n_ctx), max_checkpoints)


def write(slot: Slot, tokens: list[int]) -> None:
    """Feed `tokens` and write their K/V (the token id as the value) as a forward step does."""
    chunk = slot.feed(tokens, 1)
    cache, t = chunk.cache, len(tokens)
    kv = torch.tensor(tokens, dtype=torch.float32).repeat_interleave(2).view(t, 1, 2)
    for i in range(cache.layout.n_layers):
        cache.update(i, kv, kv, cache.length)
    cache.advance(t)


def test_fed_tokens_and_the_cache_agree_and_checkpoints_are_bounded():
    slot = make_slot(max_checkpoints=2)
    for i in range(4):
        write(slot, list(range(10 * i, 10 * i + 5)))
        slot.add_checkpoint()
    assert len(slot.tokens) == slot.cache.length == 20
    assert [c.pos for c in slot.checkpoints] == [15, 20]  # the oldest went
    assert slot.ring_lo == 20 - (WINDOW + SLACK) == slot.cache.ring_lo


def test_roll_back_within_the_ring_and_refused_beyond_it():
    slot = make_slot()
    write(slot, list(range(30)))  # the ring holds 18..29
    slot.roll_back(27)
    assert slot.tokens == list(range(27)) and slot.cache.length == 27
    with pytest.raises(ValueError, match="cannot return to 10"):
        slot.roll_back(10)
    assert slot.tokens == list(range(27)) and slot.cache.length == 27  # nothing changed


def test_reuse_through_a_checkpoint_holds_what_it_says():
    slot = make_slot()
    write(slot, list(range(15)))
    slot.add_checkpoint()
    write(slot, list(range(15, 40)))  # the ring has moved past 15
    kept = slot.reuse(Reuse(keep=14, checkpoint=slot.checkpoints[0]))
    assert kept == 14 and slot.tokens == list(range(14)) and slot.cache.length == 14
    assert slot.checkpoints == []  # the checkpoint at 15 lies past what is held
    assert slot.ring_lo == 3  # the checkpoint's ring: positions 3..14
    assert slot.reuse(Reuse(keep=3)) == 0  # position 3 would attend to 0..2: gone, so nothing is kept
    assert slot.tokens == [] and slot.cache.length == 0 and slot.ring_lo == 0


def test_whole_state_round_trip_and_a_misfit_leaves_the_slot_empty():
    slot = make_slot()
    write(slot, list(range(20)))
    slot.add_checkpoint()
    snap, cks = slot.snapshot(), [c.data for c in slot.checkpoints]
    assert slot.snapshot_nbytes() == snap.nbytes
    other = make_slot()
    other.restore(list(range(20)), snap, cks)
    assert other.tokens == list(range(20)) and other.cache.length == 20 and other.ring_lo == slot.ring_lo
    assert [c.pos for c in other.checkpoints] == [20]
    wide = make_slot(heads=2)
    write(wide, [1, 2, 3])
    with pytest.raises(ValueError):
        wide.restore(list(range(20)), snap, cks)
    assert wide.tokens == [] and wide.checkpoints == [] and wide.cache.length == 0


def test_forget_lets_the_cache_go():
    slot = make_slot()
    write(slot, [5, 6, 7])
    slot.add_checkpoint()
    cache = slot.cache
    slot.forget()
    assert slot.tokens == [] and slot.checkpoints == [] and slot.ring_lo == 0
    assert slot.cache is not cache and slot.cache.length == 0
