"""llama.cpp's sampler chain (logit bias, penalties, DRY, top-n-sigma, typical, XTC, dynamic
temperature, Mirostat), each step against a slow reference written from its rule (the module
docstrings restate them) on fresh random logits and histories."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from hybridmoe.engine.sampler import Sampler, SamplingParams
from hybridmoe.settings import SamplerSettings


def reference(logits: torch.Tensor, window: list[int], p: SamplingParams) -> torch.Tensor:
    x, c = logits.clone(), p.chain
    for t, b in p.logit_bias:
        x[t] = x[t] + b
    for t, n in Counter(window).items():
        v = float(x[t])
        v = v * c.repeat_penalty if v <= 0 else v / c.repeat_penalty
        x[t] = v - (n * c.frequency_penalty + c.presence_penalty)
    return x


@pytest.mark.parametrize("seed", range(6))
def test_penalties_match_the_reference(seed):
    rng = random.Random(seed)
    n = 300
    logits = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 4
    prompt = [rng.randrange(40) for _ in range(rng.randrange(0, 90))]
    reply = [rng.randrange(60) for _ in range(rng.randrange(0, 40))]
    last_n = rng.choice([-1, 0, 1, 7, 64])
    chain = SamplerSettings(repeat_last_n=last_n, repeat_penalty=rng.choice([1.0, 1.1, 1.7, 0.8]),
                            presence_penalty=rng.uniform(-1, 2), frequency_penalty=rng.uniform(-0.5, 1.5))
    p = SamplingParams(temperature=1.0, samplers=("penalties",), chain=chain,
                       logit_bias=tuple((rng.randrange(n), rng.uniform(-5, 5)) for _ in range(rng.randrange(4))))
    s = Sampler(p, history=prompt)
    for t in reply:
        s.accept(t)
    text = prompt + reply
    window = [] if last_n == 0 else text if last_n < 0 else text[-last_n:]
    got, want = s.filtered_logits(logits), reference(logits, window, p)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_greedy_takes_the_penalized_argmax_and_the_window_forgets():
    x = torch.zeros(10)
    x[3], x[4] = 5.0, 4.0
    p = SamplingParams(temperature=0, chain=SamplerSettings(repeat_last_n=2, presence_penalty=2.0))
    s = Sampler(p, history=[3, 1])
    assert s.sample(x) == 4  # 3 is in the window: 5 - 2 < 4
    s.accept(1)  # the window is now [1, 1]: 3 has left it
    assert s.sample(x) == 3
    assert Sampler(SamplingParams(temperature=0, chain=SamplerSettings(presence_penalty=2.0), samplers=("top_k",)),
                   history=[3]).sample(x) == 3  # samplers without "penalties": none applied


def test_repeat_penalty_scales_by_sign():
    x = torch.tensor([2.0, -2.0, 1.0])
    s = Sampler(SamplingParams(temperature=1.0, samplers=("penalties",), chain=SamplerSettings(repeat_penalty=2.0)),
                history=[0, 1])
    assert s.filtered_logits(x).tolist() == [1.0, -4.0, 1.0]


def test_logit_bias_bans_and_boosts():
    x = torch.randn(50, generator=torch.Generator().manual_seed(3))
    top = int(x.argmax())
    banned = Sampler(SamplingParams(temperature=0, logit_bias=((top, -math.inf),)))
    assert banned.sample(x) != top
    warm = Sampler(SamplingParams(temperature=2.0, seed=1, logit_bias=((top, -math.inf),)), history=[])
    assert top not in {warm.sample(x) for _ in range(300)}
    low = int(x.argmin())
    assert Sampler(SamplingParams(temperature=0, logit_bias=((low, 100.0),))).sample(x) == low
    assert float(x[top]) == float(x.max())  # the caller's logits are left alone


def test_banned_ids_are_never_drawn():
    x = torch.randn(30, generator=torch.Generator().manual_seed(4))
    top = int(x.argmax())
    assert Sampler(SamplingParams(temperature=0), banned=[top]).sample(x) != top
    s = Sampler(SamplingParams(temperature=3.0, seed=2, top_k=0, top_p=1.0, min_p=0.0), banned=[top, 0, 1])
    assert not {s.sample(x) for _ in range(400)} & {top, 0, 1}


def test_a_bias_that_bans_everything_allowed_is_an_error():
    x = torch.randn(20)
    allowed = torch.zeros(20, dtype=torch.bool)
    allowed[[2, 5]] = True

    class Only:
        def mask(self):
            return allowed

    s = Sampler(SamplingParams(temperature=0, logit_bias=((2, -math.inf), (5, -math.inf))))
    with pytest.raises(ValueError, match="no token can come next"):
        s.sample(x, Only())
    s = Sampler(SamplingParams(temperature=0, logit_bias=((2, -math.inf),)))
    assert s.sample(x, Only()) == 5


@pytest.mark.parametrize("bad", [
    {"repeat_penalty": 0.0}, {"repeat_penalty": -1.0}, {"repeat_penalty": math.inf}, {"repeat_last_n": -2},
    {"presence_penalty": math.nan}, {"frequency_penalty": math.inf}, {"dry_penalty_last_n": -3},
    {"mirostat": 3}, {"min_keep": -1}, {"dynatemp_range": -0.5}, {"xtc_probability": math.nan},
])
def test_invalid_settings_raise(bad):
    with pytest.raises(ValueError):
        SamplingParams(chain=SamplerSettings(**bad)).validate()


@pytest.mark.parametrize("bias", [((-1, 1.0),), ((3, math.nan),), ((3, math.inf),)])
def test_invalid_bias_raises(bias):
    with pytest.raises(ValueError):
        SamplingParams(logit_bias=bias).validate()


# ------------------------------------------------------------------------------------------ DRY
def dry_reference(t: list[int], mult: float, base: float, allowed: int, breakers: dict) -> dict[int, float]:
    """Naive DRY: the limit from the latest breaker, then each earlier end position's match length."""
    n = len(t)
    if n <= allowed:
        return {}
    limit = n
    for i in range(n):
        head = t[n - 1 - i]
        best = -1
        for tail in breakers.get(head, []):
            if best < len(tail) <= i and all(tail[o] == t[n - i + o] for o in range(len(tail))):
                best = len(tail)
        if best >= 0:
            limit = i - best
            break
    if limit < allowed:
        return {}
    worst: dict[int, int] = {}
    for j in range(n - 1):
        m = 0
        while m <= j and m < limit and t[j - m] == t[n - 1 - m]:
            m += 1
        if m >= allowed:
            worst[t[j + 1]] = max(worst.get(t[j + 1], 0), m)
    cap = int(88.7228391 / math.log(base)) if base > 1.000001 else 0
    return {tok: mult * base ** (min(m - allowed, cap) if cap else m - allowed)
            for tok, m in worst.items() if () not in breakers.get(tok, [])}


@pytest.mark.parametrize("seed", range(12))
def test_dry_matches_the_reference(seed):
    from hybridmoe.engine.dry import Dry

    rng = random.Random(seed)
    breakers = {5: [()], 4: [(2, 3)]} if seed % 2 else {}
    t = [rng.randrange(6 if seed % 2 else 3) for _ in range(rng.randrange(2, 120))]
    last_n = rng.choice([-1, 16, 50])
    allowed = rng.choice([0, 1, 2, 3])
    d = Dry(0.8, 1.75, allowed, last_n, breakers)
    every = rng.choice([1, 3, len(t)])  # the breaker search is incremental: ask at several paces
    for i, x in enumerate(t, 1):
        d.accept(x)
        if i % every and i != len(t):
            continue
        window = t[:i] if last_n < 0 else t[:i][-last_n:]
        want = dry_reference(window, 0.8, 1.75, allowed, breakers)
        got = d.penalties()
        assert got.keys() == want.keys() and all(math.isclose(got[k], want[k], rel_tol=1e-12) for k in got), (
            i, got, want)


def test_dry_breakers_from_token_texts():
    from hybridmoe.engine.dry import breakers_for

    pieces = ["a", "b\n", "x:", "ab", "c", "d*", "e"]
    encode = {"b": [1], "": []}.get
    got = breakers_for(["\n", ":", "*", "ab"], pieces, lambda text: encode(text, [99]))
    assert got[1] == [()] and got[2] == [()] and got[5] == [()]  # a whole breaker inside the token
    assert got[3] == [()] and got[0] == [(1,)]  # "a" starts "ab": the rest, "b", must follow
    assert 4 not in got and 6 not in got


def test_dry_penalizes_the_token_that_extends_a_repeat():
    from hybridmoe.engine.dry import Dry

    text = [1, 2, 3, 4, 9, 1, 2, 3]  # "1 2 3" again: 4 would extend the repeat to 4 tokens
    x = torch.zeros(10)
    chain = SamplerSettings(dry_multiplier=1.0, dry_base=2.0, dry_allowed_length=2)
    s = Sampler(SamplingParams(temperature=1.0, samplers=("dry",), chain=chain), history=text)
    assert s.filtered_logits(x).tolist() == [0, 0, 0, 0, -2.0, 0, 0, 0, 0, 0]  # 1 * 2^(3 - 2)
    x[4] = 1.0
    assert Sampler(SamplingParams(temperature=0, chain=chain), history=text).sample(x) != 4  # greedy too
    assert Dry(1.0, 2.0, 2, -1, {9: [()]}).penalties() == {}
    d = Dry(1.0, 2.0, 2, -1, {3: [()]})  # a breaker at the end: no repeat reaches back across it
    for tok in text:
        d.accept(tok)
    assert d.penalties() == {}


# ------------------------------------------------------------------------------ filters and draws
def softmax64(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x.double(), dim=-1)


@pytest.mark.parametrize("seed", range(5))
def test_typical_and_top_n_sigma_match_the_reference(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(400, generator=g) * 2
    p = 0.3 + 0.6 * float(torch.rand(1, generator=g))
    probs = softmax64(x)
    ent = float(-(probs * probs.log()).sum())
    order = torch.argsort((-probs.log() - ent).abs())
    cum = torch.cumsum(probs[order], 0)
    n = int(torch.nonzero(cum > p)[0]) + 1
    want = set(order[:n].tolist())
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, samplers=("typ_p",),
                               chain=SamplerSettings(typical_p=p)))
    assert set(torch.nonzero(torch.isfinite(s.filtered_logits(x))).flatten().tolist()) == want
    k = 0.5 + 2 * float(torch.rand(1, generator=g))
    want = set(torch.nonzero(x >= x.max() - k * x.std(unbiased=False)).flatten().tolist())
    s = Sampler(SamplingParams(temperature=1.0, samplers=("top_n_sigma",), chain=SamplerSettings(top_n_sigma=k)))
    assert set(torch.nonzero(torch.isfinite(s.filtered_logits(x))).flatten().tolist()) == want


def test_xtc_drops_the_top_choices_but_the_least_likely_of_them():
    x = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]))
    chain = SamplerSettings(xtc_probability=1.0, xtc_threshold=0.12)
    f = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, samplers=("xtc",),
                               chain=chain)).filtered_logits(x)
    assert torch.isinf(f[:2]).all() and torch.isfinite(f[2:]).all()  # 0.4 and 0.3 go; 0.15 stays
    # and a greedy pick sees it: the top choice is gone
    assert Sampler(SamplingParams(temperature=0, top_k=0, top_p=1.0, min_p=0.0, chain=chain)).sample(x) == 2
    never = SamplerSettings(xtc_probability=0.0, xtc_threshold=0.12)
    assert Sampler(SamplingParams(temperature=0, chain=never)).sample(x) == 0


def test_dynamic_temperature_follows_the_entropy():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(50, generator=g)
    chain = SamplerSettings(dynatemp_range=0.5, dynatemp_exponent=1.3)
    f = Sampler(SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, samplers=("temperature",),
                               chain=chain)).filtered_logits(x)
    probs = softmax64(x)
    norm = float(-(probs * probs.log()).sum()) / math.log(50)
    t = 0.4 + 1.0 * norm**1.3
    torch.testing.assert_close(f, x / t)


@pytest.mark.parametrize("version", [1, 2])
def test_mirostat_draws_within_its_bound_and_tracks_mu(version):
    g = torch.Generator().manual_seed(version)
    tau, eta = 3.0, 0.2
    s = Sampler(SamplingParams(temperature=1.0, seed=3, chain=SamplerSettings(mirostat=version, mirostat_tau=tau,
                                                                               mirostat_eta=eta)))
    mu = 2 * tau
    for _ in range(40):
        x = torch.randn(1000, generator=g) * 3
        probs = softmax64(x)
        order = torch.argsort(probs, descending=True)
        sp = probs[order]
        if version == 2:
            k = max(int((-torch.log2(sp) <= mu).long().cumprod(0).sum()), 1)
        else:
            i = torch.arange(99, dtype=torch.float64)
            tt, b = torch.log((i + 2) / (i + 1)), torch.log(sp[:99] / sp[1:100])
            s_hat = float((tt * b).sum() / (tt * tt).sum())
            k = max(int(((s_hat - 1) * 2**mu / (1 - 1000 ** (1 - s_hat))) ** (1 / s_hat)), 1)
        allowed = order[:k].tolist()
        tok = s.sample(x)
        assert tok in allowed
        kept = probs[order[:k]]
        mu -= eta * (-math.log2(float(probs[tok] / kept.sum())) - tau)
        assert math.isclose(s._mu, mu, rel_tol=1e-4, abs_tol=1e-4)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 0.999])
def test_top_p_on_a_big_vocabulary_matches_a_full_sort(p):
    x = torch.randn(5000, generator=torch.Generator().manual_seed(11)) * 2
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=p, min_p=0.0, samplers=("top_p",)))
    probs = torch.softmax(x, dim=-1)
    order = torch.argsort(probs, descending=True)
    n = int(torch.nonzero(torch.cumsum(probs[order], 0) >= p)[0]) + 1
    assert set(torch.nonzero(torch.isfinite(s.filtered_logits(x))).flatten().tolist()) == set(order[:n].tolist())


@pytest.mark.parametrize("n", [7, 5000, 50_000, 201_088])
def test_the_draw_follows_the_probabilities_and_never_picks_an_empty_token(n):
    from hybridmoe.engine.sampler_steps import pick

    g = torch.Generator().manual_seed(n)
    hot = torch.randperm(n, generator=g)[:4]
    q = torch.zeros(n)
    q[hot] = torch.tensor([0.1, 0.2, 0.3, 0.4])
    counts = Counter(pick(q, g) for _ in range(8000))
    assert set(counts) <= set(hot.tolist())
    for i, want in zip(hot.tolist(), (0.1, 0.2, 0.3, 0.4)):
        assert abs(counts[i] / 8000 - want) < 0.025, (i, counts[i])  # > 5 standard deviations


def test_any_accepted_settings_sample_a_possible_token():
    """Random settings (edges included: zero, negative, tiny temperatures, huge min_keep, any
    order) on random logits: validate() refuses them, or every draw is a token the model allows."""
    from hybridmoe.settings.sampling_defaults import SAMPLER_NAMES

    rng = random.Random(5)
    drawn = 0
    for it in range(600):
        def r(a: float, b: float) -> float:
            return rng.choice([a, b, rng.uniform(a, b), 0.0, 1.0, -1.0])

        chain = dict(repeat_penalty=rng.choice([1.0, 0.5, 2.0, 1e-6, 100.0]),
                     repeat_last_n=rng.choice([-1, 0, 1, 64]),
                     presence_penalty=r(-5, 5), frequency_penalty=r(-5, 5), dry_multiplier=r(0, 5), dry_base=r(0.5, 3),
                     dry_allowed_length=rng.choice([0, 1, 2, 10]), dry_penalty_last_n=rng.choice([-1, 0, 5]),
                     top_n_sigma=r(-1, 5), typical_p=r(0, 1.2), xtc_probability=r(0, 1), xtc_threshold=r(0, 1),
                     min_keep=rng.choice([0, 1, 5, 100000]), dynatemp_range=abs(r(0, 3)), dynatemp_exponent=r(-3, 3),
                     mirostat=rng.choice([0, 0, 1, 2]), mirostat_tau=r(0, 10), mirostat_eta=r(0, 1))
        names = sorted(SAMPLER_NAMES)
        order = tuple(rng.sample(names, rng.randrange(len(names)))) if rng.random() < 0.3 else None
        p = SamplingParams(temperature=rng.choice([0.0, 0.5, 1.0, 5.0, 1e-6, 1e-30]), top_k=rng.choice([0, 1, 40]),
                           top_p=rng.choice([1.0, 0.5, 1e-6]), min_p=rng.choice([0.0, 0.5, 1.0]), seed=it,
                           samplers=order, chain=SamplerSettings(**chain))
        try:
            p.validate()
        except ValueError:
            continue
        n = rng.choice([2, 50, 3000])
        x = torch.randn(n) * rng.choice([0.01, 1, 100, 1e30])
        if rng.random() < 0.2:
            x[rng.randrange(n)] = float("-inf")
        if rng.random() < 0.1:
            x[:] = 0
        s = Sampler(p, history=[rng.randrange(n) for _ in range(rng.randrange(30))],
                    breakers={0: [()]} if rng.random() < .5 else {})
        for _ in range(3):
            t = s.sample(x)
            assert 0 <= t < n and float(x[t]) > float("-inf"), (t, chain, order)
            s.accept(t)
            s.post_logprobs(t, 3)
            drawn += 1
    assert drawn > 500


def _adaptive_reference(probs: torch.Tensor, target: float, avg: float) -> torch.Tensor:
    """adaptive-p's distribution, written from its rule: logits 5 - 10 d^2 / (1 + d),
    d = |p - clamp(2 target - avg, 0, 1)| / 0.3."""
    adapted = min(max(2 * min(max(target, 0.0), 1.0) - avg, 0.0), 1.0)
    out = []
    for p in probs.tolist():
        d = abs(p - adapted) / 0.3
        out.append(5.0 - 10.0 * d * d / (1.0 + d))
    return torch.log_softmax(torch.tensor(out, dtype=torch.float64), dim=-1)


@pytest.mark.parametrize("seed", range(4))
def test_adaptive_p_matches_the_reference(seed):
    """The transformed distribution the draw sees (post_logprobs) and the running average it keeps
    of the chosen tokens' original probabilities, step by step against the rule."""
    g = torch.Generator().manual_seed(seed)
    target, decay = [0.1, 0.3, 0.6, 0.9][seed], [0.0, 0.5, 0.9, 0.99][seed]
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed,
                            samplers=("temperature", "adaptive_p"),
                            chain=SamplerSettings(adaptive_target=target, adaptive_decay=decay))
    s = Sampler(params)
    total, weight = target / (1 - decay), 1 / (1 - decay)
    for _ in range(40):
        logits = torch.randn(50, generator=g) * 2
        token = s.sample(logits)
        s.accept(token)
        probs = torch.softmax(logits, dim=-1)
        ref = _adaptive_reference(probs, target, total / weight)
        got = s.post_logprobs(token, 50)
        got_full = torch.full((50,), -math.inf, dtype=torch.float64)
        for t, v in got.top:
            got_full[t] = v
        assert torch.allclose(got_full, ref, atol=1e-4), (got_full - ref).abs().max()
        total, weight = float(probs[token]) + decay * total, 1 + decay * weight


def test_adaptive_p_off_or_unlisted_is_the_plain_draw():
    logits = torch.randn(200, generator=torch.Generator().manual_seed(1)) * 3
    plain = Sampler(SamplingParams(temperature=1.0, seed=3))
    draws = [plain.sample(logits) for _ in range(30)]
    for chain, order in ((SamplerSettings(adaptive_target=-1.0), None),
                         (SamplerSettings(adaptive_target=0.5), None)):  # off, or not in the order
        params = SamplingParams(temperature=1.0, seed=3, chain=chain, samplers=order)
        s = Sampler(params)
        assert [s.sample(logits) for _ in range(30)] == draws
    with pytest.raises(ValueError, match="adaptive_decay"):
        Sampler(SamplingParams(chain=SamplerSettings(adaptive_decay=1.0)))
