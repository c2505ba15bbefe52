"""Token sampling: logit bias, repetition penalties, top-k, top-p, min-p, temperature; greedy or a
seeded draw, reproducible.

The logit bias comes first, then the filters in llama.cpp's default order (penalties, top-k, top-p,
min-p, temperature) on float32 logits; temperature <= 0 means greedy over the biased and
penalized logits (as llama.cpp's chain ends in a greedy pick). The penalties count the last
`repeat_last_n` tokens of prompt and reply, as llama-server feeds the prompt to its sampler. One
`Sampler` per request owns its RNG and history, so a seeded request gives the same tokens
whatever else is batched with it.
"""

from __future__ import annotations

import collections
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridmoe.settings import SAMPLING_DEFAULTS, check_penalties, check_sampling

DEFAULT_ORDER = ("penalties", "top_k", "top_p", "min_p", "temperature")
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
    # Penalties on the tokens among the last repeat_last_n (-1: all, 0: none): llama.cpp's rule.
    repeat_penalty: float = SAMPLING_DEFAULTS.repeat_penalty  # 1 = off
    repeat_last_n: int = SAMPLING_DEFAULTS.repeat_last_n
    presence_penalty: float = SAMPLING_DEFAULTS.presence_penalty  # 0 = off
    frequency_penalty: float = SAMPLING_DEFAULTS.frequency_penalty  # 0 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit; -inf bans it)

    def validate(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p, self.min_p, self.seed)
        check_penalties(self.repeat_penalty, self.repeat_last_n, self.presence_penalty, self.frequency_penalty)
        for token, bias in self.logit_bias:
            if token < 0 or math.isnan(bias) or bias == math.inf:
                raise ValueError(f"logit_bias: token {token} with bias {bias} (ids >= 0; a finite bias or -inf)")
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
    """`history`: the prompt's tokens (the penalties' window starts there); `accept` each token
    the reply adds. `banned`: ids never drawn (with `ignore_eos` the runner bans the end-of-
    generation tokens, as llama-server does, so the reply goes on as text)."""

    def __init__(self, params: SamplingParams, history: Iterable[int] = (), banned: Iterable[int] = ()):
        params.validate()
        self.params = params
        seed = params.seed if params.seed is not None and params.seed >= 0 else random.randrange(2**63)
        self.generator = torch.Generator().manual_seed(seed)
        self._order = params.samplers if params.samplers is not None else DEFAULT_ORDER
        p = params
        self._penalize = "penalties" in self._order and p.repeat_last_n != 0 and (
            p.repeat_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0)
        self._window: collections.deque[int] = collections.deque(
            maxlen=None if p.repeat_last_n < 0 else p.repeat_last_n)
        self._counts: collections.Counter[int] = collections.Counter()
        if self._penalize:
            for t in history:
                self.accept(t)
        self._bias = None
        bias = p.logit_bias + tuple((t, -math.inf) for t in banned)
        if bias:
            ids, vals = zip(*bias)
            self._bias = (torch.tensor(ids, dtype=torch.int64), torch.tensor(vals, dtype=torch.float32))

    def accept(self, token: int) -> None:
        """One more token of the text (prompt or reply) for the penalties' window."""
        if not self._penalize:
            return
        w = self._window
        if w.maxlen is not None and len(w) == w.maxlen:
            old = w[0]
            self._counts[old] -= 1
            if not self._counts[old]:
                del self._counts[old]
        w.append(token)
        self._counts[token] += 1

    def _biased(self, logits: torch.Tensor) -> torch.Tensor:
        """float32 CPU logits plus the logit bias (ids past the vocabulary are ignored); a copy."""
        x = logits.float().cpu().clone()
        if self._bias is not None:
            ids, vals = self._bias
            keep = ids < x.numel()
            x.index_add_(0, ids[keep], vals[keep])  # -inf bans (a sum of biases for a repeated id)
        return x

    def _penalized(self, x: torch.Tensor) -> torch.Tensor:
        """llama.cpp's penalties, in place: a repeated token's logit divided by repeat_penalty
        (multiplied when <= 0), minus count x frequency_penalty and presence_penalty."""
        if not self._penalize or not self._counts:
            return x
        p = self.params
        ids = torch.tensor(list(self._counts), dtype=torch.int64)
        counts = torch.tensor(list(self._counts.values()), dtype=torch.float32)
        keep = ids < x.numel()
        ids, counts = ids[keep], counts[keep]
        v = x[ids]
        v = torch.where(v <= 0, v * p.repeat_penalty, v / p.repeat_penalty)
        x[ids] = v - (counts * p.frequency_penalty + p.presence_penalty)
        return x

    def filtered_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits biased, then the samplers in order: penalties, top-k / top-p / min-p (what they
        drop at -inf), temperature."""
        p = self.params
        x = self._biased(logits)
        for name in self._order:
            if name == "penalties":
                x = self._penalized(x)
            elif name == "top_k" and 0 < p.top_k < x.numel():
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
            if self._bias is None and not self._penalize:
                return int(torch.argmax(logits))
            return int(torch.argmax(_check_some_left(self._penalized(self._biased(logits)))))
        probs = torch.softmax(_check_some_left(self.filtered_logits(logits)), dim=-1)
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


def _check_some_left(x: torch.Tensor) -> torch.Tensor:
    if bool(torch.isneginf(x).all()):
        raise ValueError("logit_bias bans every token that may come next")
    return x


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
