"""The reasoning budget: its state machine on token sequences, and the engine writing the forced
close on a real model (the thinking's opening is scripted: a random model writes no harmony)."""

from __future__ import annotations

import pytest

from hybridmoe.engine.reasoning_budget import BudgetState, ReasoningBudget

START, END = (1, 2, 3), (9,)
BUDGET = ReasoningBudget(START, END, (7, 8) + END, 3)


def run(state: BudgetState, sampled: list[int]) -> list[int]:
    """The reply the state makes of these sampled tokens (forced ones take a sample's place)."""
    out, it = [], iter(sampled)
    while True:
        t = state.next_forced()
        if t is None:
            t = next(it, None)
            if t is None:
                return out
        state.seen(t)
        out.append(t)


def test_thinking_past_the_budget_is_closed_with_the_message():
    assert run(BudgetState(BUDGET, [0, 0]), [1, 2, 3, 4, 5, 6, 50, 51]) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 50, 51]


def test_thinking_that_ends_in_time_is_left_alone():
    s = BudgetState(BUDGET, [0])
    assert run(s, [1, 2, 3, 4, 9, 50]) == [1, 2, 3, 4, 9, 50] and s.used == 1 and not s.inside


def test_each_thinking_section_has_its_own_budget():
    """As llama-server: a section that ended in time, then one cut, then one cut again."""
    reply = run(BudgetState(BUDGET, []), [1, 2, 3, 4, 5, 9, 1, 2, 3, 6, 6, 6, 1, 2, 3, 4, 4, 4, 60])
    assert reply == [1, 2, 3, 4, 5, 9, 1, 2, 3, 6, 6, 6, 7, 8, 9, 1, 2, 3, 4, 4, 4, 7, 8, 9, 60]


def test_a_prompt_ending_inside_thinking_counts_from_the_reply():
    assert run(BudgetState(BUDGET, [0, 1, 2, 3]), [4, 5, 6, 50]) == [4, 5, 6, 7, 8, 9, 50]
    zero = ReasoningBudget(START, END, END, 0)
    assert run(BudgetState(zero, [1, 2, 3]), [4, 50]) == [9, 4, 50]


def test_sampled_tokens_after_the_close_are_not_counted():
    s = BudgetState(BUDGET, [])
    run(s, [1, 2, 3, 4, 5, 6, 50, 51, 52, 53])
    assert s.used == 3 and not s.inside and s.next_forced() is None


def test_bad_budgets_are_refused():
    with pytest.raises(ValueError):
        ReasoningBudget(START, END, (7, 8), 3)  # forced tokens must end with the end tag
    with pytest.raises(ValueError):
        ReasoningBudget(START, END, END, -1)


def test_the_engine_writes_the_close_on_a_real_model(tiny_llm, monkeypatch):
    from hybridmoe.engine.engine import Engine, GenerationRequest
    from hybridmoe.engine.sampler import SamplingParams
    from tests.server.scripted_serve import script_request, scripted_sampling

    scripted_sampling(monkeypatch)
    def enc(text: str) -> tuple[int, ...]:
        return tuple(tiny_llm.tokenizer.encode(text, allow_special=True))

    start, end = enc("<|channel|>analysis<|message|>"), enc("<|end|>")
    forced = enc(" Enough thinking.") + end
    prompt = tiny_llm.tokenizer.encode("<|start|>user<|message|>Hi<|end|><|start|>assistant", allow_special=True)
    engine = Engine(tiny_llm.loaded, 1, 256, max_queue=2)
    for budget in (5, 0):
        req = GenerationRequest(prompt, SamplingParams(temperature=0.0, max_tokens=40),
                                reasoning_budget=ReasoningBudget(start, end, forced, budget))
        script_request(req.request_id, start)
        ids = [e.token_id for e in engine.run(req) if e.token_id is not None]
        n = len(start) + budget
        assert ids[:len(start)] == list(start) and end[0] not in ids[len(start):n]
        assert ids[n : n + len(forced)] == list(forced)


def test_end_now_closes_the_section_it_is_in():
    """llama-server's reasoning control: no token limit, the close written when asked."""
    unlimited = ReasoningBudget(START, END, (7, 8) + END, None)
    s = BudgetState(unlimited, [])
    assert run(s, [4, 1, 2, 3] + [5] * 50) == [4, 1, 2, 3] + [5] * 50  # never closed by itself
    s = BudgetState(unlimited, [])
    assert not s.end_now()  # not thinking: nothing to close
    out = run(s, [1, 2, 3, 5, 5])
    assert s.end_now() and not s.end_now()  # asked twice: one close
    out += run(s, [6, 60])
    assert out == [1, 2, 3, 5, 5, 7, 8, 9, 6, 60] and not s.inside
    assert not s.end_now()


def test_the_engine_ends_the_thinking_when_asked(tiny_llm, monkeypatch):
    from hybridmoe.engine.engine import Engine, GenerationRequest
    from hybridmoe.engine.sampler import SamplingParams
    from tests.server.scripted_serve import script_request, scripted_sampling

    scripted_sampling(monkeypatch)
    tok = tiny_llm.tokenizer
    start = tuple(tok.encode("<|channel|>analysis<|message|>", allow_special=True))
    end = tuple(tok.encode("<|end|>", allow_special=True))
    thinking = tok.encode(" a" * 40, allow_special=False)
    prompt = tok.encode("<|start|>user<|message|>Hi<|end|><|start|>assistant", allow_special=True)
    engine = Engine(tiny_llm.loaded, 1, 256, max_queue=2)
    req = GenerationRequest(prompt, SamplingParams(temperature=0.0, max_tokens=60),
                            reasoning_budget=ReasoningBudget(start, end, end, None))
    script_request(req.request_id, list(start) + thinking)
    handle = engine.submit(req)
    ids: list[int] = []
    while len(ids) < len(start) + 5:
        engine.step()
        while not handle._q.empty():
            ev = handle._q.get()
            if ev.token_id is not None:
                ids.append(ev.token_id)
    assert handle.end_reasoning()
    at = len(ids)
    while not handle.finished:
        engine.step()
    ids += [ev.token_id for ev in handle if ev.token_id is not None]
    assert ids[:at] == list(start) + thinking[: at - len(start)]
    assert ids[at : at + len(end)] == list(end)  # the next token after the ask closes the thinking
    assert not handle.end_reasoning()  # ended
    plain = GenerationRequest(prompt, SamplingParams(temperature=0.0, max_tokens=2))
    assert not engine.submit(plain).end_reasoning()  # no budget to close with
