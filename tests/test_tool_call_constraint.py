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
    tool_names_spec,
)
from hybridmoe.engine.sampler import Sampler, SamplingParams
from hybridmoe.tokenizer import Tokenizer
from hybridmoe.tokenizer.synthetic import make_vocab

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_metadata(make_vocab(4096, seed=3, preset="tiny"))


def specs(tok: Tokenizer, header: bytes = b"", names: list[str] | None = None) -> ToolCallSpecs:
    """`names`: tool_choice "required" with these functions declared (all with SCHEMA)."""
    call = tok.token_id("<|call|>")
    spec = compile_constraint(json_schema_spec(SCHEMA, "tools[0].function.parameters", lenient=True, end_ids=(call,)),
                              token_table(tok))
    marks = [tok.token_id(t) for t in ("<|start|>", "<|end|>", "<|message|>", "<|call|>", "<|return|>")]
    name_spec = None
    if names is not None:
        name_spec = compile_constraint(tool_names_spec(names, (tok.token_id("<|message|>"),)), token_table(tok))
    return ToolCallSpecs(dict.fromkeys(names or ["lookup"], spec), *marks, header=header, names=name_spec)


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


def sample_random(tok: Tokenizer, c: LazyToolCalls, seed: int, steps: int,
                  push: list[int] = ()) -> tuple[list[int], int]:
    """Greedy over random logits through the sampler and c, `push` ids favoured, until <|call|>
    (after 24 steps ending is favoured: random digits could go on forever): (tokens, last)."""
    import torch

    call = tok.token_id("<|call|>")
    sampler, gen = Sampler(SamplingParams(temperature=0.0)), torch.Generator().manual_seed(seed)
    out: list[int] = []
    t = -1
    for step in range(steps):
        logits = torch.randn(tok.vocab_size, generator=gen)
        logits[list(push)] += 50.0
        if step >= 24:
            logits[[call, *tok.encode("}", allow_special=True)]] += 100.0
        t = sampler.sample(logits, c)
        c.advance(t)
        if t == call:
            break
        out.append(t)
    return out, t


def test_greedy_sampling_inside_a_call_yields_valid_arguments(tok):
    """Random logits through the sampler: whatever the model prefers, the call's text parses and
    fits the schema, and it ends with <|call|>."""
    enc = lambda text: tok.encode(text, allow_special=True)  # noqa: E731
    call = tok.token_id("<|call|>")
    for seed in range(5):
        c = LazyToolCalls(specs(tok), token_table(tok), tok.token_bytes)
        feed(c, enc("<|channel|>commentary to=functions.lookup json<|message|>"), constrained=False)
        out, t = sample_random(tok, c, seed, 96)
        assert t == call and c.mask() is None, tok.decode(out)
        args = json.loads(tok.decode(out))
        assert set(args) == {"n"} and isinstance(args["n"], int), args


REQUIRED = b"<|channel|>commentary to=functions"


def allows(c: LazyToolCalls, ids: list[int]) -> bool:
    """Whether c lets the model write ids (advancing through the allowed ones)."""
    for i in ids:
        m = c.mask()
        if m is not None and not bool(m[i]):
            return False
        c.advance(i)
    return True


@pytest.mark.parametrize("after", [" <|constrain|>json<|message|>", "<|constrain|>json<|message|>", "<|message|>",
                                   " json<|message|>", " <|message|>"])
def test_required_call_names_a_declared_function(tok, after):
    """tool_choice "required": after the forced `to=functions`, only `.NAME` of a declared function
    (then harmony's content type) may follow; then that function's arguments are held to its schema."""
    enc = lambda text: tok.encode(text, allow_special=True)  # noqa: E731
    c = LazyToolCalls(specs(tok, REQUIRED, ["lookup", "find-verse"]), token_table(tok), tok.token_bytes)
    m = c.mask()
    assert m is not None and not bool(m[tok.token_id("<|message|>")]) and not bool(m[enc("x")[0]])
    assert allows(c, enc(".find-verse"))
    assert not bool(c.mask()[enc("x")[0]])  # ".find-versex" names no function
    assert allows(c, enc(after))
    mask = c.mask()  # inside the call now: the arguments' schema
    assert mask is not None and not bool(mask[enc("x")[0]]) and bool(mask[enc("{")[0]])
    for name in (".other", ".look", ".lookup2", "lookup", ".Lookup", ".lookup <|constrain|>", ".lookup <|constrain|>x",
                 ".lookupjson", ".lookup json json"):
        c = LazyToolCalls(specs(tok, REQUIRED, ["lookup", "find-verse"]), token_table(tok), tok.token_bytes)
        assert not allows(c, enc(name + "<|message|>")), name


def test_required_call_sampled_against_a_wrong_name(tok):
    """Random logits that push hard for an undeclared name: what gets written still calls a declared
    function with schema-valid arguments."""
    enc = lambda text: tok.encode(text, allow_special=True)  # noqa: E731
    call, names = tok.token_id("<|call|>"), ["lookup", "find-verse"]
    for seed in range(5):
        c = LazyToolCalls(specs(tok, REQUIRED, names), token_table(tok), tok.token_bytes)
        out, t = sample_random(tok, c, seed, 128, push=enc(".other_tool"))
        text = REQUIRED.decode() + tok.decode(out)
        assert t == call, text
        header, args = text.split("<|message|>")
        assert header.split(" ")[1].removeprefix("to=functions.") in names, text
        assert set(json.loads(args)) == {"n"}, text
