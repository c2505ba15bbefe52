"""JSON mode: the byte-level JSON recognizer and the constrained sampler."""

from __future__ import annotations

import json
import random

import pytest
import torch

from hybridmoe.engine.json_constraint import JsonConstraint
from hybridmoe.engine.json_schema import MAX_WS, SchemaError, SchemaState, compile_schema, object_state
from hybridmoe.engine.sampling import Sampler, SamplingParams


def _feeds(text: str, rng: random.Random) -> bool:
    """Feed `text` in random pieces; True if every piece was accepted."""
    s, data, i = object_state(), text.encode("utf-8"), 0
    while i < len(data):
        n = rng.randint(1, 5)
        if not s.feed(data[i:i + n]):
            return False
        i += n
    return s.done


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 3 else 5)
    if kind == 0:
        return rng.choice([True, False, None])
    if kind == 1:
        return rng.randint(-10**6, 10**6)
    if kind == 2:
        return rng.choice([0.5, -1e-7, 3.25e12, 1e300, -0.0])
    if kind in (3, 4):
        return "".join(rng.choice('ab"\\\n\t\u00e9\u4e2d\U0001f642 /') for _ in range(rng.randrange(6)))
    if kind == 5:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {f"k{i}": _random_value(rng, depth + 1) for i in range(rng.randrange(4))}


def test_accepts_valid_objects_in_any_split():
    rng = random.Random()
    for _ in range(300):
        doc = {f"k{i}": _random_value(rng) for i in range(rng.randrange(5))}
        text = json.dumps(doc, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1, 2]),
                          separators=rng.choice([None, (",", ":")]) if True else None)
        assert _feeds(" \n" + text + "\n ", rng), text


@pytest.mark.parametrize("text", [
    "[1]", '"a"', "1", "{", '{"a":01}', '{"a":1,}', "{,}", '{"a" 1}', '{"a":tru}', '{"a":"\x01"}',
    '{"a":"\\q"}', '{"a":"\\u12G4"}', "{} x", '{"a":-}', '{"a":1.}', '{"a":1e}', '{"a":[1,]}', "{'a':1}",
    '{"a":.5}', '{"a":+1}', '{"a"}', "{}}", '{"a":[}', '{"a":1]}',
])
def test_rejects_invalid_or_incomplete(text):
    s = object_state()
    assert not (s.feed(text.encode()) and s.done), text


def _byte_vocab() -> tuple[list[bytes], int]:
    """A toy vocabulary: every single byte, some multi-byte pieces, and an end token (last id)."""
    toks = [bytes([b]) for b in range(256)] + [b'{"', b'": ', b'", "', b"}}", b"true", b"12", b" ]", b"\\u00"]
    return toks, len(toks)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampler_only_extends_valid_json(temperature):
    """With random logits (the model wants anything), every constrained step stays a valid JSON
    prefix; when the object closes, the end token comes next."""
    toks, end = _byte_vocab()
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    for trial in range(8):
        c = JsonConstraint(lambda t: toks[t], [end], special_ids=[])
        s = Sampler(SamplingParams(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0, seed=trial))
        out = b""
        for _ in range(400):
            logits = torch.randn(end + 1, generator=gen) * 4
            logits[end] += 6  # the end token is likely: the constraint must hold it back
            t = s.sample(logits, c)
            if t == end:
                break
            c.advance(t)
            out += toks[t]
            assert object_state().feed(out)
        else:
            assert not c.done  # ran out of steps with the object still open
            continue
        assert c.done and isinstance(json.loads(out), dict), out


def test_constraint_refuses_specials_and_early_end():
    toks, end = _byte_vocab()
    c = JsonConstraint(lambda t: toks[t], [end], special_ids=[300])
    assert not c.allowed(end) and not c.allowed(300) and c.allowed(ord("{")) and not c.allowed(ord("["))
    for t in b"{}":
        c.advance(t)
    assert c.done and c.allowed(end) and c.allowed(ord(" ")) and not c.allowed(ord("x"))
    with pytest.raises(ValueError):
        c.advance(ord("x"))


@pytest.mark.parametrize("data", [b'{"a":"\xff"}', b'{"a":"\xc0\xaf"}', b'{"a":"\xed\xa0\x80"}', b'{"a":"\xe2\x82"}',
                                  b'{"a":"\xf4\x90\x80\x80"}', b'{"a":"\xf0\x8f\xbf\xbf"}', b'{"\xe9":1}'])
def test_rejects_malformed_utf8_in_strings(data):
    s = object_state()
    assert not (s.feed(data) and s.done), data


def test_utf8_split_across_pieces():
    s = object_state()
    for piece in [b'{"', "é".encode()[:1], "é".encode()[1:], "🙂".encode()[:3], "🙂".encode()[3:], b'":1}']:
        assert s.feed(piece)
    assert s.done


def test_whitespace_runs_are_capped():
    s = object_state()
    assert s.feed(b"{" + b"\n" * MAX_WS + b'"a":' + b" " * MAX_WS + b"1}")
    assert not object_state().feed(b"{" + b"\n" * (MAX_WS + 1))
    assert object_state().feed(b'{"a":"' + b" " * 100 + b'"}')  # inside strings: no cap


# ---------- schemas ----------

PERSON = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", 3]}, "maxItems": 2},
                         "kid": {"anyOf": [{"$ref": "#/$defs/p"}, {"type": "null"}]},
                         "ok": {"type": "boolean"}, "x": {"type": ["number", "string"]}},
          "required": ["name", "age"],
          "$defs": {"p": {"type": "object", "properties": {"x": {"type": "number"}}}}}
TREE = {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties": {
    "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["v"]}}}


def _admits(schema: dict, text: str) -> bool:
    s = SchemaState(compile_schema(schema))
    return s.feed(text.encode()) and s.done


@pytest.mark.parametrize("text", [
    '{"name":"A","age":3}', '{ "age": -3, "name": "\\u00e9\\n" }', '{"name":"A","age":3,"tags":["a",3],"kid":{"x":1.5e3}}',
    '{"name":"A","age":3,"kid":null,"ok":false,"x":"s"}', '{"name":"A","age":0,"kid":{},"x":-0.5}', '{"age":1,"name":""}',
])
def test_schema_admits(text):
    assert _admits(PERSON, text)
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("text", [
    '{"name":"A"}', '{"name":"A","age":3.5}', '{"name":1,"age":3}', '{"name":"A","age":3,"y":1}',
    '{"name":"A","age":3,"tags":["c"]}', '{"name":"A","age":3,"tags":["a","b","a"]}', '{"name":"A","name":"B","age":3}',
    '{"name":"A","age":3,"kid":{"y":1}}', '[1]', '{"name":"A","age":3,"ok":1}', '{"name":"A","age":3,"x":true}',
    '{"name":"A","age":03}', '{"name":"A","age":3,}', '{"name":"A","age":3,"tags":["a",]}',
])
def test_schema_rejects(text):
    assert not _admits(PERSON, text)


def test_recursive_schema():
    assert _admits(TREE, '{"v":1,"kids":[{"v":2,"kids":[]},{"v":3,"kids":[{"v":4}]}]}')
    assert not _admits(TREE, '{"v":1,"kids":[{"kids":[]}]}')  # a nested node without its "v"


@pytest.mark.parametrize("schema,msg", [
    ({"type": "string"}, "root"), ({}, "root"), ({"$ref": "#/$defs/missing"}, "unknown"),
    ({"type": "object", "properties": {"a": {"anyOf": [{"type": "integer"}, {"type": "number"}]}}}, "start alike"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "required"),
    ({"type": "object", "properties": {'q"': {}}}, "escapes"), ({"type": "tuple"}, "unsupported type"),
])
def test_schema_errors(schema, msg):
    with pytest.raises(SchemaError, match=msg):
        compile_schema(schema)


def _conforming(rng: random.Random) -> dict:
    doc = {"name": rng.choice(["", "Ann", "é\"\\", "🙂"]), "age": rng.randint(-99, 99)}
    if rng.random() < 0.5:
        doc["tags"] = rng.sample(["a", "b", 3], rng.randint(0, 2))
    if rng.random() < 0.5:
        doc["kid"] = None if rng.random() < 0.5 else ({"x": rng.uniform(-1e3, 1e3)} if rng.random() < 0.5 else {})
    if rng.random() < 0.5:
        doc["x"] = rng.choice([1.25, -7, "s"])
    keys = list(doc)
    rng.shuffle(keys)
    return {k: doc[k] for k in keys}


def test_schema_admits_fuzzed_conforming_documents():
    rng = random.Random()
    for _ in range(200):
        text = json.dumps(_conforming(rng), ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 2]))
        assert _admits(PERSON, text), text


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampler_follows_the_schema(temperature):
    toks, end = _byte_vocab()
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    root = compile_schema(PERSON)
    finished = 0
    for trial in range(8):
        c = JsonConstraint(lambda t: toks[t], [end], special_ids=[], state=SchemaState(root))
        s = Sampler(SamplingParams(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0, seed=trial))
        out = b""
        for _ in range(300):
            logits = torch.randn(end + 1, generator=gen) * 4
            logits[end] += 6
            t = s.sample(logits, c)
            if t == end:
                break
            c.advance(t)
            out += toks[t]
        if c.done:
            finished += 1
            v = json.loads(out)
            assert {"name", "age"} <= set(v) <= set(PERSON["properties"]) and isinstance(v["age"], int), out
        else:
            assert SchemaState(root).feed(out)
    assert finished >= 1  # random walks close the object most of the time (~85% of trials)


def test_first_byte_index_fallback_picks_what_the_full_scan_picks():
    """The fallback's first-byte shortcut (candidates()) changes the cost, not the choice: greedy
    sampling with and without the index gives the same tokens; candidates cover every allowed one."""
    from hybridmoe.engine.json_constraint import FirstByteIndex

    toks, end = _byte_vocab()
    index = FirstByteIndex(lambda t: toks[t] if t < end else b"", end + 1, special_ids=[end])
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    root = compile_schema(PERSON)
    with_idx = JsonConstraint(lambda t: toks[t], [end], [], state=SchemaState(root), index=index)
    without = JsonConstraint(lambda t: toks[t], [end], [], state=SchemaState(root))
    s = Sampler(SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0))
    for _ in range(200):
        cand = set(with_idx.candidates().tolist())
        assert {t for t in range(end) if with_idx.allowed(t)} <= cand
        logits = torch.randn(end + 1, generator=gen)
        a, b = s.sample(logits, with_idx), s.sample(logits, without)
        assert a == b
        if a == end:
            break
        with_idx.advance(a)
        without.advance(b)


def test_absurdly_deep_schema_is_a_schema_error():
    deep: dict = {"type": "object"}
    for _ in range(5000):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(SchemaError, match="too deeply"):
        compile_schema(deep)
