from __future__ import annotations

import pytest
import torch

from hybridmoe.engine.sampling import Sampler, SamplingParams


def _logits(seed=0, n=100):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    x = _logits()
    assert Sampler(SamplingParams(temperature=0)).sample(x) == int(x.argmax())


def test_same_seed_same_tokens_different_seed_differs():
    x = _logits()
    a = [Sampler(SamplingParams(seed=5)).sample(x) for _ in range(1)]
    s1, s2, s3 = (Sampler(SamplingParams(seed=s, temperature=1.5)) for s in (5, 5, 6))
    seq1 = [s1.sample(x) for _ in range(50)]
    seq2 = [s2.sample(x) for _ in range(50)]
    seq3 = [s3.sample(x) for _ in range(50)]
    assert seq1 == seq2 and seq1 != seq3 and a


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
    x = torch.log(torch.tensor([0.6, 0.3, 0.06, 0.04]))
    f = Sampler(SamplingParams(min_p=0.1, temperature=1.0)).filtered_logits(x)
    assert torch.isfinite(f[:2]).all() and torch.isinf(f[2:]).all()


def test_sampling_frequencies_follow_temperature():
    x = torch.log(torch.tensor([0.7, 0.2, 0.1]))
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0))
    counts = torch.bincount(torch.tensor([s.sample(x) for _ in range(4000)]), minlength=3).float() / 4000
    assert torch.allclose(counts, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0.0), dict(min_p=2.0), dict(max_tokens=0), dict(top_k=-1)])
def test_invalid_params_raise(bad):
    with pytest.raises(ValueError):
        Sampler(SamplingParams(**bad))


def test_logprobs_are_normalised():
    x = _logits(2)
    lp = Sampler.logprobs(x, 3, 5)
    assert len(lp.top) == 5 and lp.top[0][1] >= lp.top[-1][1]
    assert abs(sum(torch.exp(torch.log_softmax(x, -1))).item() - 1) < 1e-5
    assert lp.logprob == pytest.approx(float(torch.log_softmax(x, -1)[3]))
