"""Constrained output through the real server: llama-server's `grammar` (GBNF) and `json_schema`
fields and OpenAI's response_format on /v1/chat/completions and /v1/completions, a named
tool_choice's argument schema, and the 400s (malformed or oversized schemas, bad grammars)."""

from __future__ import annotations

import json

import pytest

from hybridmoe.engine import constraints as C
from hybridmoe.engine.constraints import gbnf_spec, json_schema_spec
from tests.constraint_helpers import admits_prefix

USER = [{"role": "user", "content": "Hi!"}]
YES_NO = 'root ::= ("yes" | "no") "!" [0-9]{1,2}'
POINT = {"type": "object", "properties": {"x": {"type": "integer"}, "tag": {"const": "pt"}},
         "required": ["x", "tag"]}
PAIR = {"type": "array", "prefixItems": [{"type": "integer"}, {"enum": ["a", "b"]}], "items": False, "minItems": 2}


def _chat(server, **body):
    return server.request("POST", "/v1/chat/completions", {"model": "tiny-test", "messages": USER,
                                                           "reasoning_format": "auto", **body})


def _completion(server, **body):
    return server.request("POST", "/v1/completions", {"model": "tiny-test", "prompt": "Hello", **body})


def _check(text: str, finish: str, spec, complete) -> None:
    """A prefix the constraint admits; when the model ended it, a complete text."""
    assert text and admits_prefix(spec, text.encode()), text
    if finish == "stop":
        complete(text)


def _yes_no(text: str) -> None:
    assert text.rstrip("0123456789") in ("yes!", "no!") and text[-1].isdigit(), text


def _point(text: str) -> None:
    v = json.loads(text)
    assert set(v) == {"x", "tag"} and type(v["x"]) is int and v["tag"] == "pt", text


def _pair(text: str) -> None:
    v = json.loads(text)
    assert len(v) == 2 and type(v[0]) is int and v[1] in ("a", "b"), text


CASES = [
    ({"grammar": YES_NO}, gbnf_spec(YES_NO), _yes_no),
    ({"json_schema": POINT}, json_schema_spec(POINT, "s"), _point),
    ({"json_schema": PAIR}, json_schema_spec(PAIR, "s"), _pair),  # tuple form: refused before
    ({"json_schema": {"const": {"x": 1, "tag": "pt"}}}, json_schema_spec({"const": {"x": 1, "tag": "pt"}}, "s"), _point),
    ({"response_format": {"type": "json_object", "schema": POINT}}, json_schema_spec(POINT, "s"), _point),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PAIR}}},
     json_schema_spec(PAIR, "s"), _pair),
]


@pytest.mark.parametrize("fields,spec,complete", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_chat_output_follows_the_constraint(server, fields, spec, complete, seed):
    status, out = _chat(server, max_tokens=24, temperature=1.0, seed=seed, **fields)
    assert status == 200, out
    c = out["choices"][0]
    assert not c["message"].get("reasoning_content")  # harmony: the final channel is forced
    _check(c["message"]["content"], c["finish_reason"], spec, complete)


@pytest.mark.parametrize("fields,spec,complete", CASES)
def test_completion_output_follows_the_constraint(server, fields, spec, complete):
    status, out = _completion(server, max_tokens=24, temperature=1.0, seed=3, **fields)
    assert status == 200, out
    c = out["choices"][0]
    _check(c["text"], c["finish_reason"], spec, complete)


def test_greedy_const_schema_completes(server):
    """A root const leaves one text: greedy decoding writes it and stops."""
    status, out = _completion(server, max_tokens=40, temperature=0, json_schema={"const": [1, "two"]})
    assert status == 200 and out["choices"][0]["finish_reason"] == "stop", out
    assert json.loads(out["choices"][0]["text"]) == [1, "two"]


def test_streamed_chat_follows_the_grammar(client):
    stream = client.chat.completions.create(model="tiny-test", messages=USER, max_tokens=8, temperature=1.0,
                                            seed=2, stream=True, extra_body={"grammar": YES_NO,
                                                                             "reasoning_format": "auto"})
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    _check(text, finish, gbnf_spec(YES_NO), _yes_no)


def test_named_tool_call_with_tuple_parameters(client):
    tools = [{"type": "function", "function": {"name": "put", "parameters": {
        "type": "object", "properties": {"at": {"type": "array", "items": [{"type": "integer"}, {"type": "integer"}],
                                                "minItems": 2, "maxItems": 2}}, "required": ["at"]}}}]
    for seed in range(2):
        r = client.chat.completions.create(model="tiny-test", messages=USER, max_tokens=32, temperature=1.0,
                                           seed=seed, tools=tools,
                                           tool_choice={"type": "function", "function": {"name": "put"}})
        c = r.choices[0]
        if c.finish_reason == "tool_calls":
            at = json.loads(c.message.tool_calls[0].function.arguments)["at"]
            assert len(at) == 2 and all(type(v) is int for v in at), at


NAMED_TOOL = {"type": "function", "function": {"name": "f"}}


def _tool(parameters):
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


BAD = [  # (request fields, the param the 400 names)
    ({"response_format": {"type": "json_object", "schema": 123}}, "response_format.schema"),
    ({"json_schema": 123}, "json_schema"),
    ({"json_schema": "{}"}, "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
     "response_format.json_schema.schema"),
    ({"grammar": "root ::= ("}, "grammar"),
    ({"grammar": "root ::= undefined-rule"}, "grammar"),
    ({"json_schema": {"$defs": [1]}}, "json_schema.$defs"),
    ({"json_schema": {"definitions": "x"}}, "json_schema.definitions"),
    ({"json_schema": {"type": "array", "minItems": [1]}}, "json_schema.minItems"),
    ({"json_schema": {"type": "object", "required": [["a"]]}}, "json_schema.required"),
    ({"json_schema": {"anyOf": 5}}, "json_schema.anyOf"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"anyOf": 5}}}},
     "response_format.json_schema.schema.anyOf"),
    ({"json_schema": {"enum": list(range(C.MAX_SCHEMA_ENUM_VALUES + 1))}}, "json_schema.enum"),
    ({"json_schema": {"type": "object", "properties": {f"p{i}": {} for i in range(C.MAX_OBJECT_PROPERTIES + 1)}}},
     "json_schema.properties"),
    ({"tools": _tool({"$defs": [1]}), "tool_choice": NAMED_TOOL}, "tools[0].function.parameters.$defs"),
    ({"tools": _tool({"type": "object", "required": [["a"]]}), "tool_choice": NAMED_TOOL},
     "tools[0].function.parameters.required"),
    ({"tools": _tool({"anyOf": 5}), "tool_choice": NAMED_TOOL}, "tools[0].function.parameters.anyOf"),
]


@pytest.mark.parametrize("fields,param", BAD)
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_bad_constraints_are_400_naming_the_field(server, fields, param, endpoint):
    if endpoint == "completions" and "tools" in fields:
        pytest.skip("tool_choice exists on chat only")
    status, out = (_chat if endpoint == "chat" else _completion)(server, max_tokens=2, **fields)
    assert status == 400 and out["error"]["param"] == param, out
    assert out["error"]["type"] == "invalid_request_error"


def test_malformed_numbers_in_a_raw_body_are_400(server):
    """`1e400` is valid JSON text that parses to infinity (issue 16: OverflowError before)."""
    body = ('{"model": "tiny-test", "prompt": "Hi", "max_tokens": 2, '
            '"json_schema": {"type": "array", "maxItems": 1e400}}').encode()
    status, out = server.request("POST", "/v1/completions", body)
    assert status == 400 and out["error"]["param"] == "json_schema.maxItems", out


@pytest.mark.parametrize("fields,msg", [
    ({"grammar": YES_NO, "json_schema": POINT}, "send only one"),
    ({"grammar": YES_NO, "response_format": {"type": "json_object"}}, "send only one"),
    ({"grammar": YES_NO, "ignore_eos": True}, "ignore_eos"),
    ({"grammar": 5}, "grammar"),
])
def test_conflicting_or_mistyped_fields(server, fields, msg):
    status, out = _completion(server, max_tokens=2, **fields)
    assert status == 400 and msg in out["error"]["message"], out


def test_server_still_serves_after_the_bad_ones(server):
    status, out = _chat(server, max_tokens=2)
    assert status == 200, out
