"""Prometheus text for /metrics, with llama-server's metric names and meanings so existing
dashboards work (`llamacpp:` prefix, the speculative-decoding counters included)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from hybridmoe.engine.engine import Engine, Usage


@dataclass
class ServerCounters:
    """Per-request quantities the engine does not count, recorded when a request finishes."""

    n_tokens_max: int = 0  # longest sequence seen (prompt + generation), llama-server's meaning
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, usage: Usage) -> None:
        with self._lock:
            self.n_tokens_max = max(self.n_tokens_max, usage.prompt_tokens + usage.completion_tokens)


def prometheus_text(engine: Engine, counters: ServerCounters | None = None) -> str:
    m = engine.metrics
    c = counters or ServerCounters()
    status = engine.status()
    busy = sum(s["is_processing"] for s in status["slots"])
    counter_rows = [
        ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens.", m.prompt_tokens_total),
        ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache.", m.cached_tokens_total),
        ("prompt_seconds_total", "Prompt process time in seconds.", m.prompt_seconds_total),
        ("tokens_predicted_total", "Number of generation tokens processed.", m.tokens_predicted_total),
        ("tokens_predicted_seconds_total", "Predict process time in seconds.", m.tokens_predicted_seconds_total),
        ("n_decode_total", "Total number of model forward calls.", m.n_decode_total),
        ("n_tokens_max", "Largest observed sequence length (prompt + generation).", c.n_tokens_max),
        ("spec_decode_num_draft_tokens_total", "Speculative: total draft tokens generated.", m.n_draft_tokens_total),
        ("spec_decode_num_accepted_tokens_total", "Speculative: total draft tokens accepted by the target model.",
         m.n_draft_accepted_total),
        ("spec_decode_num_drafts_total", "Speculative: total speculative decoding verification steps.",
         m.n_drafts_total),
        # hybridmoe's own, no llama-server equivalent:
        ("requests_total", "Requests accepted into the queue.", m.requests_total),
        ("requests_rejected_total", "Requests refused because the queue was full.", m.requests_rejected_total),
    ]
    gauge_rows = [
        ("prompt_tokens_seconds", "Average prompt throughput in tokens/s.",
         m.prompt_tokens_total / m.prompt_seconds_total if m.prompt_seconds_total else 0.0),
        ("predicted_tokens_seconds", "Average generation throughput in tokens/s.",
         m.tokens_predicted_total / m.tokens_predicted_seconds_total if m.tokens_predicted_seconds_total else 0.0),
        ("requests_processing", "Number of requests processing.", busy),
        ("requests_deferred", "Number of requests waiting for a slot.", status["requests_waiting"]),
        ("n_busy_slots_per_decode", "Average number of busy slots per forward call.",
         m.n_busy_slots_total / m.n_decode_total if m.n_decode_total else 0.0),
    ]
    mem = status["memory"]
    # Ours, beside llama-server's names: prompt reuse and the RAM it holds.
    own = [
        ("cached_prompt_tokens_total", "counter", "Prompt tokens served from a slot, a checkpoint or the RAM cache.",
         m.cached_tokens_total),
        ("checkpoint_bytes", "gauge", "RAM held by sliding-window checkpoints of all slots.", mem["checkpoint_bytes"]),
        ("prompt_cache_bytes", "gauge", "RAM held by the prompt cache (--cache-ram).", mem["prompt_cache_bytes"]),
        ("prompt_cache_entries", "gauge", "Prompts held by the prompt cache.", mem["prompt_cache_entries"]),
        ("prompt_cache_limit_bytes", "gauge", "The prompt cache's bound (-1 = none).", mem["prompt_cache_limit_bytes"]),
    ]
    lines = []
    for prefix, kind, name, help_, value in [*(("llamacpp", "counter", *r) for r in counter_rows),
                                             *(("llamacpp", "gauge", *r) for r in gauge_rows),
                                             *(("hybridmoe", k, n, h, v) for n, k, h, v in own)]:
        lines += [f"# HELP {prefix}:{name} {help_}", f"# TYPE {prefix}:{name} {kind}", f"{prefix}:{name} {value}"]
    return "\n".join(lines) + "\n"
