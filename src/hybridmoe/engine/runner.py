"""The model runner: one `model.forward` per step, and sampling (grammar constraint, logprobs).

It holds no slot or request state: the slots hold the KV caches, the sequences their samplers
and constraints.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridmoe.engine.constraints import LazyToolCalls, make_constraint, token_table
from hybridmoe.engine.dry import Breakers, tokenizer_breakers
from hybridmoe.engine.reasoning_budget import BudgetState
from hybridmoe.engine.request import SequenceState
from hybridmoe.engine.sampler import Sampler, SamplingParams, TokenLogprobs
from hybridmoe.models.step import SeqChunk


class ModelRunner:
    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.eog_ids = frozenset(tokenizer.eog_ids)

    # ---- sequences --------------------------------------------------------------------------------
    def prepare(self, seq: SequenceState) -> None:
        """Per-request sampling state: sampler, stop ids, and the grammar constraint when asked."""
        req = seq.request
        # The penalties count the prompt too; ignore_eos bans the end tokens (llama-server's rule).
        ignore = req.params.ignore_eos
        seq.sampler = Sampler(req.params, history=req.prompt_ids, banned=sorted(self.eog_ids) if ignore else (),
                              breakers=req.dry_breakers if req.dry_breakers is not None
                              else self._dry_breakers(req.params))
        seq.stop_ids = frozenset() if ignore else self.eog_ids
        if req.constraint is not None:
            seq.constraint = make_constraint(req.constraint, token_table(self.tokenizer), seq.stop_ids)
        elif req.tool_calls is not None:
            seq.constraint = LazyToolCalls(req.tool_calls, token_table(self.tokenizer), self.tokenizer.token_bytes)
        if req.reasoning_budget is not None:
            seq.budget = BudgetState(req.reasoning_budget, req.prompt_ids)

    def _dry_breakers(self, params: SamplingParams) -> Breakers | None:
        """DRY's sequence breakers as tokens, when DRY is on and the request came without them
        (LLM.generate, on the caller's thread; the server finds them off the engine thread)."""
        chain = params.chain
        return tokenizer_breakers(self.tokenizer, chain.dry_sequence_breakers) if chain.dry_multiplier else None

    def forward(self, chunks: list[SeqChunk]) -> torch.Tensor:
        """Logits [rows, V]: each chunk's last `n_logits` tokens, in chunk order."""
        return self.model.forward(chunks)

    def next_token(self, seq: SequenceState, row: torch.Tensor) -> tuple[int, TokenLogprobs | None]:
        """The sampled token, or the one a spent reasoning budget writes instead; the budget sees it."""
        forced = seq.budget.next_forced() if seq.budget is not None else None
        token, lp = self.sample(seq, row) if forced is None else self.force(seq, row, forced)
        if seq.budget is not None:
            seq.budget.seen(token)
        return token, lp

    def sample(self, seq: SequenceState, row: torch.Tensor) -> tuple[int, TokenLogprobs | None]:
        """The next token (the constrained or plain sampler) and its logprobs when asked. A
        constraint with nothing left to allow raises ValueError."""
        req = seq.request
        token = int(seq.sampler.sample(row, seq.constraint))
        seq.sampler.accept(token)
        if seq.constraint is not None:
            seq.constraint.advance(token)
        lp = None
        if req.logprobs is not None:
            lp = (seq.sampler.post_logprobs(token, req.logprobs) if req.post_sampling_probs
                  else Sampler.logprobs(row, token, req.logprobs))
        return token, lp

    def force(self, seq: SequenceState, row: torch.Tensor, token: int) -> tuple[int, TokenLogprobs | None]:
        """Write `token` instead of sampling (a spent reasoning budget): the sampler's history and
        the constraint take it as if drawn; logprobs are the model's."""
        seq.sampler.accept(token)
        if seq.constraint is not None:
            seq.constraint.advance(token)
        k = seq.request.logprobs
        return token, (Sampler.logprobs(row, token, k) if k is not None else None)

