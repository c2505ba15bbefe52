"""Cache correctness: prefill-then-decode and chunked/batched forwards equal a full forward."""

from __future__ import annotations

import numpy as np
import torch

from hybridmoe.models.gpt_oss import SeqChunk


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _close(a: torch.Tensor, b: np.ndarray) -> float:
    a = a.float().numpy()
    assert np.isfinite(a).all()
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_prefill_then_decode_equals_full_forward_across_window(tiny_llm):
    llm = tiny_llm
    W = llm.config.sliding_window
    ids = _ids(3 * W + 5, llm.config.vocab_size, 0)
    full = llm.logits(ids)
    cache = llm.model.make_cache(len(ids))
    split = W - 3  # prefill ends before the window edge; decode crosses it twice
    out = llm.model.forward([SeqChunk(cache, ids[:split])], all_logits=True)
    assert _close(out, full[:split]) < 1e-5
    for i in range(split, len(ids)):
        row = llm.model.forward([SeqChunk(cache, [ids[i]])])[0]
        assert _close(row, full[i]) < 1e-5, f"position {i}"
    assert cache.length == len(ids)


def test_uneven_chunks_equal_full_forward(tiny_llm):
    llm = tiny_llm
    W = llm.config.sliding_window
    ids = _ids(4 * W, llm.config.vocab_size, 1)
    full = llm.logits(ids)
    cache = llm.model.make_cache(len(ids))
    pos = 0
    for n in (5, W + 3, 1, 2 * W - 9, 1):
        out = llm.model.forward([SeqChunk(cache, ids[pos : pos + n])], all_logits=True)
        assert _close(out, full[pos : pos + n]) < 1e-5
        pos += n


def test_batched_sequences_equal_separate(tiny_llm):
    llm = tiny_llm
    a = _ids(50, llm.config.vocab_size, 2)
    b = _ids(23, llm.config.vocab_size, 3)
    ca, cb = llm.model.make_cache(64), llm.model.make_cache(64)
    both = llm.model.forward([SeqChunk(ca, a), SeqChunk(cb, b)])
    assert _close(both[0], llm.logits(a)[-1]) < 1e-5
    assert _close(both[1], llm.logits(b)[-1]) < 1e-5
    # One decode step for both in the same call.
    step = llm.model.forward([SeqChunk(ca, [7]), SeqChunk(cb, [9])])
    assert _close(step[0], llm.logits(a + [7])[-1]) < 1e-5
    assert _close(step[1], llm.logits(b + [9])[-1]) < 1e-5
    # A decode step (one-call C attention) batched with a prefill chunk (torch attention).
    mixed = llm.model.forward([SeqChunk(ca, [11]), SeqChunk(cb, [4, 5, 6])])
    assert _close(mixed[0], llm.logits(a + [7, 11])[-1]) < 1e-5
    assert _close(mixed[1], llm.logits(b + [9, 4, 5, 6])[-1]) < 1e-5


def test_sliding_layers_memory_does_not_grow_with_context(tiny_llm):
    small = tiny_llm.model.make_cache(256)
    big = tiny_llm.model.make_cache(4096)
    cfg = tiny_llm.config
    n_full = sum(not cfg.layer_is_sliding(i) for i in range(cfg.n_layers))
    per_tok_full = n_full * cfg.n_kv_heads * cfg.head_dim * 2 * 4  # K+V float32
    assert big.nbytes - small.nbytes == per_tok_full * (4096 - 256)


def test_truncate_keeps_prefix_reusable(tiny_llm):
    llm = tiny_llm
    ids = _ids(60, llm.config.vocab_size, 4)
    cache = llm.model.make_cache(128)
    llm.model.forward([SeqChunk(cache, ids)])
    kept = cache.truncate(58)
    assert kept == 58
    out = llm.model.forward([SeqChunk(cache, [5, 6])])[0]
    assert _close(out, llm.logits(ids[:58] + [5, 6])[-1]) < 1e-5
    # 60 tokens never wrapped the sliding layers' ring (window + slack rows): any prefix is kept.
    assert cache.length <= cache.layout.window + cache.layout.slack
    assert cache.truncate(3) == 3
    out = llm.model.forward([SeqChunk(cache, [7])])[0]
    assert _close(out, llm.logits(ids[:3] + [7])[-1]) < 1e-5


def test_truncate_past_the_ring_keeps_nothing(tiny_llm):
    llm = tiny_llm
    cache = llm.model.make_cache(256)
    ring = cache.layout.window + cache.layout.slack
    ids = _ids(ring + 40, llm.config.vocab_size, 5)
    llm.model.forward([SeqChunk(cache, ids)])
    # Positions 0..39 were overwritten in the ring by ring..ring+39: a rollback to 10 cannot keep them.
    assert cache.truncate(10) == 0 and cache.length == 0
    out = llm.model.forward([SeqChunk(cache, ids[:10])])[0]  # the caller re-feeds from 0
    assert _close(out, llm.logits(ids[:10])[-1]) < 1e-5
    # A rollback within the ring is kept.
    llm.model.forward([SeqChunk(cache, ids[10:])])
    assert cache.truncate(ring + 30) == ring + 30
    out = llm.model.forward([SeqChunk(cache, [3])])[0]
    assert _close(out, llm.logits(ids[: ring + 30] + [3])[-1]) < 1e-5


def test_context_overflow_is_an_error(tiny_llm):
    cache = tiny_llm.model.make_cache(8)
    import pytest

    with pytest.raises(ValueError, match="context"):
        tiny_llm.model.forward([SeqChunk(cache, list(range(9)))])


def test_half_precision_cache_holds_the_rounded_values_on_every_write_path():
    # An f16 cache (a GPU's under --fast-math) fed float32 keys: the slice writes (full layer,
    # ring without wrap), the wrapped ring write and a chunk longer than the free ring all store
    # k.half(), with the right positions.
    from hybridmoe.models.kv_cache import CacheLayout, SequenceKVCache

    W, slack, Hkv, d = 8, 4, 2, 4
    layout = CacheLayout(n_layers=2, sliding=(True, False), n_kv_heads=Hkv, head_dim=d, window=W,
                         devices=(torch.device("cpu"),) * 2, dtype=torch.float16, slack=slack)
    cache = SequenceKVCache(layout, 64)
    gen = torch.Generator().manual_seed(0)
    rows = W + slack
    seen: dict[int, torch.Tensor] = {}
    for T in (5, 3, 1, 1, 4, 1, 9, 1):  # the 9-token chunk exceeds rows - W + 1: the cat path
        k = torch.randn(T, Hkv, d, generator=gen) * 3
        pos0 = cache.length
        for p in range(T):
            seen[pos0 + p] = k[p]
        for layer in (0, 1):
            K, V, P = cache.update(layer, k, -k, pos0)
            assert K.dtype == V.dtype == torch.float16
            for j in range(K.shape[1]):
                p = int(P[j])
                if p >= 0:
                    assert torch.equal(K[:, j], seen[p].half()) and torch.equal(V[:, j], (-seen[p]).half())
        cache.advance(T)
    ring_k, _, ring_p = cache._k[0], cache._v[0], cache._pos[0]
    assert sorted(int(p) for p in ring_p) == list(range(cache.length - rows, cache.length))
    for j in range(rows):
        assert torch.equal(ring_k[:, j], seen[int(ring_p[j])].half())
    full = cache._k[1][:, : cache.length]
    assert torch.equal(full, torch.stack([seen[p] for p in range(cache.length)], dim=1).half())
