from __future__ import annotations

import math

import pytest
import torch

from hybridmoe.engine.sampler import Sampler, SamplingParams


def _logits(seed=0, n=100):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    x = _logits()
    assert Sampler(SamplingParams(temperature=0)).sample(x) == int(x.argmax())


def test_same_seed_same_tokens_different_seed_differs():
    x = _logits()
    s1, s2, s3 = (Sampler(SamplingParams(seed=s, temperature=1.5)) for s in (5, 5, 6))
    seq1 = [s1.sample(x) for _ in range(50)]
    seq2 = [s2.sample(x) for _ in range(50)]
    seq3 = [s3.sample(x) for _ in range(50)]
    assert seq1 == seq2 and seq1 != seq3


def test_top_k_restricts_support():
    x = _logits(1)
    allowed = set(torch.topk(x, 3).indices.tolist())
    s = Sampler(SamplingParams(top_k=3, temperature=5.0, seed=1))
    assert {s.sample(x) for _ in range(300)} <= allowed


def test_top_p_keeps_smallest_prefix_reaching_mass():
    x = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    f = Sampler(SamplingParams(top_p=0.8, temperature=1.0)).filtered_logits(x)
    assert torch.isfinite(f[:2]).all() and torch.isinf(f[2:]).all()
    f = Sampler(SamplingParams(top_p=0.81, temperature=1.0)).filtered_logits(x)
    assert torch.isfinite(f[:3]).all() and torch.isinf(f[3])


def test_min_p_drops_tokens_below_fraction_of_max():
    x = torch.log(torch.tensor([0.6, 0.3, 0.055, 0.045]))  # 0.055 < 0.1 x 0.6, not at the edge
    f = Sampler(SamplingParams(min_p=0.1, temperature=1.0)).filtered_logits(x)
    assert torch.isfinite(f[:2]).all() and torch.isinf(f[2:]).all()


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_sampling_frequencies_follow_temperature(temperature):
    p = torch.tensor([0.7, 0.2, 0.1])
    s = Sampler(SamplingParams(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0, seed=0))
    counts = torch.bincount(torch.tensor([s.sample(torch.log(p)) for _ in range(4000)]), minlength=3).float() / 4000
    want = p ** (1 / temperature) / (p ** (1 / temperature)).sum()  # T=0.5: [.91, .07, .02]
    assert torch.allclose(counts, want, atol=0.03), (counts, want)


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0.0), dict(min_p=2.0), dict(max_tokens=0), dict(top_k=-1)])
def test_invalid_params_raise(bad):
    with pytest.raises(ValueError):
        Sampler(SamplingParams(**bad))


def test_logprobs_are_normalised():
    x = _logits(2)
    lp = Sampler.logprobs(x, 3, 5)
    ref = torch.log_softmax(x.double(), -1)
    assert [i for i, _ in lp.top] == torch.topk(x, 5).indices.tolist()
    assert [v for _, v in lp.top] == pytest.approx(ref[[i for i, _ in lp.top]].tolist(), abs=1e-5)
    assert lp.logprob == pytest.approx(float(ref[3]), abs=1e-5)
    # Log-probabilities, not logits: the whole distribution sums to 1, so the top 5 sum below it.
    assert 0 < sum(math.exp(v) for _, v in lp.top) < 1
    assert Sampler.logprobs(x + 100.0, 3, 5).logprob == pytest.approx(lp.logprob, abs=1e-4)
