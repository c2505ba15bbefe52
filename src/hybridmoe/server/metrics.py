"""Prometheus text for /metrics, with llama-server's metric names so existing dashboards work."""

from __future__ import annotations

from hybridmoe.engine.engine import Engine


def prometheus_text(engine: Engine) -> str:
    m = engine.metrics
    status = engine.status()
    busy = sum(s["is_processing"] for s in status["slots"])
    rows = [
        ("prompt_tokens_total", "counter", "Number of prompt tokens processed.", m.prompt_tokens_total),
        ("prompt_seconds_total", "counter", "Prompt process time.", m.prompt_seconds_total),
        ("tokens_predicted_total", "counter", "Number of generation tokens processed.", m.tokens_predicted_total),
        ("tokens_predicted_seconds_total", "counter", "Predict process time.", m.tokens_predicted_seconds_total),
        ("n_decode_total", "counter", "Total number of model forward calls.", m.n_decode_total),
        ("requests_total", "counter", "Requests accepted into the queue.", m.requests_total),
        ("requests_rejected_total", "counter", "Requests refused because the queue was full.",
         m.requests_rejected_total),
        ("n_busy_slots_per_decode", "gauge", "Average number of busy slots per forward call.",
         m.n_busy_slots_total / m.n_decode_total if m.n_decode_total else 0.0),
        ("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s.",
         m.prompt_tokens_total / m.prompt_seconds_total if m.prompt_seconds_total else 0.0),
        ("predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s.",
         m.tokens_predicted_total / m.tokens_predicted_seconds_total if m.tokens_predicted_seconds_total else 0.0),
        ("n_tokens_max", "counter", "Largest number of tokens in one forward call.", m.n_tokens_max),
        ("requests_processing", "gauge", "Number of requests processing.", busy),
        ("requests_deferred", "gauge", "Number of requests waiting for a slot.", status["requests_waiting"]),
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
    for prefix, table in (("llamacpp", rows), ("hybridmoe", own)):
        for name, kind, help_, value in table:
            lines += [f"# HELP {prefix}:{name} {help_}", f"# TYPE {prefix}:{name} {kind}", f"{prefix}:{name} {value}"]
    return "\n".join(lines) + "\n"
