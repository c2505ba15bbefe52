"""Token logprobs in each API's JSON: OpenAI chat's (with llama-server's `id`), the Responses
API's, the legacy completions' and llama-server's native `completion_probabilities`."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from hybridmoe.engine.sampler import TokenLogprobs

TokenBytes = Callable[[int], bytes]


def chat_entry(lp: TokenLogprobs, token_bytes: TokenBytes) -> dict[str, Any]:
    """OpenAI's chat entry: token, logprob, bytes, top_logprobs; `id` is llama-server's addition."""
    def one(tid: int, val: float) -> dict[str, Any]:
        b = token_bytes(tid)
        return {"id": tid, "token": b.decode("utf-8", errors="replace"), "logprob": val, "bytes": list(b)}

    return {**one(lp.token, lp.logprob), "top_logprobs": [one(t, v) for t, v in lp.top]}


def responses_entry(lp: TokenLogprobs, token_bytes: TokenBytes) -> dict[str, Any]:
    """The Responses API's entry: token, logprob, bytes, top_logprobs (no id)."""
    e = chat_entry(lp, token_bytes)
    keys = ("token", "logprob", "bytes")
    return {**{k: e[k] for k in keys}, "top_logprobs": [{k: t[k] for k in keys} for t in e["top_logprobs"]]}


def legacy_logprobs(lps: Sequence[TokenLogprobs], token_text: Callable[[int], str],
                    token_bytes: TokenBytes) -> dict[str, Any]:
    """OpenAI's legacy completion logprobs, plus `content` in the chat form (what llama-server's
    /v1/completions gives instead), so clients of either read theirs."""
    return {
        "tokens": [token_text(lp.token) for lp in lps],
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{token_text(t): v for t, v in lp.top} for lp in lps],
        "content": [chat_entry(lp, token_bytes) for lp in lps],
    }


def native_probs(lps: Sequence[TokenLogprobs], token_bytes: TokenBytes, post_sampling: bool) -> list[dict[str, Any]]:
    """llama-server's `completion_probabilities`; with post_sampling_probs, `prob`/`top_probs`
    (the engine then gave the logprobs of the distribution the draw saw: exp of them)."""
    key = "prob" if post_sampling else "logprob"

    def one(tid: int, lp: float) -> dict[str, Any]:
        b = token_bytes(tid)
        return {"id": tid, "token": b.decode("utf-8", errors="ignore"), "bytes": list(b),
                key: math.exp(lp) if post_sampling else lp}

    return [{**one(lp.token, lp.logprob), ("top_probs" if post_sampling else "top_logprobs"):
             [one(t, v) for t, v in lp.top]} for lp in lps]
