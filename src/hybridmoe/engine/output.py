"""The output processor: prompt progress, sampled tokens -> text deltas, stop strings, finish
reasons, timings, events and counters. The one place these rules live (the server and
`LLM.generate` share it)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hybridmoe.engine.request import EngineEvent, PromptProgress, SequenceState, Usage
from hybridmoe.tokenizer.tokenizer import IncrementalDecoder


@dataclass
class Metrics:
    """Counters for /metrics (llama-server's names are applied by the server)."""

    prompt_tokens_total: int = 0
    prompt_seconds_total: float = 0.0
    tokens_predicted_total: int = 0
    tokens_predicted_seconds_total: float = 0.0
    cached_tokens_total: int = 0  # prompt tokens served from a slot, checkpoint or the RAM cache
    n_decode_total: int = 0
    n_busy_slots_total: int = 0
    requests_total: int = 0
    requests_rejected_total: int = 0
    max_step_tokens: int = 0  # the most tokens one model step has held (not llama-server's n_tokens_max)
    n_draft_tokens_total: int = 0  # speculative decoding: tokens drafted, kept, verification steps
    n_draft_accepted_total: int = 0
    n_drafts_total: int = 0

    def step(self, n_sequences: int, n_tokens: int, n_prompt_tokens: int, seconds: float) -> None:
        """One model step; its time is shared between prompt and generated tokens by their count."""
        self.n_decode_total += 1
        self.n_busy_slots_total += n_sequences
        self.max_step_tokens = max(self.max_step_tokens, n_tokens)
        self.prompt_tokens_total += n_prompt_tokens
        self.prompt_seconds_total += seconds * n_prompt_tokens / n_tokens
        self.tokens_predicted_seconds_total += seconds * (n_tokens - n_prompt_tokens) / n_tokens

    def verification(self, n_drafted: int, n_accepted: int) -> None:
        self.n_draft_tokens_total += n_drafted
        self.n_draft_accepted_total += n_accepted
        self.n_drafts_total += 1


def safe_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of `text` that cannot be the start of a stop string (the rest is held back)."""
    keep = len(text)
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                keep = min(keep, len(text) - n)
                break
    return keep


def find_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index of the earliest stop string in `text`, or None (empty stop strings never match)."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


def timings(seq: SequenceState) -> dict[str, float]:
    """llama-server's `timings` object for one request."""
    now = time.perf_counter()
    t_first = seq.t_first or now
    prompt_n = len(seq.prompt) - seq.n_cached
    prompt_ms = (t_first - seq.t_start) * 1e3
    predicted_ms = (now - t_first) * 1e3
    out = {
        "cache_n": seq.n_cached,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_second": prompt_n * 1e3 / prompt_ms if prompt_ms > 0 else 0.0,
        "predicted_n": seq.n_generated,
        "predicted_ms": predicted_ms,
        "predicted_per_second": seq.n_generated * 1e3 / predicted_ms if predicted_ms > 0 else 0.0,
    }
    if seq.drafts is not None and seq.drafts.n_drafted:  # llama-server adds these once it drafted
        out["draft_n"] = seq.drafts.n_drafted
        out["draft_n_accepted"] = seq.drafts.n_accepted
    return out


class OutputProcessor:
    def __init__(self, tokenizer: Any, metrics: Metrics) -> None:
        self.tokenizer = tokenizer
        self.metrics = metrics

    def start(self, seq: SequenceState) -> None:
        seq.decoder = IncrementalDecoder(self.tokenizer)
        self.metrics.cached_tokens_total += seq.n_cached

    def prompt_fed(self, seq: SequenceState) -> None:
        """A step computed a chunk of the prompt: push how far it has come (the last event, before
        the first token, has processed == total)."""
        total = len(seq.prompt)
        ms = (time.perf_counter() - seq.t_start) * 1e3
        seq.sink.push(EngineEvent(progress=PromptProgress(total, seq.n_cached, total - len(seq.pending), ms)))

    def on_token(self, seq: SequenceState, token: int, lp: Any, room_left: bool) -> str | None:
        """Emit what `token` adds; returns the finish reason when it ends the request."""
        if seq.t_first is None:
            seq.t_first = time.perf_counter()
        seq.n_generated += 1
        self.metrics.tokens_predicted_total += 1
        req = seq.request
        if token in seq.stop_ids:
            self._emit(seq, token, lp, final=True)
            return "stop"
        piece = seq.decoder.push(token)
        seq.held += piece
        seq.saw_newline = seq.saw_newline or "\n" in piece
        seq.line = piece.rsplit("\n", 1)[1] if "\n" in piece else seq.line + piece
        hit = find_stop(seq.held, req.stop)
        if hit is not None:
            seq.stop_word = next(s for s in req.stop if s and seq.held.startswith(s, hit))
            seq.held = seq.held[:hit]
            self._emit(seq, token, lp, final=True)
            return "stop"
        if req.n_indent > 0 and seq.saw_newline:
            body = seq.line.lstrip(" \t")  # it began in this piece, else an earlier token had stopped
            if body and len(seq.line) - len(body) < req.n_indent:
                seq.held = seq.held[: len(seq.held) - len(body)]
                self._emit(seq, token, lp, final=True)
                return "length"
        out_of_time = (req.t_max_predict_ms > 0 and seq.saw_newline
                       and (time.perf_counter() - seq.t_first) * 1e3 > req.t_max_predict_ms)
        if seq.n_generated >= req.params.max_tokens or not room_left or out_of_time:
            seq.held += seq.decoder.flush()
            self._emit(seq, token, lp, final=True)
            return "length"
        self._emit(seq, token, lp, final=False)
        return None

    def _emit(self, seq: SequenceState, token: int, lp: Any, final: bool) -> None:
        n = len(seq.held) if final else safe_prefix_len(seq.held, seq.request.stop)
        text, seq.held = seq.held[:n], seq.held[n:]
        is_stop_token = token in seq.stop_ids
        if text or not is_stop_token:
            live = timings(seq) if seq.request.timings_per_token else None  # llama-server's timings_per_token
            seq.sink.push(EngineEvent(token_id=None if is_stop_token else token, text=text, logprob=lp, timings=live))

    def finish(self, seq: SequenceState, reason: str, stop_token_id: int | None = None,
               error: str | None = None) -> None:
        usage = Usage(len(seq.prompt), seq.n_generated, seq.n_cached)
        seq.sink.push(EngineEvent(finish_reason=reason, stop_token_id=stop_token_id, stop_word=seq.stop_word,
                                  timings=timings(seq), usage=usage, error=error))
