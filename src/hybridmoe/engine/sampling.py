"""Token sampling: greedy, temperature, top-k, top-p, min-p; seeded and reproducible.

Filters run in llama.cpp's default order (top-k, top-p, min-p, then temperature) on float32
logits; temperature <= 0 means greedy. One `Sampler` per request owns its RNG, so a seeded
request gives the same tokens whatever else is batched with it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridmoe.settings import SAMPLING_DEFAULTS, check_sampling

DEFAULT_ORDER = ("top_k", "top_p", "min_p", "temperature")
# llama.cpp's other samplers are identities at their neutral settings, the only ones served here.
KNOWN_SAMPLERS = frozenset(DEFAULT_ORDER) | {"penalties", "dry", "top_n_sigma", "typ_p", "typical_p", "xtc",
                                             "infill", "adaptive_p"}


@dataclass
class SamplingParams:
    """One request's sampling; fields left out take the defaults (settings.SAMPLING_DEFAULTS)."""

    temperature: float = SAMPLING_DEFAULTS.temperature
    top_k: int = SAMPLING_DEFAULTS.top_k  # 0 = off
    top_p: float = SAMPLING_DEFAULTS.top_p
    min_p: float = SAMPLING_DEFAULTS.min_p
    seed: int | None = SAMPLING_DEFAULTS.request_seed  # None or < 0: random
    max_tokens: int = 256  # the engine's budget, resolved from n_predict and the room left
    ignore_eos: bool = False
    # llama-server's `samplers`: the filters applied, in order (a filter left out is not applied;
    # without "temperature" the draw is at temperature 1). None: DEFAULT_ORDER.
    samplers: tuple[str, ...] | None = None

    def validate(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p, self.min_p, self.seed)
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        unknown = [n for n in self.samplers or () if n not in KNOWN_SAMPLERS]
        if unknown:
            raise ValueError(f"unknown sampler {unknown[0]!r}; known: {', '.join(sorted(KNOWN_SAMPLERS))}")


@dataclass
class TokenLogprobs:
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


class Sampler:
    def __init__(self, params: SamplingParams):
        params.validate()
        self.params = params
        seed = params.seed if params.seed is not None and params.seed >= 0 else random.randrange(2**63)
        self.generator = torch.Generator().manual_seed(seed)

    def filtered_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits with everything outside top-k / top-p / min-p set to -inf, then tempered."""
        p = self.params
        x = logits.float().cpu().clone()
        for name in p.samplers if p.samplers is not None else DEFAULT_ORDER:
            if name == "top_k" and 0 < p.top_k < x.numel():
                kth = torch.topk(x, p.top_k).values[-1]
                x[x < kth] = float("-inf")
            elif name == "top_p" and p.top_p < 1.0:
                sorted_x, order = torch.sort(x, descending=True)
                probs = torch.softmax(sorted_x, dim=-1)
                cum = torch.cumsum(probs, dim=-1)
                # Keep the smallest prefix whose mass reaches top_p (always at least one token).
                drop = (cum - probs) >= p.top_p
                x[order[drop]] = float("-inf")
            elif name == "min_p" and p.min_p > 0.0:
                probs = torch.softmax(x, dim=-1)
                x[probs < p.min_p * probs.max()] = float("-inf")
            elif name == "temperature" and p.temperature > 0.0:
                x = x / p.temperature
        return x

    def sample(self, logits: torch.Tensor, constraint: Any = None) -> int:
        """One token; with a `constraint` (engine.constraints.GrammarConstraint), one it allows:
        the tokens it forbids are masked out first, then the usual filters and draw run on what
        is left (greedy: the most likely allowed token). ValueError if nothing is allowed."""
        allowed = constraint.mask() if constraint is not None else None  # None: nothing constrained now
        if allowed is not None:
            logits = _masked(logits, allowed)
        if self.params.temperature <= 0.0:
            return int(torch.argmax(logits))
        probs = torch.softmax(self.filtered_logits(logits), dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))

    @staticmethod
    def logprobs(logits: torch.Tensor, token: int, k: int) -> TokenLogprobs:
        """Log-probabilities under the model's raw distribution (as OpenAI reports them)."""
        lp = torch.log_softmax(logits.float().cpu(), dim=-1)
        top: list[tuple[int, float]] = []
        if k > 0:
            vals, idx = torch.topk(lp, min(k, lp.numel()))
            top = [(int(i), float(v)) for i, v in zip(idx, vals)]
        return TokenLogprobs(token, float(lp[token]), top)


def _masked(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """float32 CPU logits with every token outside `allowed` (bool, one per vocabulary id; ids
    past its end are not allowed) at -inf. An allowed token the model rates -inf is raised to the
    lowest finite value, so a draw can still land on it when nothing else is allowed."""
    x = logits.float().cpu()
    n = min(x.numel(), allowed.numel())
    ok = torch.zeros(x.numel(), dtype=torch.bool)
    ok[:n] = allowed[:n]
    if not bool(ok.any()):
        raise ValueError("no token of the vocabulary is allowed here")
    x = torch.nan_to_num(x, nan=float("-inf"), neginf=torch.finfo(torch.float32).min)
    return x.masked_fill(~ok, float("-inf"))
