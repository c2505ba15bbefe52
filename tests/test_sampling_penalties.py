"""Repetition penalties and logit bias in the sampler, against a slow per-token copy of
llama.cpp's rule (llama_sampler_penalties: divide a repeated token's positive logit by
repeat_penalty, multiply a non-positive one, then subtract count x frequency + presence) on fresh
random logits and histories."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from hybridmoe.engine.sampling import Sampler, SamplingParams


def reference(logits: torch.Tensor, window: list[int], p: SamplingParams) -> torch.Tensor:
    x = logits.clone()
    for t, b in p.logit_bias:
        x[t] = x[t] + b
    for t, c in Counter(window).items():
        v = float(x[t])
        v = v * p.repeat_penalty if v <= 0 else v / p.repeat_penalty
        x[t] = v - (c * p.frequency_penalty + p.presence_penalty)
    return x


@pytest.mark.parametrize("seed", range(6))
def test_penalties_match_the_reference(seed):
    rng = random.Random(seed)
    n = 300
    logits = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 4
    prompt = [rng.randrange(40) for _ in range(rng.randrange(0, 90))]
    reply = [rng.randrange(60) for _ in range(rng.randrange(0, 40))]
    last_n = rng.choice([-1, 0, 1, 7, 64])
    p = SamplingParams(temperature=1.0, samplers=("penalties",), repeat_last_n=last_n,
                       repeat_penalty=rng.choice([1.0, 1.1, 1.7, 0.8]), presence_penalty=rng.uniform(-1, 2),
                       frequency_penalty=rng.uniform(-0.5, 1.5),
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
    p = SamplingParams(temperature=0, repeat_last_n=2, presence_penalty=2.0)
    s = Sampler(p, history=[3, 1])
    assert s.sample(x) == 4  # 3 is in the window: 5 - 2 < 4
    s.accept(1)  # the window is now [1, 1]: 3 has left it
    assert s.sample(x) == 3
    assert Sampler(SamplingParams(temperature=0, presence_penalty=2.0, samplers=("top_k",)),
                   history=[3]).sample(x) == 3  # samplers without "penalties": none applied


def test_repeat_penalty_scales_by_sign():
    x = torch.tensor([2.0, -2.0, 1.0])
    s = Sampler(SamplingParams(temperature=1.0, samplers=("penalties",), repeat_penalty=2.0), history=[0, 1])
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
    with pytest.raises(ValueError, match="logit_bias bans every token"):
        s.sample(x, Only())
    s = Sampler(SamplingParams(temperature=0, logit_bias=((2, -math.inf),)))
    assert s.sample(x, Only()) == 5


@pytest.mark.parametrize("bad", [
    {"repeat_penalty": 0.0}, {"repeat_penalty": -1.0}, {"repeat_penalty": math.inf}, {"repeat_last_n": -2},
    {"presence_penalty": math.nan}, {"frequency_penalty": math.inf}, {"logit_bias": ((-1, 1.0),)},
    {"logit_bias": ((3, math.nan),)}, {"logit_bias": ((3, math.inf),)},
])
def test_invalid_penalties_and_bias_raise(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad).validate()
