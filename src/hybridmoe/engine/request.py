"""What crosses the engine's boundary: requests in, events out, and the per-request state the
scheduler, runner and output processor share. Plain data: no torch here."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridmoe.engine.constraints import ConstraintSpec, ToolCallSpecs
    from hybridmoe.engine.dry import Breakers
    from hybridmoe.engine.reasoning_budget import ReasoningBudget
    from hybridmoe.engine.sampler import SamplingParams, TokenLogprobs


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stop: Sequence[str] = ()
    logprobs: int | None = None  # None: no logprobs; k >= 0: chosen token's logprob + top k
    constraint: ConstraintSpec | None = None  # grammar / JSON schema the output must match
    tool_calls: ToolCallSpecs | None = None  # without `constraint`: each call's arguments follow its function's schema
    cache_prompt: bool = True  # reuse cached KV of a matching prefix (llama-server's cache_prompt)
    dry_breakers: Breakers | None = None  # DRY's breakers as tokens, found off the engine thread (engine.dry)
    post_sampling_probs: bool = False  # logprobs from the sampler chain's final distribution, not the model's
    id_slot: int = -1  # llama-server's id_slot: run in this slot (waiting for it); -1: any
    t_max_predict_ms: int = 0  # llama-server's: end the reply once this long after its first token, past a newline
    n_indent: int = 0  # llama-server's: end the reply (cut there) at a line, after the first, indented less
    reasoning_budget: ReasoningBudget | None = None  # llama-server's: thinking tokens allowed, then forced closed
    timings_per_token: bool = False  # llama-server's: every token event carries the timings so far
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class PromptProgress:
    """How far a request's prompt has come (llama-server's prompt_progress): `processed` of its
    `total` tokens are in the slot's cache, `cache` of them reused; `time_ms` since the submit."""

    total: int
    cache: int
    processed: int
    time_ms: float

    def to_json(self) -> dict[str, int]:
        return {"total": self.total, "cache": self.cache, "processed": self.processed, "time_ms": int(self.time_ms)}


@dataclass
class EngineEvent:
    """One generated token (`token_id`, `text` delta), prompt progress (`progress` set, after each
    prompt chunk the engine computed), or the final event (`finish_reason` set)."""

    token_id: int | None = None
    text: str = ""  # complete UTF-8 only; held back while it could still start a stop string
    logprob: TokenLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    stop_token_id: int | None = None  # the end-of-generation id that ended it (not in the text)
    stop_word: str | None = None  # the stop string that ended it (cut from the text)
    timings: dict[str, float] | None = None
    usage: Usage | None = None
    error: str | None = None
    progress: PromptProgress | None = None


class SequenceState:
    """One request inside the engine: where its prompt stands and what it has produced.

    The scheduler moves `pending` and `next_token`; the runner fills `sampler`/`constraint` and
    samples; the output processor owns the text side (`decoder`, `held`)."""

    def __init__(self, request: GenerationRequest, sink: Any) -> None:
        self.request = request
        self.sink = sink  # RequestHandle: where events go; `.cancelled` is polled each step
        self.pending: list[int] = []  # prompt tokens not yet fed
        self.next_token: int | None = None  # sampled, not yet fed
        self.n_generated = 0
        self.n_cached = 0
        self.slot_id: int | None = None
        self.sampler: Any = None  # engine.sampler.Sampler, set by the runner at admission
        self.constraint: Any = None  # engine.constraints.GrammarConstraint or None
        self.stop_ids: frozenset[int] = frozenset()
        self.drafts: Any = None  # engine.speculative.SequenceDrafts when speculative decoding is on
        self.budget: Any = None  # engine.reasoning_budget.BudgetState when the request has a reasoning budget
        self.decoder: Any = None  # tokenizer.IncrementalDecoder, set by the output processor
        self.held = ""  # decoded text not yet emitted (stop-string hold-back)
        self.stop_word: str | None = None  # the stop string found in the text, once one is
        self.t_start = time.perf_counter()
        self.t_first: float | None = None
        self.saw_newline = False  # the reply has written a newline (t_max_predict_ms waits for one)
        self.line = ""  # the reply's text since its last newline (n_indent)

    @property
    def prompt(self) -> list[int]:
        return self.request.prompt_ids
