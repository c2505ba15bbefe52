"""Engine (in process, tiny random model): batching must not change greedy output; prefix reuse,
stop strings, cancellation, the bounded queue and logprobs."""

from __future__ import annotations

import threading

import pytest

from hybridmoe.engine.engine import Engine, GenerationRequest, QueueFullError
from hybridmoe.engine.sampler import SamplingParams

from .scripted_serve import script_request, scripted_sampling


@pytest.fixture
def llm(served_llm):
    return served_llm


@pytest.fixture
def engine(llm):
    eng = Engine(llm.loaded, n_parallel=3, ctx_size_per_slot=256, max_queue=4, batch_size=5).start()
    yield eng
    eng.close()


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


def tokens_of(events) -> list[int]:
    return [e.token_id for e in events if e.token_id is not None]


def prompts(llm, n: int) -> list[list[int]]:
    return [llm.tokenize(f"Request {i}: " + "words " * (3 * i + 1)) for i in range(n)]


def test_batched_greedy_equals_generate_alone(llm, engine):
    ps = prompts(llm, 5)  # 5 requests on 3 slots: queueing, chunked prefill (batch 5), mixed steps
    alone = [llm.generate(p, max_tokens=12, temperature=0.0) for p in ps]
    handles = [engine.submit(GenerationRequest(p, greedy(12))) for p in ps]
    for h, ref in zip(handles, alone):
        events = list(h)
        assert tokens_of(events) == ref.token_ids
        assert "".join(e.text for e in events) == ref.text
        last = events[-1]
        assert last.finish_reason == ref.finish_reason
        assert last.usage.prompt_tokens == len(h.request.prompt_ids)
        assert set(last.timings) >= {"prompt_n", "prompt_ms", "prompt_per_second",
                                     "predicted_n", "predicted_ms", "predicted_per_second"}
    assert engine.metrics.n_decode_total > 0
    assert engine.metrics.n_busy_slots_total > engine.metrics.n_decode_total  # slots shared steps


def test_prefix_reuse_keeps_output(llm, engine):
    base = llm.tokenize("A shared system prompt that is fairly long, " * 3)
    first = list(engine.submit(GenerationRequest(base + llm.tokenize(" one"), greedy(6))))
    follow = base + llm.tokenize(" two")
    events = list(engine.submit(GenerationRequest(follow, greedy(6))))
    assert events[-1].usage.cached_tokens >= len(base) - 1
    assert events[-1].timings["prompt_n"] == len(follow) - events[-1].usage.cached_tokens
    assert tokens_of(events) == llm.generate(follow, max_tokens=6, temperature=0.0).token_ids
    assert first[-1].finish_reason in ("stop", "length")


def test_prompt_progress_is_pushed_after_each_chunk(llm, engine):
    """Prompt progress comes as events, one per prompt chunk the engine computed (batch_size 5), in
    order and before the first token; the last holds the whole prompt."""
    base = llm.tokenize("Progress is pushed, not polled, " * 2)
    for prompt in (base, base + llm.tokenize(" and again")):  # the second reuses the first's tokens
        events = list(engine.submit(GenerationRequest(prompt, greedy(3, ignore_eos=True))))
        first = next(k for k, e in enumerate(events) if e.progress is None)
        progress = [e.progress for e in events[:first]]
        assert all(e.progress is None for e in events[first:]) and events[first].token_id is not None
        cached = events[-1].usage.cached_tokens
        assert [p.processed for p in progress] == [min(n, len(prompt)) for n in range(cached + 5, len(prompt) + 5, 5)]
        assert all(p.total == len(prompt) and p.cache == cached for p in progress)
        times = [p.time_ms for p in progress]
        assert times == sorted(times)
    assert cached >= len(base) - 1


def test_stop_string_cuts_text(llm, engine):
    p = prompts(llm, 1)[0]
    ref = llm.generate(p, max_tokens=12, temperature=0.0, ignore_eos=True)
    assert len(ref.text) > 6, "the random model should produce some text"
    stop = ref.text[3:5]
    events = list(engine.submit(GenerationRequest(p, greedy(12, ignore_eos=True), stop=[stop])))
    text = "".join(e.text for e in events)
    assert events[-1].finish_reason == "stop"
    assert text == ref.text[: ref.text.index(stop)]


def test_cancel_frees_slot(llm, engine):
    h = engine.submit(GenerationRequest(prompts(llm, 1)[0], greedy(200, ignore_eos=True)))
    it = iter(h)
    next(e for e in it if e.token_id is not None)  # generating
    h.cancel()
    rest = list(it)
    assert rest[-1].finish_reason == "cancelled"
    assert rest[-1].usage.completion_tokens < 200
    assert not any(s["is_processing"] for s in engine.status()["slots"])


def test_queue_full_is_refused(llm):
    eng = Engine(llm.loaded, n_parallel=1, ctx_size_per_slot=256, max_queue=1, batch_size=64)  # not started
    p = prompts(llm, 1)[0]
    eng.submit(GenerationRequest(p, greedy(4)))  # takes the (free) slot
    eng.submit(GenerationRequest(p, greedy(4)))  # waits
    with pytest.raises(QueueFullError, match="busy"):
        eng.submit(GenerationRequest(p, greedy(4)))
    assert eng.metrics.requests_rejected_total == 1
    eng.start()
    eng.close()


def test_bad_requests_raise(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.submit(GenerationRequest([], greedy(4)))
    with pytest.raises(ValueError, match="context"):
        engine.submit(GenerationRequest([1] * 256, greedy(4)))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.submit(GenerationRequest([1, 2], greedy(0)))


def test_logprobs_and_scripted_tokens(llm, engine, monkeypatch):
    scripted_sampling(monkeypatch)  # the tests-only seam: these ids replace the first samples
    p = prompts(llm, 1)[0]
    forced = llm.tokenize("forced text")
    req = GenerationRequest(p, greedy(len(forced) + 2, ignore_eos=True), logprobs=3)
    script_request(req.request_id, forced)
    events = list(engine.submit(req))
    toks = tokens_of(events)
    assert toks[: len(forced)] == forced
    lps = [e.logprob for e in events if e.logprob is not None]
    assert len(lps) == len(toks)
    for lp in lps:
        assert len(lp.top) == 3 and lp.logprob <= 0.0
        assert lp.top[0][1] >= lp.top[-1][1]
    # Greedy tokens after the forced ones are the argmax, i.e. the top-1 logprob.
    assert lps[-1].top[0][0] == toks[-1]


def test_length_limit_and_concurrent_submitters(llm, engine):
    ps = prompts(llm, 6)
    results: dict[int, list] = {}

    def run(i: int) -> None:
        results[i] = list(engine.submit(GenerationRequest(ps[i], greedy(3, ignore_eos=True))))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(results) == [0, 1, 2, 3]
    for events in results.values():
        assert events[-1].finish_reason == "length"
        assert events[-1].usage.completion_tokens == 3


def test_cache_allocation_failure_fails_only_that_request(llm, monkeypatch):
    real = llm.model.make_cache
    calls = {"n": 0}

    def failing_once(max_ctx: int):
        calls["n"] += 1
        if calls["n"] == 1:
            raise MemoryError("no room for a KV cache")
        return real(max_ctx)

    monkeypatch.setattr(llm.model, "make_cache", failing_once)
    eng = Engine(llm.loaded, n_parallel=1, ctx_size_per_slot=256, max_queue=4, batch_size=64).start()
    p = prompts(llm, 1)[0]
    first = list(eng.submit(GenerationRequest(p, greedy(3))))
    assert first[-1].finish_reason == "error" and "no room" in first[-1].error
    second = list(eng.submit(GenerationRequest(p, greedy(3))))
    assert tokens_of(second) == llm.generate(p, max_tokens=3, temperature=0.0).token_ids
    eng.close()


def test_generate_and_engine_share_one_stop_rule(llm, engine):
    """LLM.generate drives the same engine steps: same tokens, text and finish for every stop kind
    (an empty stop string never matches; a stop string cuts the text where it starts)."""
    p = llm.tokenize("Stop rules: " + "words " * 5)
    free = llm.generate(p, max_tokens=16, temperature=0.0, ignore_eos=True)
    cut = free.text[len(free.text) // 2 : len(free.text) // 2 + 2] or "x"
    for stops in ([""], [cut], ["never-in-the-output", cut], []):
        res = llm.generate(p, max_tokens=16, temperature=0.0, ignore_eos=True, stop=stops)
        events = engine.generate(GenerationRequest(p, greedy(16, ignore_eos=True), stop=stops))
        assert res.token_ids == tokens_of(events), stops
        assert res.text == "".join(e.text for e in events), stops
        assert res.finish_reason == events[-1].finish_reason, stops
        if stops and stops[-1] == cut and cut.strip():
            assert res.finish_reason == "stop" and cut not in res.text


def test_id_slot_waits_for_its_slot_and_does_not_hold_up_others(llm, engine):
    """llama-server's id_slot: a request for a busy slot waits for that slot (and runs there), while
    a request behind it that takes any slot goes ahead."""
    import time

    p = prompts(llm, 3)
    done: dict[str, float] = {}

    def run(name: str, handle) -> None:
        list(handle)
        done[name] = time.perf_counter()

    a = GenerationRequest(p[0], greedy(150, ignore_eos=True), id_slot=1)
    b = GenerationRequest(p[1], greedy(3, ignore_eos=True), id_slot=1)
    c = GenerationRequest(p[2], greedy(3, ignore_eos=True))
    # Submitted in this order from one thread (no sleeps: on a fast machine a's 150 tokens took
    # less than the gaps did), then each drained on its own thread.
    handles = [(name, engine.submit(req)) for name, req in (("a", a), ("b", b), ("c", c))]
    threads = [threading.Thread(target=run, args=args) for args in handles]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert done["c"] < done["a"] < done["b"], done
    with pytest.raises(ValueError, match="id_slot"):
        engine.submit(GenerationRequest(p[0], greedy(2), id_slot=3))


def test_t_max_predict_ms_ends_a_reply_past_a_newline(llm, engine):
    """llama-server's t_max_predict_ms: once the reply has a newline and has run that long since
    its first token, it ends ("length")."""
    (nl,) = llm.tokenize("\n")
    p = prompts(llm, 1)[0]
    newline = ((nl, 1000.0),)  # every token a newline
    timed = list(engine.submit(GenerationRequest(p, greedy(200, ignore_eos=True, logit_bias=newline),
                                                 t_max_predict_ms=1)))
    assert timed[-1].finish_reason == "length" and timed[-1].usage.completion_tokens < 200
    free = list(engine.submit(GenerationRequest(p, greedy(200, ignore_eos=True, logit_bias=newline))))
    assert free[-1].usage.completion_tokens == 200
