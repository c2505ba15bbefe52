"""The model runner: per-slot KV caches, their snapshots, one `model.forward` per step, sampling.

It executes what the scheduler decided and owns every tensor; the scheduler only sees the
opaque snapshots it returns and their sizes.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridmoe.engine.constraints import LazyToolCalls, make_constraint, token_table
from hybridmoe.engine.dry import Breakers, tokenizer_breakers
from hybridmoe.engine.reasoning_budget import BudgetState
from hybridmoe.engine.request import Sequence
from hybridmoe.engine.sampling import Sampler, SamplingParams, TokenLogprobs
from hybridmoe.engine.scheduler import Admission, StepPlan
from hybridmoe.models.gpt_oss import SeqChunk
from hybridmoe.models.kv_cache import KVSnapshot, SequenceKVCache
from hybridmoe.models.kv_window import WindowGeometry


class ModelRunner:
    def __init__(self, model: Any, tokenizer: Any, n_slots: int, ctx_per_slot: int) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.ctx_per_slot = ctx_per_slot
        self.eog_ids = frozenset(tokenizer.eog_ids)
        self._caches: list[SequenceKVCache | None] = [None] * n_slots

    def geometry(self) -> WindowGeometry:
        layout = self.model.cache_layout()
        if not any(layout.sliding):
            return WindowGeometry(0, 0)
        return WindowGeometry(layout.window, min(self.ctx_per_slot, layout.window + layout.slack))

    def cache(self, slot_id: int) -> SequenceKVCache:
        c = self._caches[slot_id]
        if c is None:
            c = self._caches[slot_id] = self.model.make_cache(self.ctx_per_slot)
        return c

    def drop_cache(self, slot_id: int) -> None:
        self._caches[slot_id] = None

    # ---- states -----------------------------------------------------------------------------------
    def snapshot(self, slot_id: int, full_layers: bool) -> KVSnapshot:
        return self.cache(slot_id).snapshot(full_layers)

    def load(self, adm: Admission) -> int:
        """Put the admission's reused state into its slot; returns the tokens kept."""
        cache = self.cache(adm.slot.id)
        r = adm.reuse
        if r.entry is not None:
            cache.restore(r.entry.data)
        if r.checkpoint is not None:
            cache.restore(r.checkpoint.data)
        return cache.truncate(r.keep)

    def restore(self, slot_id: int, snap: KVSnapshot) -> None:
        self.cache(slot_id).restore(snap)

    # ---- sequences --------------------------------------------------------------------------------
    def prepare(self, seq: Sequence) -> None:
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

    def forward(self, plan: StepPlan) -> torch.Tensor:
        """Logits [rows, V]: every token of a decoding entry (its sampled token and draft), the
        last token of a prompt chunk; in batch order."""
        chunks = [SeqChunk(self.cache(seq.slot_id), toks, 1 if seq.pending else len(toks)) for seq, toks in plan.batch]
        return self.model.forward(chunks)

    def truncate(self, slot_id: int, n: int) -> int:
        """Cut the slot's cache back to its first n tokens; returns the length kept."""
        return self.cache(slot_id).truncate(n)

    def sample(self, seq: Sequence, row: torch.Tensor) -> tuple[int, TokenLogprobs | None]:
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

    def force(self, seq: Sequence, row: torch.Tensor, token: int) -> tuple[int, TokenLogprobs | None]:
        """Write `token` instead of sampling (a spent reasoning budget): the sampler's history and
        the constraint take it as if drawn; logprobs are the model's."""
        seq.sampler.accept(token)
        if seq.constraint is not None:
            seq.constraint.advance(token)
        k = seq.request.logprobs
        return token, (Sampler.logprobs(row, token, k) if k is not None else None)

    def cache_length(self, slot_id: int) -> int:
        return self.cache(slot_id).length

