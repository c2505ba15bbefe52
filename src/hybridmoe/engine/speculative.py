"""Self-speculative decoding from the sequence's own history (llama-server's `ngram-simple`).

When the last `size_n` tokens occurred earlier in the prompt or the reply, the tokens that
followed them there are proposed as a draft and fed with the sampled token in one step; each
position is then sampled as usual and the draft is kept while it agrees. Sampling every
position with the request's own sampler keeps the output what plain decoding gives (greedy or
not): a token is kept only when the sampler drew it.

How long a draft to feed is a cost question: on a few CPU cores a batch of tokens costs nearly
as much per token as single steps (the expert GEMVs are compute-bound), on a GPU or many cores
it is almost free. So the draft is cut to the length that maximises expected tokens per second,
from the step times this engine measured (`StepCosts`) and the sequence's recent acceptance
(`Acceptance`): it never drafts when drafting cannot pay.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from hybridmoe.settings.speculative import SpeculativeSettings

if TYPE_CHECKING:
    from hybridmoe.engine.scheduler import Scheduler

__all__ = ["SHARED_STEP_STRETCH", "Acceptance", "SequenceDrafts", "SpeculativeSettings", "StepCosts", "best_draft_len",
           "ngram_draft", "propose_drafts"]

# With other streams in the step, drafts may stretch it at most this much: they wait for every
# step, so one stream's long draft must not stall them (llama-server drafts regardless).
SHARED_STEP_STRETCH = 2.0


def ngram_draft(history: np.ndarray, size_n: int, size_m: int, min_hits: int = 1) -> np.ndarray:
    """The up to `size_m` tokens that followed the latest earlier occurrence of the history's last
    `size_n` tokens, when that n-gram occurred at least `min_hits` times before; else empty."""
    L = len(history)
    if size_n < 1 or L <= size_n:
        return history[:0]
    # Ends e < L - 1 of earlier occurrences, narrowed one token back at a time (vectorised: a
    # common last token may occur thousands of times in a long context).
    ends = np.flatnonzero(history[size_n - 1 : L - 1] == history[L - 1]) + (size_n - 1)
    for j in range(1, size_n):
        if not len(ends):
            break
        ends = ends[history[ends - j] == history[L - 1 - j]]
    if len(ends) < min_hits:
        return history[:0]
    first = int(ends[-1])
    return history[first + 1 : first + 1 + size_m]


class StepCosts:
    """Measured seconds per forward step by token count (decay-weighted), for the draft length
    choice. Counts not yet seen are interpolated linearly between measured ones; beyond the
    largest, the per-token cost of the largest measured step is assumed."""

    DECAY = 0.8  # weight of the old estimate per new measurement: follows load and context drift

    def __init__(self, max_tokens: int = 4096) -> None:
        self.max_tokens = max_tokens
        self._t: dict[int, float] = {}

    def record(self, n_tokens: int, seconds: float) -> None:
        if n_tokens < 1 or seconds <= 0 or n_tokens > self.max_tokens:
            return
        old = self._t.get(n_tokens)
        self._t[n_tokens] = seconds if old is None else self.DECAY * old + (1 - self.DECAY) * seconds

    def known(self) -> bool:
        return bool(self._t)

    def estimate(self, n_tokens: int) -> float:
        """Seconds for a step of `n_tokens` (needs a measured step: `known()`). Below the smallest
        measured count the cost is taken as proportional, which never favours a draft."""
        if n_tokens in self._t:
            return self._t[n_tokens]
        keys = sorted(self._t)
        lo = max((k for k in keys if k < n_tokens), default=None)
        hi = min((k for k in keys if k > n_tokens), default=None)
        if lo is None:
            return self._t[hi] * n_tokens / hi
        if hi is None:
            return self._t[lo] * n_tokens / lo
        f = (n_tokens - lo) / (hi - lo)
        return self._t[lo] + f * (self._t[hi] - self._t[lo])


@dataclass
class Acceptance:
    """The chance that a drafted token is kept, given the one before it was: kept / (kept +
    rejections) over the last ten or so drafted tokens' outcomes (each outcome decays the older
    ones, so a long kept draft cannot outweigh the rejections after it), from an even prior:
    where tokens are dear the first proposals are only checked (`SequenceDrafts.shadow`)."""

    kept: float = 1.0
    rejected: float = 1.0
    DECAY = 0.9  # per token outcome: about the last ten count

    @property
    def rate(self) -> float:
        return self.kept / (self.kept + self.rejected)

    def update(self, n_drafted: int, n_kept: int) -> None:
        for _ in range(n_kept):
            self.kept, self.rejected = self.DECAY * self.kept + 1.0, self.DECAY * self.rejected
        if n_kept < n_drafted:
            self.kept, self.rejected = self.DECAY * self.kept, self.DECAY * self.rejected + 1.0


def best_draft_len(rate: float, costs: StepCosts, base_tokens: int, max_len: int,
                   max_seconds: float | None = None) -> int:
    """The draft length k <= max_len that maximises expected tokens per second of a step that
    already holds `base_tokens` tokens: (base + rate + ... + rate^k) / cost(base + k); 0 when no
    draft beats none. `max_seconds`: no step may be estimated longer (other streams wait on it)."""
    if max_len <= 0 or not costs.known() or rate <= 0:
        return 0
    best_k, best = 0, base_tokens / costs.estimate(base_tokens)
    expected = float(base_tokens)
    p = 1.0
    for k in range(1, max_len + 1):
        p *= rate
        expected += p
        cost = costs.estimate(base_tokens + k)
        if max_seconds is not None and cost > max_seconds:
            break
        value = expected / cost
        if value > best:
            best_k, best = k, value
    return best_k


@dataclass
class SequenceDrafts:
    """One sequence's speculation state: its tokens so far (prompt and reply), the draft fed with
    the next token, and the counters llama-server reports (draft_n, draft_n_accepted).

    A proposal not worth feeding is still checked against the tokens sampled next (`shadow`), so
    the acceptance estimate keeps learning while nothing is drafted (and drafting resumes when
    the reply starts to repeat)."""

    settings: SpeculativeSettings
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    n_tokens: int = 0
    draft: list[int] = field(default_factory=list)
    shadow: list[int] = field(default_factory=list)
    acceptance: Acceptance = field(default_factory=Acceptance)
    n_drafted: int = 0
    n_accepted: int = 0
    n_verifications: int = 0

    @classmethod
    def for_prompt(cls, settings: SpeculativeSettings, prompt: list[int]) -> SequenceDrafts:
        """A sequence's drafts, its history starting with the prompt."""
        drafts = cls(settings)
        drafts.extend(prompt)
        return drafts

    def extend(self, ids: list[int]) -> None:
        need = self.n_tokens + len(ids)
        if need > len(self.tokens):
            grown = np.zeros(max(need, 2 * len(self.tokens), 256), dtype=np.int32)
            grown[: self.n_tokens] = self.tokens[: self.n_tokens]
            self.tokens = grown
        self.tokens[self.n_tokens : need] = ids
        self.n_tokens = need

    def sampled(self, token: int, proposed: int | None = None) -> None:
        """A reply token was sampled (`proposed`: the draft's token for its position): record it,
        count it when the draft had it, and score the unfed proposal against it."""
        self.extend([token])
        if token == proposed:
            self.n_accepted += 1
        if not self.shadow:
            return
        hit = token == self.shadow[0]
        self.acceptance.update(1, 1 if hit else 0)
        self.shadow = self.shadow[1:] if hit else []

    def propose(self, costs: StepCosts, base_tokens: int, max_len: int, max_seconds: float | None = None) -> list[int]:
        """Set and return the draft for the next step (at most `max_len` tokens, and a step
        estimated to last at most `max_seconds`)."""
        s = self.settings
        self.draft = []
        if max_len <= 0:
            return self.draft
        found = ngram_draft(self.tokens[: self.n_tokens], s.size_n, s.size_m, s.min_hits)
        k = best_draft_len(self.acceptance.rate, costs, base_tokens, min(max_len, len(found)), max_seconds)
        self.draft = found[:k].tolist()
        if k:
            self.shadow = []
        elif not self.shadow and len(found):
            self.shadow = found.tolist()
        return self.draft

    def verify(self, rows: Sequence[Any], sample: Callable[[int, Any, int | None], int | None]) -> int:
        """Sample each row of a step that fed the draft, `sample(i, row, proposed)` giving the token
        drawn (None: the request ended), until one differs from the draft; returns the draft tokens
        kept. The engine counts accepted tokens as they are sampled, so the counters are current
        when a request ends inside a draft."""
        draft, kept = self.draft, 0
        self.n_drafted += len(draft)
        self.n_verifications += 1
        for i, row in enumerate(rows):
            proposed = draft[i] if i < len(draft) else None
            token = sample(i, row, proposed)
            if token is None or proposed is None or token != proposed:
                break
            kept += 1
        if draft:
            self.acceptance.update(len(draft), kept)
        self.draft = []
        return kept


def propose_drafts(scheduler: Scheduler, costs: StepCosts, ctx_size: int) -> None:
    """Each decoding sequence's draft for the next step, cut to what the measured costs make pay
    and to the room its context and sliding-window ring leave."""
    running = scheduler.running()
    decoding = [s for s in running if not s.pending and s.next_token is not None]
    base = len(decoding) + min(scheduler.batch_size, sum(len(s.pending) for s in running))
    shared = base > 1 and costs.known()  # others wait for this step: bound its stretch
    cap = SHARED_STEP_STRETCH * costs.estimate(base) if shared else None
    for seq in decoding:
        left = seq.request.params.max_tokens - seq.n_generated - 1  # the sampled token is counted
        room = min(scheduler.draft_room(seq, ctx_size), left)
        base += len(seq.drafts.propose(costs, base, room, cap))
