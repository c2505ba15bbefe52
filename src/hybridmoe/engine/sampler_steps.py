"""llama.cpp's sampler steps on a shrinking candidate set, as its chain runs them: each step keeps
some of the candidates (ids and float32 logits) or changes their logits. Working on the survivors
only is what keeps a 200k-token vocabulary cheap: after top-k (40 by default) every later step
sees a handful of candidates (the full-vocabulary chain took 10-11 ms a token, a tenth of a 20b
decode step; bench/sampling.py). The rules are llama.cpp's (src/llama-sampler.cpp), restated in docs/sampling.md."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Candidates:
    """The tokens still in the running: ids and their logits (float32, same length)."""

    ids: torch.Tensor
    logits: torch.Tensor
    whole: bool = False  # ids are 0..n-1 in order (position = id)

    @classmethod
    def of(cls, logits: torch.Tensor) -> Candidates:
        """Every token with a finite logit (a -inf one is out from the start)."""
        keep = torch.isfinite(logits)
        if bool(keep.all()):
            return cls(torch.arange(logits.numel()), logits, whole=True)
        return cls(torch.nonzero(keep).flatten(), logits[keep])

    def __len__(self) -> int:
        return int(self.ids.numel())

    def keep(self, mask: torch.Tensor) -> None:
        self.ids, self.logits, self.whole = self.ids[mask], self.logits[mask], False

    def take(self, index: torch.Tensor) -> None:
        """The candidates at these positions, in this order."""
        self.ids, self.logits, self.whole = self.ids[index], self.logits[index], False

    def sorted(self) -> None:
        """Highest logit first (stable, so equal logits keep id order)."""
        self.take(torch.argsort(self.logits, descending=True, stable=True))

    def positions(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the given ids (sorted, distinct) sit among the candidates: (positions, which of
        `ids` were found, as a bool mask)."""
        if self.whole:
            found = ids < len(self)
            return ids[found], found
        order = torch.argsort(self.ids)
        at = torch.searchsorted(self.ids[order], ids).clamp(max=max(len(self) - 1, 0))
        found = (self.ids[order][at] == ids) if len(self) else torch.zeros(len(ids), dtype=torch.bool)
        return order[at[found]], found

    def probs(self) -> torch.Tensor:
        return torch.softmax(self.logits, dim=-1)

    def full(self, n_vocab: int) -> torch.Tensor:
        """The vocabulary's logits with everything out at -inf."""
        x = torch.full((n_vocab,), float("-inf"))
        x[self.ids] = self.logits
        return x


def top_k(c: Candidates, k: int) -> None:
    """The k most likely, most likely first."""
    if 0 < k < len(c):
        c.take(torch.topk(c.logits, k).indices)


def top_p(c: Candidates, p: float, min_keep: int) -> None:
    """The smallest head whose probability mass reaches p (at least min_keep tokens). On a big
    set the head is looked for among the 256, then 8192 most likely first (a full sort of the
    vocabulary costs more than the rest of the chain)."""
    if p >= 1.0 or len(c) <= 1:
        return
    probs = c.probs()
    for head in (256, 8192):
        if len(c) > 4 * head:
            vals, idx = torch.topk(probs, head)
            n = _mass_reached(torch.cumsum(vals, dim=-1), p, min_keep)
            if n is not None:
                c.take(idx[:n])
                return
    order = torch.argsort(probs, descending=True, stable=True)
    n = _mass_reached(torch.cumsum(probs[order], dim=-1), p, min_keep)
    c.take(order[: n if n is not None else len(c)])


def _mass_reached(cum: torch.Tensor, p: float, min_keep: int) -> int | None:
    """How many of a sorted head reach mass p, at least min_keep; None: not within this head."""
    reached = torch.nonzero(cum >= p).flatten()
    if not reached.numel():
        return None
    n = max(int(reached[0]) + 1, min_keep)
    return n if n <= cum.numel() else None


def min_p(c: Candidates, p: float, min_keep: int) -> None:
    """Tokens at least p times as likely as the most likely (at least min_keep)."""
    if p <= 0.0 or len(c) <= 1:
        return
    keep = c.logits >= c.logits.max() + math.log(p)
    if int(keep.sum()) < min_keep:
        c.sorted()
        keep = torch.arange(len(c)) < min_keep
    c.keep(keep)


def typical(c: Candidates, p: float, min_keep: int) -> None:
    """Locally typical sampling: tokens whose surprise is closest to the entropy, until their mass
    exceeds p."""
    if p >= 1.0 or len(c) <= 1:
        return
    probs = c.probs()
    logp = torch.log(probs)
    entropy = -(probs * torch.nan_to_num(logp, neginf=0.0)).sum()
    order = torch.argsort((-logp - entropy).abs(), stable=True)
    cum = torch.cumsum(probs[order], dim=-1)
    over = torch.nonzero(cum > p).flatten()
    n = len(c)
    for i in over.tolist():
        if min_keep == 0 or i >= min_keep - 1:
            n = i + 1
            break
    c.ids, c.logits = c.ids[order[:n]], c.logits[order[:n]]


def top_n_sigma(c: Candidates, n: float) -> None:
    """Tokens within n standard deviations of the top logit."""
    if n <= 0.0 or len(c) <= 1:
        return
    std = c.logits.std(unbiased=False)
    c.keep(c.logits >= c.logits.max() - n * std)


def xtc(c: Candidates, probability: float, threshold: float, min_keep: int, generator: torch.Generator) -> None:
    """Exclude top choices: with `probability`, drop every token at or above `threshold` but the
    least likely of them."""
    if probability <= 0.0 or threshold > 0.5 or len(c) < 2:
        return
    if float(torch.rand(1, generator=generator)) > probability:
        return
    c.sorted()
    above = int((c.probs() >= threshold).sum())  # sorted, so these are the head
    last = above - 1
    if last > 0 and len(c) - last >= min_keep:
        c.keep(torch.arange(len(c)) >= last)


def temperature(c: Candidates, temp: float, dyn_range: float = 0.0, exponent: float = 1.0) -> None:
    """Divide by the temperature; with dyn_range > 0 the temperature moves within temp +- range
    with the normalized entropy (dynamic temperature). A temperature <= 0 keeps only the top."""
    if dyn_range > 0.0:
        if len(c) <= 1:
            return
        lo, hi = max(0.0, temp - dyn_range), temp + dyn_range
        probs = c.probs()
        entropy = float(-(probs * torch.nan_to_num(torch.log(probs), neginf=0.0)).sum())
        with np.errstate(all="ignore"):  # 0 ** -1 is inf here, as in C (Python would raise)
            temp = float(lo + (hi - lo) * np.float64(entropy / math.log(len(c))) ** exponent)
    scaled = c.logits / temp if temp > 0.0 else None
    if scaled is None or not bool(torch.isfinite(scaled).all()):  # <= 0, or so small it overflows: the top only
        c.keep(torch.arange(len(c)) == int(torch.argmax(c.logits)))
    else:
        c.logits = scaled


def draw(c: Candidates, generator: torch.Generator) -> int:
    """One id, drawn by probability (the chain's final `dist`): the inverse of the cumulative
    distribution (float64) at a seeded uniform number; torch.multinomial is several times slower."""
    if len(c) == 1:
        return int(c.ids[0])
    return int(c.ids[pick(c.probs(), generator)])


_PICK_BLOCK = 1024


def pick(probs: torch.Tensor, generator: torch.Generator) -> int:
    """An index drawn with these probabilities (zero ones never). A big set goes in two levels,
    a block of 1024 by the blocks' sums, then an index in it: a float64 cumulative sum over the
    whole vocabulary is the slow part of a draw."""
    n = probs.numel()
    u = float(torch.rand(1, generator=generator, dtype=torch.float64))
    if n <= 8 * _PICK_BLOCK:
        return _inverse_cdf(probs, u)
    pad = (-n) % _PICK_BLOCK
    blocks = torch.nn.functional.pad(probs, (0, pad)).view(-1, _PICK_BLOCK)
    sums = blocks.sum(dim=1, dtype=torch.float64)
    cum = torch.cumsum(sums, dim=0)
    target = u * float(cum[-1])
    b = min(int(torch.searchsorted(cum, torch.tensor([target], dtype=torch.float64), right=True)), len(sums) - 1)
    while b > 0 and float(sums[b]) == 0.0:  # a rounding edge landed on an empty block: the last one with mass
        b -= 1
    below = float(cum[b - 1]) if b else 0.0
    inside = min(max((target - below) / float(sums[b]), 0.0), 1.0 - 1e-12)
    return b * _PICK_BLOCK + _inverse_cdf(blocks[b], inside)


def _inverse_cdf(probs: torch.Tensor, u: float) -> int:
    """The index where the cumulative sum passes u of the total (u in [0, 1))."""
    cum = torch.cumsum(probs, dim=0, dtype=torch.float64)
    at = torch.searchsorted(cum, torch.tensor([u * float(cum[-1])], dtype=torch.float64), right=True)
    i = min(int(at), probs.numel() - 1)
    while float(probs[i]) == 0.0 and i > 0:  # never an index without mass
        i -= 1
    return i
