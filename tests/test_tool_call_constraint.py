"""Lazy tool-call constraints (tool_choice auto / required on a harmony model): free text until the
model calls a declared function, then that function's argument schema until <|call|>; hand-built
token sequences over the synthetic harmony vocabulary."""

from __future__ import annotations

import json

import pytest

from hybridmoe.engine.constraints import (
    LazyToolCalls,
    ToolCallSpecs,
    compile_constraint,
    json_schema_spec,
    token_table,
)
from hybridmoe.engine.sampling import Sampler, SamplingParams
from hybridmoe.tokenizer import Tokenizer
from hybridmoe.tokenizer.synthetic import make_vocab

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_metadata(make_vocab(4096, seed=3, preset="tiny"))


def specs(tok: Tokenizer, header: bytes = b"") -> ToolCallSpecs:
    call = tok.token_id("<|call|>")
    spec = compile_constraint(json_schema_spec(SCHEMA, "tools[0].function.parameters", lenient=True, end_ids=(call,)),
                              token_table(tok))
    marks = [tok.token_id(t) for t in ("<|start|>", "<|end|>", "<|message|>", "<|call|>", "<|return|>")]
    return ToolCallSpecs({"lookup": spec}, *marks, header=header)


def feed(c: LazyToolCalls, ids: list[int], constrained: bool) -> None:
    """Advance through ids; each must be allowed, and the mask is there exactly when `constrained`."""
    for i in ids:
        m = c.mask()
        assert (m is not None) == constrained, i
        if m is not None:
            assert bool(m[i]), i
        c.advance(i)


@pytest.mark.parametrize("header", [
    "<|channel|>commentary to=functions.lookup <|constrain|>json",
    " to=functions.lookup<|channel|>commentary json",
    "<|channel|>analysis to=functions.lookup json",
])
def test_arguments_are_held_to_the_schema_only_inside_a_call(tok, header):
    enc = lambda text: tok.encode(text, allow_special=True)  # noqa: E731
    c = LazyToolCalls(specs(tok), token_table(tok), tok.token_bytes)
    feed(c, enc("<|channel|>analysis<|message|>Need verse to=functions.lookup {bad json<|end|>"), constrained=False)
    feed(c, enc("<|start|>assistant" + header + "<|message|>"), constrained=False)
    mask = c.mask()
    assert mask is not None and not bool(mask[enc("x")[0]]) and not bool(mask[tok.token_id("<|call|>")])
    feed(c, enc('{"n": 5}'), constrained=True)
    assert bool(c.mask()[tok.token_id("<|call|>")])  # complete: the call may end
    feed(c, [tok.token_id("<|call|>")], constrained=True)
    feed(c, enc("<|start|>assistant<|channel|>final<|message|>free text {"), constrained=False)


def test_unknown_function_and_required_header(tok):
    enc = lambda text: tok.encode(text, allow_special=True)  # noqa: E731
    c = LazyToolCalls(specs(tok), token_table(tok), tok.token_bytes)
    feed(c, enc("<|channel|>commentary to=functions.other json<|message|>{\"x\": 1}<|call|>"), constrained=False)
    # tool_choice "required": the prompt already wrote the start of the header
    c = LazyToolCalls(specs(tok, b"<|channel|>commentary to=functions"), token_table(tok), tok.token_bytes)
    feed(c, enc(".lookup json<|message|>"), constrained=False)
    assert c.mask() is not None


def test_greedy_sampling_inside_a_call_yields_valid_arguments(tok):
    """Random logits through the sampler: whatever the model prefers, the call's text parses and
    fits the schema, and it ends with <|call|>."""
    import torch

    enc = lambda text: tok.encode(text, allow_special=True)  # noqa: E731
    call = tok.token_id("<|call|>")
    for seed in range(5):
        c = LazyToolCalls(specs(tok), token_table(tok), tok.token_bytes)
        feed(c, enc("<|channel|>commentary to=functions.lookup json<|message|>"), constrained=False)
        sampler, gen = Sampler(SamplingParams(temperature=0.0)), torch.Generator().manual_seed(seed)
        out: list[int] = []
        for step in range(96):
            logits = torch.randn(tok.vocab_size, generator=gen)
            if step >= 24:  # then prefer ending: random digits could go on forever
                logits[[call, *enc("}")]] += 100.0
            t = sampler.sample(logits, c)
            c.advance(t)
            if t == call:
                break
            out.append(t)
        assert t == call and c.mask() is None, tok.decode(out)
        args = json.loads(tok.decode(out))
        assert set(args) == {"n"} and isinstance(args["n"], int), args
