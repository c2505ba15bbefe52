"""Prometheus text for /metrics, with llama-server's metric names and meanings so existing
dashboards work (`llamacpp:` prefix, the speculative-decoding counters included)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from hybridmoe.engine.engine import Engine, Usage
from hybridmoe.engine.output import Metrics


@dataclass
class ServerCounters:
    """Per-request quantities the engine does not count, recorded when a request finishes."""

    n_tokens_max: int = 0  # longest sequence seen (prompt + generation), llama-server's meaning
    first_tokens: int = 0  # requests that generated a token: each first token comes from the prompt step
    started: int = field(default_factory=lambda: int(time.time()))  # the Process-Start-Time-Unix header
    _scraped: tuple[int, float, int, float] = (0, 0.0, 0, 0.0)  # the engine's totals at the last scrape
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, usage: Usage) -> None:
        with self._lock:
            self.n_tokens_max = max(self.n_tokens_max, usage.prompt_tokens + usage.completion_tokens)
            self.first_tokens += usage.completion_tokens > 0

    def rates(self, m: Metrics) -> tuple[float, float]:
        """Prompt and generation tokens/s since the last scrape, as llama-server's gauges (each
        /metrics starts a new window). Generation excludes each request's first token: it is sampled
        by the prompt step, so the decode time holds one token fewer than the request generated."""
        with self._lock:
            now = (m.prompt_tokens_total, m.prompt_seconds_total,
                   m.tokens_predicted_total - self.first_tokens, m.tokens_predicted_seconds_total)
            d = [a - b for a, b in zip(now, self._scraped, strict=True)]
            self._scraped = now
        return (d[0] / d[1] if d[1] > 0 else 0.0), (max(d[2], 0) / d[3] if d[3] > 0 else 0.0)


def prometheus_text(engine: Engine, counters: ServerCounters | None = None) -> str:
    m = engine.metrics
    c = counters or ServerCounters()
    status = engine.status()
    busy = sum(s["is_processing"] for s in status["slots"])
    prompt_rate, predicted_rate = c.rates(m)
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
        ("prompt_tokens_seconds", "Average prompt throughput in tokens/s since the last scrape.", prompt_rate),
        ("predicted_tokens_seconds", "Average generation throughput in tokens/s since the last scrape.",
         predicted_rate),
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
