"""Token sampling as llama.cpp's chain runs it: the logit bias, then the samplers in order
(default: penalties, DRY, top-n-sigma, top-k, typical, top-p, min-p, XTC, temperature), then a
draw; temperature <= 0 keeps only the top, so a greedy pick sees the bias, penalties, DRY, typical
and XTC too. Mirostat (1 or 2) replaces the filters: temperature, then Mirostat's own draw. The
penalties and DRY count the prompt's tokens and the reply's, as llama-server feeds the prompt to
its sampler. The steps are in engine/sampler_steps.py and engine/dry.py. One `Sampler` per
request owns its RNG and history, so a seeded request gives the same tokens whatever else is
batched with it.
"""

from __future__ import annotations

import collections
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hybridmoe.engine import sampler_steps as steps
from hybridmoe.engine.dry import Breakers, Dry
from hybridmoe.settings import SAMPLER_NAMES, SAMPLER_ORDER, SAMPLING_DEFAULTS, SamplerSettings, check_sampling

# Steps that may move the top choice (so a greedy pick must run the chain).
_MOVES_TOP = ("penalties", "dry", "typ_p", "xtc")


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
    # without "temperature" the draw is at temperature 1). None: SAMPLER_ORDER.
    samplers: tuple[str, ...] | None = None
    chain: SamplerSettings = SAMPLING_DEFAULTS.samplers  # penalties, DRY, XTC, Mirostat, ...
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit; -inf bans it)

    def validate(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p, self.min_p, self.seed)
        self.chain.check()
        for token, bias in self.logit_bias:
            if token < 0 or math.isnan(bias) or bias == math.inf:
                raise ValueError(f"logit_bias: token {token} with bias {bias} (ids >= 0; a finite bias or -inf)")
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        unknown = [n for n in self.samplers or () if n not in SAMPLER_NAMES]
        if unknown:
            raise ValueError(f"unknown sampler {unknown[0]!r}; known: {', '.join(sorted(SAMPLER_NAMES))}")


@dataclass
class TokenLogprobs:
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


class Penalties:
    """llama.cpp's repetition penalties over the last `last_n` tokens (-1: all). Counts are kept
    per token id in a dense array, so a whole-context window costs a vectorized pass a token."""

    def __init__(self, c: SamplerSettings):
        self.c = c
        self.active = c.repeat_last_n != 0 and (
            c.repeat_penalty != 1.0 or c.presence_penalty != 0.0 or c.frequency_penalty != 0.0)
        self.window: collections.deque[int] = collections.deque(
            maxlen=None if c.repeat_last_n < 0 else c.repeat_last_n)
        self.counts = torch.zeros(1024, dtype=torch.int32)  # grown to the largest id seen

    def accept(self, token: int) -> None:
        if not self.active:
            return
        w = self.window
        if w.maxlen is not None and len(w) == w.maxlen:
            self.counts[w[0]] -= 1
        self._grow(token)
        w.append(token)
        self.counts[token] += 1

    def accept_all(self, tokens: list[int]) -> None:
        """The prompt at once (a bincount, not a Python step per token)."""
        if not self.active or not tokens:
            return
        assert not self.window, "the prompt comes first"
        tail = tokens if self.window.maxlen is None else tokens[-self.window.maxlen:]
        self._grow(max(tail))
        self.counts += torch.bincount(torch.tensor(tail), minlength=len(self.counts)).to(torch.int32)
        self.window.extend(tail)

    def _grow(self, token: int) -> None:
        if token >= len(self.counts):
            grown = torch.zeros(max(2 * len(self.counts), token + 1), dtype=torch.int32)
            grown[: len(self.counts)] = self.counts
            self.counts = grown

    def apply(self, cands: steps.Candidates) -> None:
        """A repeated token's logit divided by repeat_penalty (multiplied when <= 0), minus count x
        frequency_penalty and presence_penalty."""
        if not self.active or not self.window:
            return
        c = self.c
        ids = torch.nonzero(self.counts).flatten()
        pos, found = cands.positions(ids)
        counts = self.counts[ids[found]].to(torch.float32)
        v = cands.logits[pos]
        v = torch.where(v <= 0, v * c.repeat_penalty, v / c.repeat_penalty)
        cands.logits = cands.logits.clone()
        cands.logits[pos] = v - (counts * c.frequency_penalty + c.presence_penalty)


class Sampler:
    """`history`: the prompt's tokens (the penalties' and DRY's windows start there); `accept`
    each token the reply adds. `banned`: ids never drawn (with `ignore_eos` the runner bans the
    end-of-generation tokens, as llama-server does, so the reply goes on as text). `breakers`:
    DRY's sequence breakers as tokens (engine.dry.breakers_for), needed when DRY is on."""

    def __init__(self, params: SamplingParams, history: Iterable[int] = (), banned: Iterable[int] = (),
                 breakers: Breakers | None = None):
        params.validate()
        self.params = params
        c = params.chain
        seed = params.seed if params.seed is not None and params.seed >= 0 else random.randrange(2**63)
        self.generator = torch.Generator().manual_seed(seed)
        self._order = params.samplers if params.samplers is not None else SAMPLER_ORDER
        self._penalties = Penalties(c)
        self._penalties.active = self._penalties.active and "penalties" in self._order and not c.mirostat
        self._dry = Dry(c.dry_multiplier, c.dry_base, c.dry_allowed_length, c.dry_penalty_last_n, breakers or {})
        self._dry.active = self._dry.active and "dry" in self._order and not c.mirostat
        if self._penalties.active or self._dry.active:  # each keeps only its window's tail
            prompt = list(history)
            self._penalties.accept_all(prompt)
            self._dry.accept_all(prompt)
        self._mu = 2.0 * c.mirostat_tau
        # adaptive-p: the final draw when listed; a running average of the chosen tokens' probabilities
        self._adaptive = "adaptive_p" in self._order and not c.mirostat and c.adaptive_target >= 0
        self._ap_sum = c.adaptive_target / (1.0 - c.adaptive_decay)
        self._ap_weight = 1.0 / (1.0 - c.adaptive_decay)
        self._ap_pending: tuple[int, float] | None = None  # (drawn id, its probability before the transform)
        self._last: steps.Candidates | None = None  # what the last draw chose from (post_logprobs)
        self._bias = None
        bias = params.logit_bias + tuple((t, -math.inf) for t in banned)
        if bias:
            ids, vals = zip(*bias)
            self._bias = (torch.tensor(ids, dtype=torch.int64), torch.tensor(vals, dtype=torch.float32))
        moving = {"penalties": self._penalties.active, "dry": self._dry.active, "typ_p": c.typical_p < 1.0,
                  "xtc": c.xtc_probability > 0.0 and c.xtc_threshold <= 0.5}
        # A greedy pick needs the chain only when a step may move the top choice.
        self._greedy_plain = not c.mirostat and not any(moving[s] for s in _MOVES_TOP if s in self._order)

    def accept(self, token: int) -> None:
        """One more token of the text (prompt or reply) for the penalties' and DRY's windows (and
        adaptive-p's average, when it drew this token)."""
        self._penalties.accept(token)
        self._dry.accept(token)
        if self._ap_pending is not None:
            drawn, p = self._ap_pending
            if drawn == token:
                d = self.params.chain.adaptive_decay
                self._ap_sum, self._ap_weight = p + d * self._ap_sum, 1.0 + d * self._ap_weight
            self._ap_pending = None

    def _biased(self, logits: torch.Tensor) -> torch.Tensor:
        """float32 CPU logits plus the logit bias (ids past the vocabulary are ignored)."""
        x = logits.float().cpu()
        if self._bias is not None:
            ids, vals = self._bias
            keep = ids < x.numel()
            x = x.clone()
            x.index_add_(0, ids[keep], vals[keep])  # -inf bans (a sum of biases for a repeated id)
        return x

    def _chain(self, logits: torch.Tensor) -> steps.Candidates:
        """The candidates left after the bias and the samplers in order (Mirostat: temperature)."""
        p, c = self.params, self.params.chain
        cands = steps.Candidates.of(self._biased(logits))
        if not len(cands):
            raise ValueError("no token can come next: the logit bias (or the model) leaves every one at -inf")
        if c.mirostat:
            steps.temperature(cands, p.temperature)
            return cands
        for name in self._order:
            if name == "penalties":
                self._penalties.apply(cands)
            elif name == "dry":
                self._apply_dry(cands)
            elif name == "top_n_sigma":
                steps.top_n_sigma(cands, c.top_n_sigma)
            elif name == "top_k":
                steps.top_k(cands, p.top_k)
            elif name == "typ_p":
                steps.typical(cands, c.typical_p, c.min_keep)
            elif name == "top_p":
                steps.top_p(cands, p.top_p, c.min_keep)
            elif name == "min_p":
                steps.min_p(cands, p.min_p, c.min_keep)
            elif name == "xtc":
                steps.xtc(cands, c.xtc_probability, c.xtc_threshold, c.min_keep, self.generator)
            elif name == "temperature":
                steps.temperature(cands, p.temperature, c.dynatemp_range, c.dynatemp_exponent)
        if not len(cands):  # settings that leave nothing (e.g. overflowing logits): this request fails alone
            raise ValueError("the sampler settings leave no token to draw from")
        return cands

    def _apply_dry(self, cands: steps.Candidates) -> None:
        loss = self._dry.penalties() if self._dry.active else {}
        if loss:
            ids = torch.tensor(sorted(loss), dtype=torch.int64)
            pos, found = cands.positions(ids)
            cands.logits = cands.logits.clone()
            cands.logits[pos] -= torch.tensor([loss[i] for i in ids[found].tolist()], dtype=torch.float32)

    def filtered_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The vocabulary's logits after the bias and the samplers (what they drop at -inf)."""
        return self._chain(logits).full(logits.numel())

    def sample(self, logits: torch.Tensor, constraint: Any = None) -> int:
        """One token; with a `constraint` (engine.constraints.GrammarConstraint), one it allows:
        the tokens it forbids are masked out first, then the chain and draw run on what is left
        (greedy: the most likely allowed token). ValueError if nothing is allowed."""
        allowed = constraint.mask() if constraint is not None else None  # None: nothing constrained now
        if allowed is not None:
            logits = _masked(logits, allowed)
        greedy = self.params.temperature <= 0.0
        if greedy and self._greedy_plain:
            x = self._biased(logits)
            if self._bias is not None and bool(torch.isneginf(x).all()):
                raise ValueError("no token can come next: the logit bias (or the model) leaves every one at -inf")
            top = int(torch.argmax(x))
            self._last = steps.Candidates(torch.tensor([top]), torch.zeros(1))  # the chain keeps the top only
            return top
        cands = self._last = self._chain(logits)
        if self.params.chain.mirostat:
            return self._mirostat(cands, logits.numel())
        if greedy:
            return int(cands.ids[int(torch.argmax(cands.logits))])
        if self._adaptive:
            return self._adaptive_p(cands)
        return steps.draw(cands, self.generator)

    # adaptive-p's transform: quadratic near the target, linear in the tails (llama.cpp's constants)
    _AP_WIDTH, _AP_PEAK, _AP_SHARPNESS = 0.3, 5.0, 10.0

    def _adaptive_p(self, cands: steps.Candidates) -> int:
        """adaptive-p's draw: each candidate's logit becomes peak - s d^2 / (1 + d), d = |p -
        target'| / width, target' = 2 target - (running average of the chosen tokens'
        probabilities) clamped to [0, 1], so the choices average the target."""
        c = self.params.chain
        probs = cands.probs()
        target = min(max(c.adaptive_target, 0.0), 1.0)
        adapted = min(max(2.0 * target - self._ap_sum / self._ap_weight, 0.0), 1.0)
        d = (probs - adapted).abs() / self._AP_WIDTH
        logits = self._AP_PEAK - self._AP_SHARPNESS * d * d / (1.0 + d)
        cands.logits = torch.where(torch.isneginf(cands.logits), cands.logits, logits.to(torch.float32))
        self._last = cands
        idx = steps.pick(cands.probs(), self.generator) if len(cands) > 1 else 0
        token = int(cands.ids[idx])
        self._ap_pending = (token, float(probs[idx]))
        return token

    def post_logprobs(self, token: int, k: int) -> TokenLogprobs:
        """Log-probabilities in the distribution the last draw saw (after the chain, as
        llama-server's post_sampling_probs): the chosen token's and the k most likely."""
        c = self._last
        assert c is not None, "sample() first"
        lp = torch.log_softmax(c.logits, dim=-1)
        hit = torch.nonzero(c.ids == token).flatten()
        chosen = float(lp[int(hit[0])]) if hit.numel() else -math.inf
        vals, idx = torch.topk(lp, min(k, len(c)))
        return TokenLogprobs(token, chosen, [(int(c.ids[i]), float(v)) for i, v in zip(idx, vals)])

    def _mirostat(self, cands: steps.Candidates, n_vocab: int) -> int:
        """Mirostat's draw (1: a top-k whose k follows the estimated Zipf exponent; 2: tokens whose
        surprise is at most mu), then mu moves toward the target surprise tau."""
        c = self.params.chain
        cands.sorted()
        probs = cands.probs()
        if c.mirostat == 1:
            m = min(100, len(cands)) - 1
            if m > 0:
                i = torch.arange(m, dtype=torch.float32)
                t = torch.log((i + 2) / (i + 1))
                b = torch.log(probs[:m] / probs[1 : m + 1])
                with np.errstate(all="ignore"):  # a flat or degenerate head: nan/inf, all kept
                    s_hat = np.float64((t * b).sum() / (t * t).sum())
                    eps = s_hat - 1
                    k = ((eps * np.exp2(np.float64(self._mu))) / (1 - np.float64(n_vocab) ** (-eps))) ** (1 / s_hat)
                steps.top_k(cands, max(int(k), 1) if np.isfinite(k) else len(cands))
        else:
            keep = int((-torch.log2(probs) <= self._mu).to(torch.int64).cumprod(0).sum())
            cands.keep(torch.arange(len(cands)) < max(keep, 1))
        probs = cands.probs()
        self._last = cands
        idx = steps.pick(probs, self.generator) if len(cands) > 1 else 0
        self._mu -= c.mirostat_eta * (-math.log2(float(probs[idx])) - c.mirostat_tau)
        return int(cands.ids[idx])

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
