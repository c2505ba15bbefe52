"""GET /v1/loads: the engine's load in SGLang's shape, which gateways poll to balance replicas.

A gateway in front of several servers (SGLang Model Gateway, `smg`; docs/scale-out.md) reads a
worker's running and waiting requests, KV usage and throughput from this route to estimate queue
waits and to steer new conversations away from a saturated replica. The shape is SGLang's
(`loads` per data-parallel rank plus an `aggregate`); hybridmoe always has one rank.

KV usage counts only the tokens of slots that are generating: an idle slot's cached conversation is
there to be reused (SGLang counts such evictable prefix tokens as free too), so reporting it as used
would push a conversation away from the replica that holds its prompt.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from hybridmoe import __version__
from hybridmoe.engine.engine import Engine


def loads(engine: Engine) -> dict[str, Any]:
    """One snapshot of `engine`'s load, read without stopping it."""
    status = engine.status()
    slots = status["slots"]
    busy = [s for s in slots if s["is_processing"]]
    waiting = int(status["requests_waiting"])
    used = sum(s["n_cached_tokens"] + s["n_prompt_pending"] for s in busy)
    capacity = sum(s["n_ctx"] for s in slots)
    m = engine.metrics
    prompt_seen = m.prompt_tokens_total + m.cached_tokens_total
    rank = {
        "dp_rank": 0,
        "num_running_reqs": len(busy),
        "num_waiting_reqs": waiting,
        "num_total_reqs": len(busy) + waiting,
        "num_used_tokens": used,
        "max_total_num_tokens": capacity,
        "token_usage": used / capacity if capacity else 0.0,
        # Lifetime average: a per-poll rate would depend on how many gateways poll.
        "gen_throughput": (m.tokens_predicted_total / m.tokens_predicted_seconds_total
                           if m.tokens_predicted_seconds_total else 0.0),
        "cache_hit_rate": m.cached_tokens_total / prompt_seen if prompt_seen else 0.0,
        "utilization": len(busy) / len(slots) if slots else 0.0,
        "max_running_requests": len(slots),
    }
    return {
        "timestamp": datetime.now(timezone.utc).isoformat(),
        "version": __version__,
        "dp_rank_count": 1,
        "loads": [rank],
        "aggregate": {
            "total_running_reqs": rank["num_running_reqs"],
            "total_waiting_reqs": waiting,
            "total_reqs": rank["num_total_reqs"],
            "avg_token_usage": rank["token_usage"],
            "avg_throughput": rank["gen_throughput"],
            "avg_utilization": rank["utilization"],
        },
    }
