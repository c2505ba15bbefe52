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
    lines = []
    for name, kind, help_, value in rows:
        lines += [f"# HELP llamacpp:{name} {help_}", f"# TYPE llamacpp:{name} {kind}", f"llamacpp:{name} {value}"]
    return "\n".join(lines) + "\n"
