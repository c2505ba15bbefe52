"""Prompt reuse (engine v2): greedy output is token-identical whether a prefix comes from the slot,
a checkpoint, the RAM prompt cache, a slot file, or is recomputed; bounds on the memory used.

Tiny random model: sliding window 16, ring of 80 rows, so prompts of ~150 tokens wrap the ring
and a rollback further than the ring's slack must go through a checkpoint.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from hybridmoe.engine.engine import CacheConfig, Engine, GenerationRequest
from hybridmoe.engine.sampler import SamplingParams
from hybridmoe.engine.slot_files import SlotFileError
from hybridmoe.models.kv_cache import CacheLayout, SequenceKVCache

N_GEN = 24


def ids(n: int, seed: int, vocab: int = 1000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(20, vocab) for _ in range(n)]


def make_engine(llm, n_parallel: int = 1, ctx: int = 512, **cache) -> Engine:
    return Engine(llm.loaded, n_parallel, ctx, max_queue=16, batch_size=64, cache=CacheConfig(**cache))


def run(engine: Engine, prompt: list[int], cache_prompt: bool = True):
    """(generated ids, cached prompt tokens) of one greedy request."""
    req = GenerationRequest(prompt, SamplingParams(temperature=0.0, max_tokens=N_GEN, ignore_eos=True),
                            cache_prompt=cache_prompt)
    events = engine.generate(req)
    last = events[-1]
    assert last.finish_reason == "length", last.error
    return [e.token_id for e in events if e.token_id is not None], last.usage.cached_tokens


def assert_same_greedy(llm, prompt: list[int], out: list[int], ref: list[int]) -> None:
    """Token-identical, except where the two choices tie within float noise: under concurrent load
    a prompt's chunks are batched with other requests' tokens, so sums run in another order (and an
    expert may switch between the GEMV and GEMM kernels). A flip is allowed only at a top-2 margin
    below 1e-5 of the logits' scale, checked on a from-scratch forward."""
    if out == ref:
        return
    i = next(j for j, (a, b) in enumerate(zip(out, ref)) if a != b)
    row = llm.logits(prompt + ref[:i])[-1]
    margin = abs(float(row[ref[i]]) - float(row[out[i]]))
    assert margin < 1e-5 * float(abs(row).max()), f"token {i}: {out[i]} vs {ref[i]}, margin {margin:.3g}"


@pytest.fixture(scope="module")
def conv(tiny_llm):
    """A first prompt (wraps the ring), its greedy reply, and follow-up prompts diverging at
    different depths, with their outputs recomputed from scratch."""
    first = ids(150, 1)
    reply, _ = run(make_engine(tiny_llm), first)
    full = first + reply[:-1]  # what a slot holds after the request (the last token is never fed)
    follow = {
        # inside the ring's slack: the live slot rolls back
        "in_window": full[:-6] + ids(20, 2),
        # exactly at the prompt's end: the end-of-prompt checkpoint
        "at_checkpoint": first + ids(20, 3),
        # 8 tokens before the prompt's end: the checkpoint at the end, then a rollback
        "before_checkpoint_end": first[:-8] + ids(20, 4),
        # far before the first checkpoint (position 150): nothing to reuse
        "before_first_checkpoint": first[:40] + ids(60, 5),
    }
    fresh = make_engine(tiny_llm)
    reference = {k: run(fresh, p, cache_prompt=False)[0] for k, p in follow.items()}
    return first, reply, follow, reference


EXPECTED_KEEP = {"in_window": 150 + N_GEN - 1 - 6, "at_checkpoint": 150, "before_checkpoint_end": 142,
                 "before_first_checkpoint": 0}


@pytest.mark.parametrize("case", list(EXPECTED_KEEP))
def test_from_slot_or_checkpoint(tiny_llm, conv, case):
    first, reply, follow, reference = conv
    eng = make_engine(tiny_llm)
    assert run(eng, first)[0] == reply
    out, cached = run(eng, follow[case])
    assert cached == EXPECTED_KEEP[case]
    assert out == reference[case]


@pytest.mark.parametrize("case", ["in_window", "at_checkpoint", "before_checkpoint_end"])
def test_from_ram_cache_after_another_conversation(tiny_llm, conv, case):
    first, reply, follow, reference = conv
    eng = make_engine(tiny_llm)  # one slot: B evicts A's state into the RAM cache
    run(eng, first)
    other = ids(120, 9)
    run(eng, other)
    assert eng.status()["memory"]["prompt_cache_entries"] == 1
    out, cached = run(eng, follow[case])
    assert cached == EXPECTED_KEEP[case]
    assert out == reference[case]
    # B went to the RAM cache in turn and comes back whole.
    again, cached_b = run(eng, other + ids(10, 10))
    assert cached_b == len(other)


@pytest.mark.parametrize("case", ["in_window", "at_checkpoint"])
def test_from_slot_file(tiny_llm, conv, case, tmp_path):
    first, reply, follow, reference = conv
    eng = make_engine(tiny_llm)
    run(eng, first)
    path = str(tmp_path / "a.slot")
    saved = eng.save_slot(0, path)
    assert saved["n_saved"] == 150 + N_GEN - 1
    other = make_engine(tiny_llm)
    restored = other.restore_slot(0, path)
    assert restored["n_restored"] == saved["n_saved"] and restored["n_read"] == saved["n_written"]
    out, cached = run(other, follow[case])
    assert cached == EXPECTED_KEEP[case]
    assert out == reference[case]


def test_slot_file_refusals(tiny_llm, conv, tmp_path, tiny_gguf):
    first, *_ = conv
    eng = make_engine(tiny_llm)
    run(eng, first)
    path = tmp_path / "a.slot"
    eng.save_slot(0, str(path))
    data = path.read_bytes()
    (tmp_path / "cut.slot").write_bytes(data[: len(data) // 2])
    with pytest.raises(SlotFileError, match="truncated"):
        make_engine(tiny_llm).restore_slot(0, str(tmp_path / "cut.slot"))
    flipped = bytearray(data)
    flipped[-100] ^= 0xFF
    (tmp_path / "flip.slot").write_bytes(bytes(flipped))
    with pytest.raises(SlotFileError, match="checksum"):
        make_engine(tiny_llm).restore_slot(0, str(tmp_path / "flip.slot"))
    (tmp_path / "junk.slot").write_bytes(b"not a slot file at all")
    with pytest.raises(SlotFileError, match="not a hybridmoe slot file"):
        make_engine(tiny_llm).restore_slot(0, str(tmp_path / "junk.slot"))
    with pytest.raises(SlotFileError, match="context size"):
        make_engine(tiny_llm, ctx=256).restore_slot(0, str(path))
    from hybridmoe import LLM, ComputeSettings
    from hybridmoe.synth import write_synthetic

    other_model = LLM(write_synthetic(tmp_path / "other.gguf", "tiny", seed=1), compute=ComputeSettings(threads=1))
    with pytest.raises(SlotFileError, match="model weights"):
        make_engine(other_model).restore_slot(0, str(path))
    # A refused file leaves the slot usable.
    eng2 = make_engine(tiny_llm)
    with pytest.raises(SlotFileError):
        eng2.restore_slot(0, str(tmp_path / "flip.slot"))
    assert run(eng2, first)[1] == 0


def test_parallel_conversations_under_load(tiny_llm):
    """4 slots, 6 concurrent 3-turn conversations (more than slots: the RAM cache swaps them):
    every turn's output equals recomputation from scratch, and later turns reuse their prefix."""
    eng = make_engine(tiny_llm, n_parallel=4, ctx=768).start()
    fresh = make_engine(tiny_llm, ctx=768)
    results: dict[int, list[tuple[list[int], list[int], int]]] = {}

    def converse(c: int) -> None:
        prompt, turns = ids(100 + 10 * c, 100 + c), []
        for t in range(3):
            out, cached = run(eng, prompt)
            turns.append((list(prompt), out, cached))
            prompt = prompt + out[:-1] + ids(15, 1000 * c + t)
        results[c] = turns

    try:
        threads = [threading.Thread(target=converse, args=(c,)) for c in range(6)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(300)
        assert len(results) == 6
    finally:
        eng.close()
    for c, turns in results.items():
        for t, (prompt, out, cached) in enumerate(turns):
            assert_same_greedy(tiny_llm, prompt, out, run(fresh, prompt, cache_prompt=False)[0])
            if t > 0:
                prev_prompt, prev_out, _ = turns[t - 1]
                assert cached >= len(prev_prompt) + len(prev_out) - 1 - 1, (c, t, cached)


def test_ram_cache_is_bounded_and_lru(tiny_llm):
    one = make_engine(tiny_llm)
    run(one, ids(100, 50))
    run(one, ids(100, 51))
    entry_bytes = one.scheduler.prompt_cache.entries[0].nbytes  # the state and its checkpoint
    # Room for two such entries, not three.
    limit = int(2.5 * entry_bytes)
    eng = make_engine(tiny_llm, cache_ram_bytes=limit)
    convs = [ids(100, 60 + i) for i in range(5)]
    for p in convs:
        run(eng, p)
        mem = eng.status()["memory"]
        assert mem["prompt_cache_bytes"] <= limit
    assert eng.status()["memory"]["prompt_cache_entries"] == 2
    # The most recent ones are kept (convs[3] in RAM, convs[4] in the slot), the oldest dropped.
    assert run(eng, convs[3] + [5])[1] == 100
    assert run(eng, convs[0] + [5])[1] == 0
    off = make_engine(tiny_llm, cache_ram_bytes=0)
    for p in convs[:3]:
        run(off, p)
    assert off.status()["memory"]["prompt_cache_entries"] == 0


def test_checkpoints_are_bounded(tiny_llm):
    eng = make_engine(tiny_llm, ctx=1024, ctx_checkpoints=3, checkpoint_every=64)
    run(eng, ids(600, 70))  # a checkpoint every 64 tokens: 9 made, the 3 latest kept
    slot = eng.status()["slots"][0]
    assert slot["n_checkpoints"] == 3
    assert slot["checkpoint_bytes"] == 3 * eng.slots[0].checkpoints[0].nbytes > 0


def _reference_can_roll_back(P: torch.Tensor, n: int, window: int) -> bool:
    """The cache's former test: positions n-window+1..n-1 all present in the ring."""
    need_from = max(0, n - window + 1)
    return n == 0 or int(((P >= need_from) & (P < n)).sum()) == n - need_from


@pytest.mark.parametrize("seed", range(5))
def test_window_arithmetic_matches_ring_contents(seed):
    """WindowGeometry (what the scheduler plans with) agrees with what the ring actually holds,
    over random feeds (chunks and single tokens) and rollbacks."""
    rng = random.Random(seed)
    layout = CacheLayout(n_layers=1, sliding=(True,), n_kv_heads=1, head_dim=2, window=8,
                         devices=(torch.device("cpu"),), slack=5)
    cache = SequenceKVCache(layout, 400)
    geo = cache.geometry
    for _ in range(60):
        if rng.random() < 0.7 and cache.length < 380:
            t = rng.choice([1, 1, 2, 3, 7, 13, 20])
            cache.update(0, torch.zeros(t, 1, 2), torch.zeros(t, 1, 2), cache.length)
            cache.advance(t)
        else:
            n = rng.randrange(0, cache.length + 1)
            P = cache._pos[0]
            for m in range(cache.length + 1):
                assert geo.can_roll_back(cache.ring_lo, cache.length, m) == _reference_can_roll_back(P, m, 8)
            kept = cache.truncate(n)
            assert kept in (n, 0)


@pytest.mark.parametrize("case", ["in_window", "at_checkpoint", "before_checkpoint_end"])
def test_from_the_prompt_cache_dir_after_a_restart(tiny_llm, conv, case, tmp_path):
    """serve --prompt-cache-dir: a slot's state and a RAM-cache entry written at shutdown come back
    in a new engine; the follow-ups reuse them and write what a fresh computation writes."""
    first, reply, follow, reference = conv
    eng = make_engine(tiny_llm)
    run(eng, first)
    other = ids(120, 9)
    run(eng, other)  # `first` goes to the RAM cache, `other` stays in the slot
    n_files, n_bytes = eng.persistence.save_prompt_cache(str(tmp_path))
    assert n_files == 2 and n_bytes == sum(p.stat().st_size for p in tmp_path.iterdir())
    restarted = make_engine(tiny_llm)
    assert restarted.persistence.load_prompt_cache(str(tmp_path))[0] == 2
    out, cached = run(restarted, follow[case])
    assert cached == EXPECTED_KEEP[case]
    assert out == reference[case]
    _, cached_other = run(restarted, other + ids(10, 10))
    assert cached_other == len(other)


def test_the_prompt_cache_dir_keeps_what_fits(tiny_llm, conv, tmp_path, caplog):
    first, *_ = conv
    eng = make_engine(tiny_llm)
    run(eng, first)
    assert eng.persistence.save_prompt_cache(str(tmp_path))[0] == 1
    (saved,) = list(tmp_path.iterdir())
    run(eng, first[:100] + ids(30, 11))  # the first state goes to the RAM cache: two to keep
    assert eng.persistence.save_prompt_cache(str(tmp_path))[0] == 2 and saved.exists()  # same tokens, same file
    # A state over the limit is not written, and files of states no longer kept go.
    small = make_engine(tiny_llm, cache_ram_bytes=1)
    run(small, first)
    assert small.persistence.save_prompt_cache(str(tmp_path)) == (0, 0) and list(tmp_path.iterdir()) == []
    # Files for another context or damaged ones are skipped, and said so.
    eng.persistence.save_prompt_cache(str(tmp_path))
    (tmp_path / ("0" * 24 + ".hmprompt")).write_bytes(b"junk")
    with caplog.at_level("WARNING"):
        assert make_engine(tiny_llm, ctx=256).persistence.load_prompt_cache(str(tmp_path)) == (0, 0)
    assert "context size per slot" in caplog.text and "not a hybridmoe slot file" in caplog.text
    assert make_engine(tiny_llm).persistence.load_prompt_cache(str(tmp_path / "absent")) == (0, 0)


def test_choose_newest_first_without_prefixes_within_the_limit():
    from hybridmoe.engine.prompt_store import Kept, choose
    from hybridmoe.models.kv_cache import KVSnapshot

    def kept(tokens: list[int], when: float, nbytes: int) -> Kept:
        return Kept(tokens, KVSnapshot(len(tokens), 0, [(torch.zeros(nbytes, dtype=torch.uint8), torch.zeros(0),
                                                          None)]), [], when)

    a, a_prefix, b, big = kept([1, 2, 3, 4], 3.0, 10), kept([1, 2], 4.0, 5), kept([7, 8], 2.0, 10), kept([9], 1.0, 99)
    assert choose([a, a_prefix, b, big], None) == [a, b, big]  # a_prefix is newer, but a holds it
    assert choose([a, a_prefix, b, big], 25) == [a, b]
    assert choose([a, b], 0) == []


def test_the_keeper_writes_after_a_quiet_spell_and_only_what_changed(tiny_llm, conv, tmp_path):
    import time

    from hybridmoe.engine.prompt_store import Keeper

    first, *_ = conv
    eng = make_engine(tiny_llm, n_parallel=2).start()
    keeper = Keeper(eng, str(tmp_path), idle_seconds=0.2, poll_seconds=0.05).start()
    try:
        run(eng, first)
        deadline = time.monotonic() + 30
        while not list(tmp_path.glob("*.hmprompt")) and time.monotonic() < deadline:
            time.sleep(0.05)
        (written,) = list(tmp_path.glob("*.hmprompt"))
        assert keeper.save() == (1, 0)  # nothing new: the file stays as it is
        run(eng, ids(60, 12))  # the second slot
        assert keeper.save()[0] == 2 and written.exists()
    finally:
        keeper.close()
        eng.close()
    assert keeper.save() == (2, 0)  # after the engine stopped, as at shutdown


def test_a_file_of_another_setup_never_stands_in_for_a_state(tiny_llm, conv, tmp_path):
    """Same tokens, another context per slot: a new file is written (and the old one goes), so the
    next start with this setup finds its state."""
    first, *_ = conv
    a = make_engine(tiny_llm)
    run(a, first)
    a.persistence.save_prompt_cache(str(tmp_path))
    (old,) = list(tmp_path.iterdir())
    b = make_engine(tiny_llm, ctx=256)
    run(b, first)
    assert b.persistence.save_prompt_cache(str(tmp_path))[1] > 0
    (new,) = list(tmp_path.iterdir())
    assert new != old and make_engine(tiny_llm, ctx=256).persistence.load_prompt_cache(str(tmp_path))[0] == 1


def test_slot_states_are_copied_only_to_be_written(tiny_llm, conv, tmp_path):
    """A slot's state is sized without a copy, copied when its file is written, and not written at
    all when the slot has moved on between the choice and the copy."""
    from hybridmoe.engine import prompt_store

    first, *_ = conv
    eng = make_engine(tiny_llm)
    run(eng, first)
    cache = eng.slots[0].cache
    assert cache.snapshot_nbytes() == cache.snapshot(full_layers=True).nbytes
    (state,) = eng.persistence.prompt_states()
    assert state.snapshot is None and state.nbytes >= cache.snapshot_nbytes()
    run(eng, ids(40, 13))  # the slot moves on before the state is written
    assert state.take() is None
    identity = eng.persistence.identity
    assert prompt_store.save(str(tmp_path), identity, [state], None) == (0, 0) and list(tmp_path.iterdir()) == []
