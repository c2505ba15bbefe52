"""Self-speculative decoding: the n-gram lookup and the draft length choice against slow
references, and the engine's verification against plain decoding on the tiny model.

The engine tests replace the n-gram lookup with an oracle that proposes the reference reply's
next tokens, spoiled at random positions, so every path (kept drafts, rejections at each
position, rollbacks past the sliding window, endings inside a draft) runs on a real model."""

from __future__ import annotations

import random

import numpy as np
import pytest

from hybridmoe import LLM, ComputeSettings
from hybridmoe.engine import speculative
from hybridmoe.engine.speculative import Acceptance, SequenceDrafts, StepCosts, best_draft_len, ngram_draft
from hybridmoe.settings import SpeculativeSettings
from hybridmoe.settings.values import SettingsError

PROMPT = [5, 17, 300, 42, 9, 77, 512, 3, 8, 100, 250, 31]


# ---- n-gram lookup ----------------------------------------------------------------------------------
def _ngram_reference(h: list[int], n: int, m: int, min_hits: int) -> list[int]:
    L = len(h)
    if L <= n:
        return []
    key = h[L - n:]
    starts = [s for s in range(L - n - 1, -1, -1) if h[s : s + n] == key]  # latest first, not the key itself
    if len(starts) < min_hits:
        return []
    s = starts[0]
    return h[s + n : s + n + m]


def test_ngram_draft_matches_a_brute_force_search():
    rng = random.Random(0)
    for _ in range(3000):
        vocab = rng.choice([2, 3, 5])  # small vocabularies repeat n-grams often
        h = [rng.randrange(vocab) for _ in range(rng.randrange(0, 60))]
        n, m, hits = rng.randint(1, 5), rng.randint(1, 8), rng.randint(1, 3)
        got = ngram_draft(np.array(h, dtype=np.int32), n, m, hits).tolist()
        assert got == _ngram_reference(h, n, m, hits), (h, n, m, hits)


def test_ngram_draft_proposes_what_followed_the_latest_occurrence():
    h = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], dtype=np.int32)
    assert ngram_draft(h, 3, 4).tolist() == [7, 8, 1, 2]
    assert ngram_draft(h, 3, 4, min_hits=2).tolist() == [7, 8, 1, 2]
    assert ngram_draft(h, 3, 4, min_hits=3).tolist() == []
    assert ngram_draft(h, 4, 4).tolist() == []  # 9 1 2 3 / 8 1 2 3: no earlier 4-gram match


# ---- draft length -----------------------------------------------------------------------------------
def _costs(table: dict[int, float]) -> StepCosts:
    c = StepCosts()
    for n, t in table.items():
        c.record(n, t)
    return c


def test_step_costs_interpolate_and_extrapolate():
    c = _costs({1: 0.1, 5: 0.3})
    assert c.estimate(1) == pytest.approx(0.1) and c.estimate(5) == pytest.approx(0.3)
    assert c.estimate(3) == pytest.approx(0.2)
    assert c.estimate(10) == pytest.approx(0.6)  # the largest step's per-token cost
    c.record(1, 0.2)  # new measurements move the estimate part of the way
    assert 0.1 < c.estimate(1) < 0.2


def test_best_draft_len_is_the_argmax_of_expected_tokens_per_second():
    rng = random.Random(1)
    for _ in range(300):
        base = rng.randint(1, 4)
        table, t = {}, 0.0
        for n in range(1, 40):
            t += rng.uniform(0.001, 0.05) if n > 1 else rng.uniform(0.02, 0.2)
            table[n] = t
        costs, rate, max_len = _costs(table), rng.random(), rng.randint(0, 30)
        values = [(base + sum(rate**i for i in range(1, k + 1))) / costs.estimate(base + k) for k in range(max_len + 1)]
        k = best_draft_len(rate, costs, base, max_len)
        assert values[k] == pytest.approx(max(values), rel=1e-12)


def test_no_draft_when_tokens_cost_their_full_price():
    linear = _costs({n: 0.1 * n for n in range(1, 65)})  # a batch of T costs T single steps
    for rate in (0.5, 0.9, 0.999):
        assert best_draft_len(rate, linear, 1, 64) == 0
    flat = _costs({1: 0.1, 65: 0.1})  # free extra tokens (nearly so on a GPU or many cores)
    assert best_draft_len(0.9, flat, 1, 64) == 64
    assert best_draft_len(0.9, StepCosts(), 1, 64) == 0  # nothing measured yet


def test_a_step_other_streams_wait_on_is_not_stretched_past_the_cap():
    costs = _costs({4: 0.3, 52: 2.2})  # 4 streams; 48 more tokens cost 7x the step
    free = best_draft_len(0.99, costs, 4, 48)  # what the aggregate alone would choose
    k = best_draft_len(0.99, costs, 4, 48, max_seconds=0.6)
    assert 0 < k < free and costs.estimate(4 + k) <= 0.6 < costs.estimate(5 + k)


def test_acceptance_follows_recent_verifications():
    a = Acceptance()
    for _ in range(30):
        a.update(8, 8)
    assert a.rate > 0.95
    for _ in range(20):
        a.update(8, 0)
    assert a.rate < 0.2


def test_unfed_proposals_are_scored_against_the_reply():
    """With drafting too dear, a proposal is checked against the tokens sampled next, so a
    reply that starts to repeat raises the estimate until drafting pays."""
    d = SequenceDrafts(SpeculativeSettings(ngram=True, size_n=2, size_m=4))
    d.extend([1, 2, 3, 4, 1, 2])
    d.acceptance = Acceptance(kept=0.0, rejected=1.0)
    dear = _costs({1: 0.1, 2: 0.19, 5: 0.46})
    before = d.acceptance.rate
    assert d.propose(dear, 1, 4) == [] and d.shadow == [3, 4, 1, 2]
    rates = [before]
    for t in (3, 4, 1):
        d.sampled(t)
        rates.append(d.acceptance.rate)
    assert d.shadow == [2] and rates == sorted(rates) and rates[-1] > before
    d.sampled(9)  # a miss ends the shadow draft with a rejection
    assert d.shadow == [] and d.acceptance.rate < rates[-1]
    d.acceptance = Acceptance(kept=50.0, rejected=0.1)
    d.shadow = [5, 5]
    d.extend([1, 2])  # history 1 2 3 4 1 2 3 4 1 9 1 2
    cheap = _costs({1: 0.1, 5: 0.11})
    assert d.propose(cheap, 1, 4) == [3, 4, 1, 9] and d.shadow == []  # a fed draft replaces the shadow


def test_settings_check_their_flags():
    with pytest.raises(SettingsError, match="size-m"):
        SpeculativeSettings(ngram=True, size_m=65)  # beyond the KV ring's rollback slack
    with pytest.raises(SettingsError, match="size-n"):
        SpeculativeSettings(ngram=True, size_n=0)


def test_sequence_drafts_grow_and_count():
    d = SequenceDrafts(SpeculativeSettings(ngram=True, size_n=2, size_m=4))
    d.extend([1, 2, 3, 4] * 100)
    assert d.n_tokens == 400 and d.tokens[:8].tolist() == [1, 2, 3, 4, 1, 2, 3, 4]
    costs = _costs({1: 0.1, 8: 0.1})
    assert d.propose(costs, 1, 3) == [1, 2, 3]  # the room caps the draft
    want = Acceptance()
    want.update(3, 2)
    drawn = iter([1, 2, 9])  # the sampler draws two draft tokens back, then another
    assert d.verify([None] * 4, lambda i, row, proposed: next(drawn)) == 2
    assert d.draft == [] and d.acceptance == want and (d.n_drafted, d.n_verifications) == (3, 1)


# ---- the engine against plain decoding ---------------------------------------------------------------
class Oracle:
    """Stands in for the n-gram lookup: the reference reply's next tokens, spoiled at random."""

    def __init__(self, prompt: list[int], reply: list[int], spoil: float, seed: int) -> None:
        self.n_prompt, self.reply, self.spoil = len(prompt), reply, spoil
        self.rng = random.Random(seed)
        self.proposed = 0

    def __call__(self, history: np.ndarray, size_n: int, size_m: int, min_hits: int = 1) -> np.ndarray:
        g = len(history) - self.n_prompt  # tokens sampled so far; the last one is being fed now
        draft = list(self.reply[g : g + self.rng.randint(0, size_m)])
        for i in range(len(draft)):
            if self.rng.random() < self.spoil:
                draft[i] = (draft[i] + 1 + self.rng.randrange(50)) % 1000
        self.proposed += len(draft)
        return np.array(draft, dtype=np.int32)


def _longest_draft(rate, costs, base_tokens, max_len, max_seconds=None):
    return max_len  # every proposed token is fed: the verification is what these tests check


@pytest.fixture(scope="module")
def plain(tiny_gguf):
    return LLM(tiny_gguf, compute=ComputeSettings(threads=1))


@pytest.fixture(scope="module")
def spec(tiny_gguf):
    return LLM(tiny_gguf, compute=ComputeSettings(threads=1), speculative=SpeculativeSettings(ngram=True, size_m=24))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("spoil", [0.0, 0.15, 0.6])
def test_drafted_replies_equal_plain_decoding(plain, spec, monkeypatch, temperature, spoil):
    kw = dict(max_tokens=180, temperature=temperature, seed=11, ignore_eos=True)
    ref = plain.generate(PROMPT, **kw)
    oracle = Oracle(PROMPT, ref.token_ids, spoil, seed=int(spoil * 100))
    monkeypatch.setattr(speculative, "ngram_draft", oracle)
    monkeypatch.setattr(speculative, "best_draft_len", _longest_draft)
    got = spec.generate(PROMPT, **kw)
    assert got.token_ids == ref.token_ids and got.text == ref.text and got.finish_reason == ref.finish_reason
    t = got.timings
    assert 100 < t["draft_n"] <= oracle.proposed  # proposals are cut to the room left
    if spoil == 0.0:
        assert t["draft_n_accepted"] == t["draft_n"]
    else:
        assert 0 < t["draft_n_accepted"] < t["draft_n"]
    # The slot's cache holds exactly the prompt and the reply's fed tokens: the next turn reuses it
    # and continues as a fresh engine does.
    engine = spec._engine
    assert engine.slots[0].tokens == PROMPT + ref.token_ids[:-1]
    assert engine.slots[0].cache.length == len(PROMPT) + len(ref.token_ids) - 1
    follow = PROMPT + ref.token_ids[:150] + [7, 70, 700]
    monkeypatch.setattr(speculative, "ngram_draft", lambda *a, **k: np.zeros(0, dtype=np.int32))
    again = spec.generate(follow, max_tokens=20, temperature=0.0, ignore_eos=True)
    fresh = LLM(spec.path, compute=ComputeSettings(threads=1)).generate(follow, max_tokens=20, temperature=0.0,
                                                                         ignore_eos=True)
    assert again.timings["cache_n"] == 150 + len(PROMPT)
    assert again.token_ids == fresh.token_ids


def test_endings_inside_a_draft_match_plain_decoding(plain, spec, monkeypatch):
    ref = plain.generate(PROMPT, max_tokens=60, temperature=0.0, ignore_eos=True)
    monkeypatch.setattr(speculative, "best_draft_len", _longest_draft)
    # max_tokens reached mid-draft, and a stop string the reply writes mid-draft
    stop = plain.detokenize(ref.token_ids[30:32])
    for kw in (dict(max_tokens=37), dict(max_tokens=60, stop=[stop])):
        want = plain.generate(PROMPT, temperature=0.0, ignore_eos=True, **kw)
        monkeypatch.setattr(speculative, "ngram_draft", Oracle(PROMPT, ref.token_ids, 0.0, seed=3))
        got = spec.generate(PROMPT, temperature=0.0, ignore_eos=True, **kw)
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
        assert got.timings["draft_n_accepted"] > 0


def test_real_lookup_drafts_from_the_history(tiny_gguf, plain, monkeypatch):
    """The n-gram lookup itself (1-grams: every vocabulary id is in the prompt, so every sampled
    token has an earlier occurrence to draft from); the reply is plain decoding's."""
    monkeypatch.setattr(speculative, "best_draft_len", _longest_draft)
    llm = LLM(tiny_gguf, compute=ComputeSettings(threads=1),
              speculative=SpeculativeSettings(ngram=True, size_n=1, size_m=8))
    prompt = list(range(1000)) + PROMPT
    kw = dict(max_tokens=40, temperature=0.0, ignore_eos=True)
    got, ref = llm.generate(prompt, **kw), plain.generate(prompt, **kw)
    assert got.token_ids == ref.token_ids
    assert got.timings["draft_n"] >= 40  # 8 a step, and 40 tokens take at least 5 steps


def test_two_slots_drafting_in_one_step_match_plain_decoding(tiny_gguf, plain, monkeypatch):
    """Two sequences decode in the same steps, each with its own draft (rows of several entries
    in one forward): each reply is its plain one, and a third, prompt-processing request shares
    the steps."""
    from hybridmoe.engine.engine import Engine, GenerationRequest
    from hybridmoe.engine.sampler import SamplingParams

    prompts = [PROMPT, PROMPT[::-1] + [9, 9], list(range(200, 260))]
    params = [SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=4, max_tokens=70, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)]
    refs = [plain.generate(p, max_tokens=s.max_tokens, temperature=s.temperature, seed=s.seed, ignore_eos=True).token_ids
            for p, s in zip(prompts, params)]
    rng = random.Random(5)

    def oracle(history, size_n, size_m, min_hits=1):
        # which request: the one whose prompt starts the history
        i = next(j for j, p in enumerate(prompts) if history[: len(p)].tolist() == p)
        g = len(history) - len(prompts[i])
        draft = [t if rng.random() > 0.2 else (t + 3) % 1000 for t in refs[i][g : g + rng.randint(0, 12)]]
        return np.array(draft, dtype=np.int32)

    monkeypatch.setattr(speculative, "ngram_draft", oracle)
    monkeypatch.setattr(speculative, "best_draft_len", _longest_draft)
    llm = LLM(tiny_gguf, compute=ComputeSettings(threads=1), n_parallel=3)
    engine = Engine(llm.loaded, 3, 512, max_queue=8, speculative=SpeculativeSettings(ngram=True, size_m=12))
    handles = [engine.submit(GenerationRequest(p, s)) for p, s in zip(prompts, params)]
    while not all(h.finished for h in handles):
        engine.step()
    for h, ref in zip(handles, refs):
        events = list(h)
        assert [e.token_id for e in events if e.token_id is not None] == ref
    assert engine.metrics.n_draft_accepted_total > 50 and engine.metrics.n_drafts_total > 10
    assert engine.metrics.n_draft_accepted_total < engine.metrics.n_draft_tokens_total


def test_drafts_are_capped_only_while_other_streams_share_the_step(tiny_gguf, monkeypatch):
    from hybridmoe.engine.engine import Engine, GenerationRequest
    from hybridmoe.engine.sampler import SamplingParams

    caps: list[tuple[int, float | None]] = []

    def recorder(rate, costs, base_tokens, max_len, max_seconds=None):
        caps.append((base_tokens, max_seconds))
        return 0

    monkeypatch.setattr(speculative, "ngram_draft", lambda h, n, m, k=1: h[-3:])  # always a proposal
    monkeypatch.setattr(speculative, "best_draft_len", recorder)
    llm = LLM(tiny_gguf, compute=ComputeSettings(threads=1), n_parallel=2)
    engine = Engine(llm.loaded, 2, 256, max_queue=4, speculative=SpeculativeSettings(ngram=True))
    alone = engine.submit(GenerationRequest(PROMPT, SamplingParams(temperature=0.0, max_tokens=6)))
    while not alone.finished:
        engine.step()
    assert caps and all(cap is None for base, cap in caps if base == 1)
    caps.clear()
    both = [engine.submit(GenerationRequest(p, SamplingParams(temperature=0.0, max_tokens=6)))
            for p in (PROMPT, PROMPT[:-1])]
    while not all(h.finished for h in both):
        engine.step()
    shared = [cap for base, cap in caps if base >= 2]
    assert shared and all(cap is not None and cap > 0 for cap in shared)
