"""A token budget for the model's thinking (llama-server's `--reasoning-budget`).

The server names the thinking's start and end as token sequences (the chat format's marks; on
gpt-oss the analysis channel's header and its message end); once the reply has written `tokens` tokens of
thinking, the budget message and the end are written for it, one forced token per step, and the
model goes on from there (on gpt-oss, with its final answer). Each thinking section has its own
budget, as in llama-server (checked by sending both servers the same requests). A budget without a
token count only closes the thinking when asked (`end_now`: llama-server's reasoning control).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningBudget:
    start: tuple[int, ...]  # tokens that open a thinking section
    end: tuple[int, ...]  # tokens that close it
    forced: tuple[int, ...]  # written when the budget is spent: the message's tokens, then `end`
    tokens: int | None  # thinking tokens allowed per section (0: close each as it opens; None: no limit)

    def __post_init__(self) -> None:
        if (not self.start or not self.end or (self.tokens is not None and self.tokens < 0)
                or tuple(self.forced[-len(self.end):]) != self.end):
            raise ValueError("a reasoning budget needs start and end tags, forced tokens ending with the end tag "
                             f"and tokens >= 0 or None, got {self}")


class BudgetState:
    """One reply's progress against its budget; `seen` every reply token, `next_forced` before
    sampling."""

    def __init__(self, budget: ReasoningBudget, prompt_ids: list[int]) -> None:
        self.budget = budget
        self._recent: collections.deque[int] = collections.deque(maxlen=max(len(budget.start), len(budget.end)))
        self.inside = False
        self.used = 0
        self._queue: collections.deque[int] = collections.deque()
        for t in prompt_ids[-self._recent.maxlen:]:  # a prompt that ends inside a thinking section
            self._track(t, count=False)
        self.used = 0
        if self.inside and budget.tokens == 0:
            self._queue.extend(budget.forced)

    def end_now(self) -> bool:
        """Close the thinking section the reply is in (its budget spent at once); False when it is in
        none or its close is already being written."""
        if not self.inside or self._queue:
            return False
        self._queue.extend(self.budget.forced)
        return True

    def next_forced(self) -> int | None:
        """The token the reply must write next, or None (sample)."""
        return self._queue[0] if self._queue else None

    def seen(self, token: int) -> None:
        """A reply token was written (forced or sampled)."""
        if self._queue and token == self._queue[0]:
            self._queue.popleft()
        self._track(token, count=not self._queue)

    def _ends_with(self, tags: tuple[int, ...]) -> bool:
        n = len(tags)
        return len(self._recent) >= n and tuple(self._recent)[-n:] == tags

    def _track(self, token: int, count: bool) -> None:
        self._recent.append(token)
        if not self.inside:
            if self._ends_with(self.budget.start):
                self.inside, self.used = True, 0
                if count and self.budget.tokens == 0:
                    self._queue.extend(self.budget.forced)
            return
        if self._ends_with(self.budget.end):
            self.inside = False
            self._queue.clear()
            return
        if count:
            self.used += 1
            if self.budget.tokens is not None and self.used >= self.budget.tokens:
                self._queue.extend(self.budget.forced)
