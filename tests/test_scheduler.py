"""The scheduler alone: admission, reuse, step plans and checkpoints over fake slots, no model.

The scheduler reads slots through `SlotView` and never touches a tensor, so these tests build it
directly with `FakeSlot`s (token lists, a ring rule, checkpoints as tags). The module runs a second
time in a fresh interpreter with torch blocked (`test_runs_without_torch`).
"""

from __future__ import annotations

import os
import subprocess
import sys

from hybridmoe.engine.request import GenerationRequest, SequenceState
from hybridmoe.engine.scheduler import (
    MIN_SAVED_TOKENS,
    CacheConfig,
    CachedPrompt,
    Checkpoint,
    PromptCache,
    Reuse,
    Scheduler,
)
from hybridmoe.models.kv_window import WindowGeometry

RING = WindowGeometry(window=8, ring=12)  # a sliding layer keeps 12 positions; a token sees 8


class FakeSlot:
    """A slot as the scheduler sees it: tokens, the ring's low end, checkpoints; the KV "state" is
    the token list itself, so what a reuse loads can be checked."""

    def __init__(self, slot_id: int, geometry: WindowGeometry, max_checkpoints: int = 32) -> None:
        self.id = slot_id
        self.geometry = geometry
        self.max_checkpoints = max_checkpoints
        self.tokens: list[int] = []
        self.checkpoints: list[Checkpoint] = []
        self.seq: SequenceState | None = None
        self.last_used = 0.0
        self.ring_lo = 0
        self.loaded_from: str | None = None  # what the last reuse went through

    def feed(self, tokens: list[int]) -> None:  # what the engine does with a step's chunk
        self.tokens.extend(tokens)
        self.ring_lo = self.geometry.lo_after(self.ring_lo, len(self.tokens))

    def cached_prompt(self) -> CachedPrompt:
        return CachedPrompt(list(self.tokens), self.ring_lo, 100 * len(self.tokens), ("state", list(self.tokens)),
                            list(self.checkpoints))

    def reuse(self, reuse: Reuse) -> int:
        tokens, lo, checkpoints = self.tokens, self.ring_lo, self.checkpoints
        self.loaded_from = "slot"
        if reuse.entry is not None:
            tokens, lo, checkpoints = reuse.entry.tokens, reuse.entry.ring_lo, reuse.entry.checkpoints
            self.loaded_from = "entry"
        if reuse.checkpoint is not None:
            tokens, lo = tokens[: reuse.checkpoint.pos], reuse.checkpoint.ring_lo
            self.loaded_from += "+checkpoint"
        kept = reuse.keep if self.geometry.can_roll_back(lo, len(tokens), reuse.keep) else 0
        self.tokens = list(tokens[:kept])
        self.ring_lo = lo if kept else 0
        self.checkpoints = [c for c in checkpoints if c.pos <= kept]
        return kept

    def add_checkpoint(self) -> None:
        self.checkpoints.append(Checkpoint(len(self.tokens), self.ring_lo, 10, ("checkpoint", len(self.tokens))))
        del self.checkpoints[: max(0, len(self.checkpoints) - self.max_checkpoints)]


def make(n_slots: int = 2, batch_size: int = 64, geometry: WindowGeometry = RING,
         **cache) -> tuple[Scheduler, list[FakeSlot]]:
    slots = [FakeSlot(i, geometry) for i in range(n_slots)]
    return Scheduler(slots, batch_size, geometry, CacheConfig(**cache)), slots


def request(prompt: list[int], **kw) -> SequenceState:
    return SequenceState(GenerationRequest(list(prompt), params=None, **kw), sink=None)


def run_prompt(sched: Scheduler, seq: SequenceState) -> None:
    """Admit `seq`, then feed its prompt and end it (its slot keeps the state)."""
    sched.waiting.append(seq)
    for adm in sched.admit():
        sched.load(adm)
    run_prompt_rest(sched, seq)


def run_prompt_rest(sched: Scheduler, seq: SequenceState) -> None:
    """Feed an admitted sequence's prompt step by step (the engine's order), then release it."""
    while seq.pending:
        for s, toks in sched.plan_step().batch:
            sched.slots[s.slot_id].feed(toks)
            sched.fed(s, toks)
    sched.release(seq)
    assert sched.slots[seq.slot_id].seq is None


def test_admission_is_fifo_and_waits_for_a_free_slot():
    sched, slots = make(n_slots=2)
    seqs = [request([1, 2, 3 + i]) for i in range(3)]
    sched.waiting.extend(seqs)
    placed = sched.admit()
    assert [a.seq for a in placed] == seqs[:2]
    assert sorted(a.slot.id for a in placed) == [0, 1] and list(sched.waiting) == seqs[2:]
    assert sched.running() == seqs[:2] and sched.free_slots() == []
    sched.release(seqs[0])
    (adm,) = sched.admit()
    assert adm.seq is seqs[2] and adm.slot is slots[seqs[0].slot_id] and not sched.waiting


def test_a_request_for_a_slot_waits_for_it_and_the_ones_behind_go_on():
    sched, slots = make(n_slots=2)
    busy = request([1, 2])
    sched.waiting.append(busy)
    (first,) = sched.admit()
    pinned = request([5, 6], id_slot=first.slot.id)
    other = request([7, 8])
    sched.waiting.extend([pinned, other])
    (adm,) = sched.admit()
    assert adm.seq is other and adm.slot.id != first.slot.id
    assert list(sched.waiting) == [pinned]
    sched.release(busy)
    (adm,) = sched.admit()
    assert adm.seq is pinned and adm.slot.id == first.slot.id


def test_step_plan_puts_decode_tokens_first_and_chunks_prompts_to_the_budget():
    sched, slots = make(n_slots=3, batch_size=5)
    decoding = request([1, 2, 3])
    sched.waiting.append(decoding)
    for adm in sched.admit():
        sched.load(adm)
    plan = sched.plan_step()
    assert plan.batch == [(decoding, [1, 2, 3])]
    slots[decoding.slot_id].feed([1, 2, 3])
    sched.fed(decoding, [1, 2, 3])
    decoding.next_token = 9  # sampled from the prompt's last logits
    long_a, long_b = request(list(range(10, 18))), request(list(range(20, 24)))
    sched.waiting.extend([long_a, long_b])
    for adm in sched.admit():
        sched.load(adm)
    plan = sched.plan_step()
    assert plan.batch == [(decoding, [9]), (long_a, [10, 11, 12, 13, 14])]  # prompt tokens: at most 5
    assert plan.n_tokens == 6
    for seq, toks in plan.batch:
        slots[seq.slot_id].feed(toks)
        sched.fed(seq, toks)
    assert decoding.next_token is None and long_a.pending == [15, 16, 17]
    plan = sched.plan_step()
    assert plan.batch == [(long_a, [15, 16, 17]), (long_b, [20, 21])]


def test_the_slot_sharing_the_longest_prefix_is_chosen_and_one_token_is_left_to_compute():
    sched, slots = make(n_slots=2, geometry=WindowGeometry(0, 0))  # no sliding layers: any rollback
    a, b = request([1, 2, 3, 4, 5, 6]), request([8, 9, 9, 9])  # b goes to the unused slot
    run_prompt(sched, a)
    run_prompt(sched, b)
    follow = request([1, 2, 3, 4, 5, 6, 7])
    sched.waiting.append(follow)
    (adm,) = sched.admit()
    assert adm.slot.id == a.slot_id and adm.reuse == Reuse(6, None, None)
    sched.load(adm)
    assert follow.n_cached == 6 and follow.pending == [7] and slots[a.slot_id].tokens == [1, 2, 3, 4, 5, 6]
    sched.release(follow)
    same = request([1, 2, 3, 4, 5, 6, 7])  # the whole prompt is cached: its last token is recomputed
    sched.waiting.append(same)
    (adm,) = sched.admit()
    sched.load(adm)
    assert same.n_cached == 6 and same.pending == [7]


def test_without_cache_prompt_nothing_is_reused():
    sched, slots = make(n_slots=1, geometry=WindowGeometry(0, 0))
    run_prompt(sched, request([1, 2, 3, 4]))
    again = request([1, 2, 3, 4, 5], cache_prompt=False)
    sched.waiting.append(again)
    (adm,) = sched.admit()
    sched.load(adm)
    assert again.n_cached == 0 and again.pending == [1, 2, 3, 4, 5] and slots[0].tokens == []


def test_checkpoints_at_the_prompt_end_and_every_checkpoint_every_tokens():
    sched, slots = make(n_slots=1, batch_size=4, checkpoint_every=6)
    run_prompt(sched, request(list(range(100, 115))))  # 15 tokens in chunks of 4
    assert [c.pos for c in slots[0].checkpoints] == [8, 15]  # 8: 6 past none (at a chunk end); 15: the end
    no_ring, flat = make(n_slots=1, geometry=WindowGeometry(0, 0))
    run_prompt(no_ring, request(list(range(100, 115))))
    assert flat[0].checkpoints == []  # without sliding layers any prefix can be reused directly


def test_a_prefix_the_ring_has_lost_comes_back_through_a_checkpoint():
    sched, slots = make(n_slots=1, batch_size=64)
    first = list(range(100, 130))  # 30 tokens: the ring (12) wrapped, it holds 18..29
    run_prompt(sched, request(first[:20]))  # checkpoint at 20
    cont = request(first)
    sched.waiting.append(cont)
    (adm,) = sched.admit()
    sched.load(adm)
    while cont.pending:
        for s, toks in sched.plan_step().batch:
            slots[0].feed(toks)
            sched.fed(s, toks)
    sched.release(cont)
    assert [c.pos for c in slots[0].checkpoints] == [20, 30] and slots[0].ring_lo == 18
    diverging = request(first[:22] + [7, 7, 7])  # shares 22 tokens: the ring cannot return to 22
    sched.waiting.append(diverging)
    (adm,) = sched.admit()
    assert adm.reuse.keep == 20 and adm.reuse.checkpoint is slots[0].checkpoints[0]
    sched.load(adm)
    assert slots[0].loaded_from == "slot+checkpoint" and diverging.n_cached == 20
    assert diverging.pending == first[20:22] + [7, 7, 7] and [c.pos for c in slots[0].checkpoints] == [20]


def test_a_displaced_conversation_goes_to_the_ram_cache_and_comes_back():
    sched, slots = make(n_slots=1, geometry=WindowGeometry(0, 0))
    talk = list(range(200, 200 + MIN_SAVED_TOKENS + 4))
    run_prompt(sched, request(talk))
    other = request(list(range(300, 310)))
    sched.waiting.append(other)
    (adm,) = sched.admit()
    assert adm.save_first and adm.reuse.keep == 0
    sched.load(adm)
    (entry,) = sched.prompt_cache.entries
    assert entry.tokens == talk and entry.data == ("state", talk)
    run_prompt_rest(sched, other)
    back = request(talk + [1, 2])
    sched.waiting.append(back)
    (adm,) = sched.admit()
    assert adm.reuse.entry is entry and adm.reuse.keep == len(talk)
    sched.load(adm)
    assert slots[0].loaded_from == "entry" and back.n_cached == len(talk) and back.pending == [1, 2]
    assert not adm.save_first  # `other` is too short to keep
    assert sched.prompt_cache.entries == []  # the entry was taken: the slot holds it now


def test_short_states_and_states_the_cache_holds_are_not_saved_again():
    sched, slots = make(n_slots=1, geometry=WindowGeometry(0, 0))
    run_prompt(sched, request(list(range(MIN_SAVED_TOKENS - 1))))
    sched.waiting.append(request([900, 901]))
    (adm,) = sched.admit()
    assert not adm.save_first  # cheaper to recompute than to keep
    sched.load(adm)
    run_prompt_rest(sched, adm.seq)
    run_prompt(sched, request(list(range(50, 50 + MIN_SAVED_TOKENS))))
    sched.prompt_cache.put(slots[0].cached_prompt())
    sched.waiting.append(request([900, 901]))
    (adm,) = sched.admit()
    assert not adm.save_first  # an entry already holds these tokens


def test_draft_room_keeps_a_rollback_the_ring_can_undo():
    sched, slots = make(n_slots=1)
    seq = request(list(range(10)))
    run_prompt(sched, seq)
    sched.waiting.append(seq := request(list(range(10)) + [5]))
    for adm in sched.admit():
        sched.load(adm)
    slots[0].feed(seq.pending)
    sched.fed(seq, list(seq.pending))
    assert sched.draft_room(seq, ctx_size=100) == RING.ring - RING.window  # the ring wraps: 4
    assert sched.draft_room(seq, ctx_size=14) == 14 - 12 - 1  # context: one token kept free
    flat, flat_slots = make(n_slots=1, geometry=WindowGeometry(0, 0))
    run_prompt(flat, s2 := request(list(range(11))))
    flat.waiting.append(s3 := request(list(range(11)) + [1]))
    for adm in flat.admit():
        flat.load(adm)
    assert flat.draft_room(s3, ctx_size=100) == 100 - 12 - 1 and s2.slot_id == s3.slot_id


def test_prompt_cache_drops_least_recently_used_entries_and_subsumed_prefixes():
    cache = PromptCache(limit=250)
    old = CachedPrompt([1, 2, 3], 0, 100, "old", [], last_used=1.0)
    new = CachedPrompt([4, 5], 0, 100, "new", [], last_used=2.0)
    assert cache.put(old) and cache.put(new)
    longer = CachedPrompt([1, 2, 3, 4], 0, 100, "longer", [], last_used=3.0)
    assert cache.put(longer)
    assert cache.entries == [new, longer]  # `old` is a prefix of `longer`
    assert cache.covers([4]) and not cache.covers([5])
    assert cache.put(CachedPrompt([9], 0, 100, "third", [], last_used=4.0))
    assert [e.data for e in cache.entries] == ["longer", "third"] and cache.nbytes == 200  # LRU went
    assert not cache.put(CachedPrompt([8], 0, 300, "too big", []))
    assert not PromptCache(limit=0).enabled and not PromptCache(limit=0).put(new)


def test_memory_report_counts_checkpoints_and_the_ram_cache():
    sched, slots = make(n_slots=2, batch_size=64, cache_ram_bytes=10_000)
    run_prompt(sched, request(list(range(20))))
    sched.prompt_cache.put(CachedPrompt([7] * 20, 0, 500, "x", []))
    assert sched.memory() == {"checkpoint_bytes": 10, "n_checkpoints": 1, "prompt_cache_bytes": 500,
                              "prompt_cache_entries": 1, "prompt_cache_limit_bytes": 10_000}


def test_runs_without_torch():
    """This module again in a fresh interpreter where `import torch` fails."""
    if os.environ.get("HYBRIDMOE_TORCH_BLOCKED"):
        assert sys.modules.get("torch", None) is None
        return
    code = ("import sys; sys.modules['torch'] = None\n"
            "import pytest\n"
            "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '--noconftest', sys.argv[1]]))\n")
    env = {**os.environ, "HYBRIDMOE_TORCH_BLOCKED": "1"}
    r = subprocess.run([sys.executable, "-c", code, __file__], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert " passed" in r.stdout and "failed" not in r.stdout
