"""JSON mode and JSON schemas through the constrained-decoding engine (engine/constraints.py):
which texts a schema admits, the constrained sampler, and the schema checks and limits."""

from __future__ import annotations

import json
import random

import pytest
import torch

from hybridmoe.engine import constraints as C
from hybridmoe.engine.constraints import ConstraintError, check_schema, json_object_spec, json_schema_spec
from hybridmoe.engine.sampler import Sampler, SamplingParams
from tests.constraint_helpers import VOCAB, constraint, feeds, random_logits

ANY_OBJECT = json_object_spec()


def _pieces_feed(spec, text: str, rng: random.Random) -> bool:
    """Feed `text` as multi-byte pieces where the toy vocabulary has them, else byte by byte."""
    c, data, i = constraint(spec), text.encode("utf-8"), 0
    while i < len(data):
        piece = next((k for k, t in enumerate(VOCAB.tokens[:VOCAB.special])
                      if len(t) > 1 and data.startswith(t, i) and rng.random() < 0.7), data[i])
        if not bool(c.mask()[piece]):
            return False
        c.advance(piece)
        i += len(VOCAB.tokens[piece])
    return c.done


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
    rng = random.Random(1)
    for _ in range(150):
        doc = {f"k{i}": _random_value(rng) for i in range(rng.randrange(5))}
        text = json.dumps(doc, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1, 2]),
                          separators=rng.choice([None, (",", ":")]))
        assert _pieces_feed(ANY_OBJECT, text, rng), text


@pytest.mark.parametrize("text", [
    "[1]", '"a"', "1", "{", '{"a":01}', '{"a":1,}', "{,}", '{"a" 1}', '{"a":tru}', '{"a":"\x01"}',
    '{"a":"\\q"}', '{"a":"\\u12G4"}', "{} x", '{"a":-}', '{"a":1.}', '{"a":1e}', '{"a":[1,]}', "{'a':1}",
    '{"a":.5}', '{"a":+1}', '{"a"}', "{}}", '{"a":[}', '{"a":1]}',
])
def test_rejects_invalid_or_incomplete(text):
    assert not feeds(ANY_OBJECT, text.encode()), text


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampler_only_extends_valid_json(temperature):
    """With random logits (the model wants anything), every constrained step stays a valid JSON
    prefix; when the object closes, the end token comes next."""
    gen = torch.Generator().manual_seed(7)
    finished = 0
    for trial in range(8):
        c = constraint(ANY_OBJECT)
        s = Sampler(SamplingParams(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0, seed=trial))
        out = b""
        for _ in range(300):
            t = s.sample(random_logits(gen), c)
            if t == VOCAB.end:
                break
            c.advance(t)
            out += VOCAB.tokens[t]
        else:
            assert not c.done  # ran out of steps with the object still open
            continue
        finished += 1
        assert c.done and isinstance(json.loads(out), dict), out
    assert finished >= 1


def test_constraint_refuses_specials_and_early_end():
    c = constraint(ANY_OBJECT)
    m = c.mask()
    assert not m[VOCAB.end] and not m[VOCAB.special] and m[ord("{")] and not m[ord("[")]
    for t in b"{}":
        c.advance(t)
    m = c.mask()
    assert c.done and m[VOCAB.end] and not m[ord("x")]
    with pytest.raises(ValueError):
        c.advance(ord("x"))


@pytest.mark.parametrize("data", [b'{"a":"\xff"}', b'{"a":"\xc0\xaf"}', b'{"a":"\xed\xa0\x80"}', b'{"a":"\xe2\x82"}',
                                  b'{"a":"\xf4\x90\x80\x80"}', b'{"a":"\xf0\x8f\xbf\xbf"}', b'{"\xe9":1}'])
def test_rejects_malformed_utf8_in_strings(data):
    assert not feeds(ANY_OBJECT, data), data


def test_utf8_split_across_tokens():
    assert feeds(ANY_OBJECT, '{"é🙂":"中"}'.encode())


def test_whitespace_between_tokens_is_bounded():
    """As llama.cpp's converter: one space, or a newline and up to 20 of indentation, per gap."""
    assert feeds(ANY_OBJECT, b"{\n" + b" " * 20 + b'"a": 1,\n\t"b":[1, 2]\n}')
    assert not feeds(ANY_OBJECT, b"{\n" + b" " * 21 + b'"a":1}')
    assert not feeds(ANY_OBJECT, b'{"a":  1}') and not feeds(ANY_OBJECT, b'{"a":\n\n1}')
    assert feeds(ANY_OBJECT, b'{"a":"' + b" " * 100 + b'"}')  # inside strings: no cap


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




def _admits(schema, text: str) -> bool:
    return feeds(json_schema_spec(schema, "s"), text.encode())


@pytest.mark.parametrize("text", [
    '{"name":"A","age":3}', '{ "name": "\\u00e9\\n", "age": -3 }', '{"name":"A","age":3,"tags":["a",3],"kid":{"x":1.5e3}}',
    '{"name":"A","age":3,"kid":null,"ok":false,"x":"s"}', '{"name":"A","age":0,"kid":{},"x":-0.5}', '{"name":"","age":1}',
])
def test_schema_admits(text):
    assert _admits(PERSON, text)
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("text", [
    '{"name":"A"}', '{"name":"A","age":3.5}', '{"name":1,"age":3}', '{"name":"A","age":3,"y":1}',
    '{"name":"A","age":3,"tags":["c"]}', '{"name":"A","age":3,"tags":["a","b","a"]}', '{"name":"A","name":"B","age":3}',
    '{"name":"A","age":3,"kid":{"y":1}}', '[1]', '{"name":"A","age":3,"ok":1}', '{"name":"A","age":3,"x":true}',
    '{"name":"A","age":03}', '{"age":1,"name":""}',  # keys come in the schema's order (as llama.cpp's)
    '{"name":"A","age":3,}', '{"name":"A","age":3,"tags":["a",]}',
])
def test_schema_rejects(text):
    assert not _admits(PERSON, text)


def test_recursive_schema():
    assert _admits(TREE, '{"v":1,"kids":[{"v":2,"kids":[]},{"v":3,"kids":[{"v":4}]}]}')
    assert not _admits(TREE, '{"v":1,"kids":[{"kids":[]}]}')  # a nested node without its "v"


@pytest.mark.parametrize("schema,yes,no", [
    ({"const": {"a": [1, "x"]}}, ['{"a":[1,"x"]}', '{ "a": [1, "x"] }'], ['{"a":[1]}', '{"a":[1,"y"]}', "1"]),
    ({"enum": [1, "two", None]}, ["1", '"two"', "null"], ["2", '"tw"', "true"]),
    ({"type": "array", "items": [{"type": "integer"}, {"type": "string"}]},  # draft-07 tuple form
     ["[1,\"a\"]", "[1]", "[]", '[1,"a",true]'], ['["a",1]', "[1,2]"]),
    ({"type": "array", "items": [{"type": "integer"}], "additionalItems": False}, ["[1]"], ["[1,2]"]),
    ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "boolean"}], "items": False},
     ["[1,true]"], ["[1,true,1]", "[true]"]),
    ({"type": "string"}, ['"x"'], ["1", "x"]),
    ({}, ["1", '"s"', "[]", '{"a":null}'], ["x", "{"]),
    ({"type": "object", "properties": {'q"\\': {"type": "integer"}}, "required": ['q"\\']},
     ['{"q\\"\\\\":1}'], ["{}"]),
    ({"anyOf": [{"type": "integer"}, {"type": "number"}]}, ["1", "1.5"], ['"1"']),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True},
     ['{"a":1,"b":[]}'], ['{"a":"x"}']),
])
def test_schemas_the_old_recognizer_refused(schema, yes, no):
    for text in yes:
        assert _admits(schema, text), text
    for text in no:
        assert not _admits(schema, text), text


def _conforming(rng: random.Random) -> dict:
    doc = {"name": rng.choice(["", "Ann", "é\"\\", "🙂"]), "age": rng.randint(-99, 99)}
    if rng.random() < 0.5:
        doc["tags"] = rng.sample(["a", "b", 3], rng.randint(0, 2))
    if rng.random() < 0.5:
        doc["kid"] = None if rng.random() < 0.5 else ({"x": rng.uniform(-1e3, 1e3)} if rng.random() < 0.5 else {})
    if rng.random() < 0.5:
        doc["x"] = rng.choice([1.25, -7, "s"])
    return {k: doc[k] for k in PERSON["properties"] if k in doc}  # in the schema's order


def test_schema_admits_fuzzed_conforming_documents():
    rng = random.Random(3)
    for _ in range(100):
        text = json.dumps(_conforming(rng), ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 2]))
        assert _admits(PERSON, text), text


def _conforms_to_person(v) -> bool:
    """An independent check of PERSON (the slower reference for the sampler test)."""
    props = PERSON["properties"]
    if not isinstance(v, dict) or not {"name", "age"} <= set(v) <= set(props):
        return False
    ok = isinstance(v["name"], str) and type(v["age"]) is int
    ok &= "tags" not in v or (isinstance(v["tags"], list) and len(v["tags"]) <= 2
                              and all(t in ("a", "b", 3) and type(t) is not float for t in v["tags"]))
    ok &= "kid" not in v or v["kid"] is None or (isinstance(v["kid"], dict) and set(v["kid"]) <= {"x"}
                                                 and all(type(x) in (int, float) for x in v["kid"].values()))
    ok &= "ok" not in v or type(v["ok"]) is bool
    ok &= "x" not in v or type(v["x"]) in (int, float, str)
    return ok


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampler_follows_the_schema(temperature):
    gen = torch.Generator().manual_seed(11)
    spec = json_schema_spec(PERSON, "s")
    finished = 0
    for trial in range(8):
        c = constraint(spec)
        s = Sampler(SamplingParams(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0, seed=trial))
        out = b""
        for _ in range(300):
            t = s.sample(random_logits(gen), c)
            if t == VOCAB.end:
                break
            c.advance(t)
            out += VOCAB.tokens[t]
        if c.done:
            finished += 1
            assert _conforms_to_person(json.loads(out)), out
    assert finished >= 1


# ---------- malformed schemas and limits: ConstraintError naming the field ----------

@pytest.mark.parametrize("schema,param", [
    ({"$defs": [1]}, "s.$defs"), ({"definitions": "x"}, "s.definitions"),
    ({"type": "array", "minItems": [1]}, "s.minItems"), ({"type": "array", "maxItems": float("inf")}, "s.maxItems"),
    ({"type": "array", "maxItems": 1.5}, "s.maxItems"), ({"type": "array", "maxItems": -1}, "s.maxItems"),
    ({"type": "array", "maxItems": 2**64}, "s.maxItems"),
    ({"type": "object", "required": [["a"]]}, "s.required"), ({"anyOf": 5}, "s.anyOf"), ({"oneOf": []}, "s.oneOf"),
    ({"properties": {"a": 3}}, "s.properties.a"), ({"type": "tuple"}, "s.type"), ({"type": []}, "s.type"),
    ({"items": "x"}, "s.items"), ({"enum": 3}, "s.enum"), ({"minimum": "0"}, "s.minimum"), ({"$ref": 1}, "s.$ref"),
    ({"type": "object", "properties": {"a": {"$defs": [1]}}}, "s.properties.a.$defs"),
    (123, "s"), ("x", "s"), (None, "s"), ([{}], "s"),
])
def test_malformed_schema_shapes_name_the_field(schema, param):
    with pytest.raises(ConstraintError) as e:
        json_schema_spec(schema, "s")
    assert e.value.param == param and param in str(e.value)


def test_unknown_ref_and_unsupported_keyword_refused_by_the_compiler():
    for schema in ({"$ref": "#/$defs/missing"}, {"not": {"type": "string"}}):
        with pytest.raises(ConstraintError):
            C.compile_constraint(json_schema_spec(schema, "s"), C.token_table(VOCAB))
    # Lenient (tool parameters): the keyword is ignored, the rest enforced.
    C.compile_constraint(json_schema_spec({"not": {"type": "string"}}, "s", lenient=True), C.token_table(VOCAB))


@pytest.mark.parametrize("schema,what", [
    ({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(C.MAX_OBJECT_PROPERTIES + 1)}},
     "per object"),
    ({"type": "object", "properties": {f"o{j}": {"type": "object", "properties": {f"p{i}": {} for i in range(100)}}
                                       for j in range(C.MAX_SCHEMA_PROPERTIES // 100)}}, "properties in all"),
    ({"enum": list(range(C.MAX_SCHEMA_ENUM_VALUES + 1))}, "enum values"),
    ({"anyOf": [{"type": "integer"}] * (C.MAX_SCHEMA_NODES + 1)}, "subschemas"),
])
def test_size_limits(schema, what):
    with pytest.raises(ConstraintError, match=what):
        json_schema_spec(schema, "s")


def test_object_at_the_property_limit_is_served():
    """Every key position of a maximal object stays within llguidance's parser limits."""
    n = C.MAX_OBJECT_PROPERTIES
    spec = json_schema_spec({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}, "s")
    assert feeds(spec, ('{"p0":1,"p7":2,"p%d":3}' % (n - 1)).encode())
    assert feeds(spec, ("{" + ",".join(f'"p{i}":{i}' for i in range(0, n, 37)) + "}").encode())


def test_depth_limit_and_absurd_nesting():
    deep: dict = {"type": "integer"}
    for _ in range(C.MAX_SCHEMA_DEPTH):
        deep = {"type": "object", "properties": {"a": deep}}
    json_schema_spec(deep, "s")  # at the limit: fine
    for _ in range(5000):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(ConstraintError, match="deeper than"):
        json_schema_spec(deep, "s")


def test_normalizations_do_not_touch_the_callers_schema():
    schema = {"type": "array", "items": [{"type": "integer"}], "properties": {"a": {}}}
    before = json.dumps(schema)
    out = check_schema(schema, "s")
    assert json.dumps(schema) == before
    assert out["prefixItems"] == [{"type": "integer"}] and "items" not in out and out["additionalProperties"] is False
