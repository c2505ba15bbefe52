"""llama-server's native result objects (`/completion`, and `__verbose` with `--verbose`).

Field names and meanings follow llama-server's README: `content`, `tokens`, `stop`, `stop_type`
(eos | word | limit), `stopping_word`, `timings`, `generation_settings`, `tokens_predicted`,
`tokens_evaluated`, `tokens_cached`, `truncated`, `completion_probabilities`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from hybridmoe.engine.engine import GenerationRequest
from hybridmoe.server.logprob_json import TokenBytes, native_probs
from hybridmoe.server.reply import Reply
from hybridmoe.settings import SAMPLER_ORDER


def llama_timings(t: dict[str, float] | None) -> dict[str, float] | None:
    """The engine's timings with llama-server's per-token times added, in its key order."""
    if t is None:
        return None
    # predicted_ms runs from the first token (sampled by the prompt step) to the last, so it holds
    # predicted_n - 1 decodes: llama-server's per-token time and rate divide by that.
    decoded = max(t.get("predicted_n", 0) - 1, 0)
    per = {"prompt_per_token_ms": t["prompt_ms"] / t["prompt_n"] if t.get("prompt_n") else 0.0,
           "predicted_per_token_ms": t.get("predicted_ms", 0.0) / decoded if decoded else 0.0,
           "predicted_per_second": decoded * 1e3 / t["predicted_ms"] if decoded and t.get("predicted_ms") else 0.0}
    order = ["cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
             "predicted_ms", "predicted_per_token_ms", "predicted_per_second"]
    merged = {**t, **per}
    return {**{k: merged[k] for k in order if k in merged}, **{k: v for k, v in t.items() if k not in order}}


def stop_type(reply: Reply) -> str:
    """eos for an end-of-generation token, word for a stop string, limit otherwise."""
    if reply.finish_reason != "stop":
        return "limit"
    return "eos" if reply.stop_token_id is not None else "word"


def generation_settings(req: GenerationRequest, n_ctx: int, model: str, stream: bool) -> dict[str, Any]:
    """The settings the request ran with, under llama-server's names."""
    p = req.params
    return {
        "n_ctx": n_ctx,
        "model": model,
        "seed": p.seed if p.seed is not None else 4294967295,
        "temperature": p.temperature,
        "top_k": p.top_k,
        "top_p": p.top_p,
        "min_p": p.min_p,
        **{k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(p.chain).items()},
        "logit_bias": [{"bias": b if math.isfinite(b) else None, "token": t} for t, b in p.logit_bias],
        "stop": list(req.stop),
        "max_tokens": p.max_tokens,
        "n_predict": p.max_tokens,
        "n_keep": 0,
        "ignore_eos": p.ignore_eos,
        "stream": stream,
        "n_probs": req.logprobs or 0,
        "samplers": list(p.samplers if p.samplers is not None else SAMPLER_ORDER),
    }


def native_final(req: GenerationRequest, reply: Reply, *, index: int, model: str, n_ctx: int, prompt: str,
                 stream: bool, return_tokens: bool, post_sampling: bool, token_bytes: TokenBytes,
                 id_slot: int = -1) -> dict[str, Any]:
    """The final native result object of one request (in a stream: content and tokens empty,
    they were sent in the partial chunks, as llama-server does)."""
    u = reply.usage
    assert u is not None
    kind = stop_type(reply)
    out: dict[str, Any] = {
        "index": index,
        "content": "" if stream else reply.text,
        "tokens": [] if stream or not return_tokens else list(reply.tokens),
        "id_slot": id_slot,
        "stop": True,
        "model": model,
        "tokens_predicted": u.completion_tokens,
        "tokens_evaluated": u.prompt_tokens,
        "generation_settings": generation_settings(req, n_ctx, model, stream),
        "prompt": prompt,
        "has_new_line": "\n" in reply.text,
        "truncated": u.prompt_tokens + u.completion_tokens >= n_ctx,
        "stop_type": kind,
        "stopping_word": (reply.stop_word or "") if kind == "word" else "",
        "tokens_cached": u.prompt_tokens + u.completion_tokens,
        "timings": llama_timings(reply.timings),
    }
    if not stream and req.logprobs:
        out["completion_probabilities"] = native_probs(reply.logprobs, token_bytes, post_sampling)
    return out
