"""llama-server's native result objects (`/completion`, and `__verbose` with `--verbose`).

Field names and meanings follow llama-server's README: `content`, `tokens`, `stop`, `stop_type`
(eos | word | limit), `stopping_word`, `timings`, `generation_settings`, `tokens_predicted`,
`tokens_evaluated`, `tokens_cached`, `truncated`, `completion_probabilities`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from hybridmoe.engine.engine import EngineEvent, RequestHandle
from hybridmoe.engine.sampling import TokenLogprobs
from hybridmoe.settings import SAMPLER_ORDER


@dataclass
class Collected:
    """Everything one request produced (non-streamed responses, and the stream's final object)."""

    text: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    last: EngineEvent | None = None

    def push(self, ev: EngineEvent) -> None:
        self.text.append(ev.text)
        if ev.token_id is not None:
            self.tokens.append(ev.token_id)
        if ev.stop_token_id is not None:  # llama-server lists the end token too (its text is not content)
            self.tokens.append(ev.stop_token_id)
        if ev.logprob is not None:
            self.logprobs.append(ev.logprob)
        if ev.finish_reason is not None:
            self.last = ev

    def content(self) -> str:
        return "".join(self.text)


def llama_timings(t: dict[str, float] | None) -> dict[str, float] | None:
    """The engine's timings with llama-server's per-token times added, in its key order."""
    if t is None:
        return None
    per = {"prompt_per_token_ms": t["prompt_ms"] / t["prompt_n"] if t.get("prompt_n") else 0.0,
           "predicted_per_token_ms": t["predicted_ms"] / t["predicted_n"] if t.get("predicted_n") else 0.0}
    order = ["cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
             "predicted_ms", "predicted_per_token_ms", "predicted_per_second"]
    merged = {**t, **per}
    return {**{k: merged[k] for k in order if k in merged}, **{k: v for k, v in t.items() if k not in order}}


def stop_info(c: Collected, stops: list[str], decode: Any) -> tuple[str, str]:
    """(stop_type, stopping_word): eos for an end-of-generation token, word for a stop string
    (the earliest one in the decoded output), limit otherwise."""
    ev = c.last
    if ev is None or ev.finish_reason != "stop":
        return "limit", ""
    if ev.stop_token_id is not None:
        return "eos", ""
    full = decode(c.tokens)
    hits = [(full.find(s), s) for s in stops if s and s in full]
    return "word", min(hits)[1] if hits else ""


def probs_json(lps: list[TokenLogprobs], token_bytes: Any, post_sampling: bool) -> list[dict[str, Any]]:
    """llama-server's `completion_probabilities`; with post_sampling_probs, `prob`/`top_probs`
    (the engine then gave the logprobs of the distribution the draw saw: exp of them)."""
    key = "prob" if post_sampling else "logprob"

    def one(tid: int, lp: float) -> dict[str, Any]:
        b = token_bytes(tid)
        return {"id": tid, "token": b.decode("utf-8", errors="ignore"), "bytes": list(b),
                key: math.exp(lp) if post_sampling else lp}

    return [{**one(lp.token, lp.logprob), ("top_probs" if post_sampling else "top_logprobs"):
             [one(t, v) for t, v in lp.top]} for lp in lps]


def generation_settings(handle: RequestHandle, n_ctx: int, model: str, stream: bool) -> dict[str, Any]:
    """The settings the request ran with, under llama-server's names."""
    req = handle.request
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


def native_final(handle: RequestHandle, c: Collected, *, index: int, model: str, n_ctx: int, prompt: str,
                 stream: bool, return_tokens: bool, post_sampling: bool, token_bytes: Any,
                 decode: Any, id_slot: int = -1) -> dict[str, Any]:
    """The final native result object of one request (in a stream: content and tokens empty,
    they were sent in the partial chunks, as llama-server does)."""
    ev = c.last
    assert ev is not None and ev.usage is not None
    u = ev.usage
    stop_type, word = stop_info(c, list(handle.request.stop), decode)
    content = c.content()
    out: dict[str, Any] = {
        "index": index,
        "content": "" if stream else content,
        "tokens": [] if stream or not return_tokens else list(c.tokens),
        "id_slot": id_slot,
        "stop": True,
        "model": model,
        "tokens_predicted": u.completion_tokens,
        "tokens_evaluated": u.prompt_tokens,
        "generation_settings": generation_settings(handle, n_ctx, model, stream),
        "prompt": prompt,
        "has_new_line": "\n" in content,
        "truncated": u.prompt_tokens + u.completion_tokens >= n_ctx,
        "stop_type": stop_type,
        "stopping_word": word,
        "tokens_cached": u.prompt_tokens + u.completion_tokens,
        "timings": llama_timings(ev.timings),
    }
    if not stream and handle.request.logprobs:
        out["completion_probabilities"] = probs_json(c.logprobs, token_bytes, post_sampling)
    return out
