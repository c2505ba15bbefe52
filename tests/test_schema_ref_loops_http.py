"""A JSON schema whose `$ref` loops without reading input, sent to a real `hybridmoe serve`:
400 naming the field (it compiled, then failed at the first mask in sampling: a 500 before).
The server and its request helper are tests/server/conftest.py's own, imported."""

from __future__ import annotations

import pytest

from tests.server.conftest import server, served_model  # noqa: F401 (fixtures, used by name)

SELF = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
MUTUAL = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}
TREE = {"type": "object", "properties": {"child": {"$ref": "#"}, "v": {"type": "integer"}}}


def _tool(parameters: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


def _chat(srv, **fields) -> tuple[int, dict | str]:
    body = {"model": "tiny-test", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 8,
            "reasoning_format": "auto", **fields}  # the server runs with --reasoning-format none
    return srv.request("POST", "/v1/chat/completions", body)


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "loop", "schema": SELF}}},
     "response_format.json_schema.schema.$defs.a.$ref"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "loop", "schema": MUTUAL}}, "stream": True},
     "response_format.json_schema.schema.$defs.a.$ref"),
    ({"json_schema": MUTUAL}, "json_schema.$defs.a.$ref"),
    ({"response_format": {"type": "json_object", "schema": {"$ref": "#"}}}, "response_format.schema.$ref"),
    # Behind a property: reached only once the model wrote `{"x":`.
    ({"json_schema": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "$defs": SELF["$defs"]}},
     "json_schema.$defs.a.$ref"),
    ({"tools": _tool(SELF), "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tools[0].function.parameters.$defs.a.$ref"),
    ({"tools": _tool(MUTUAL), "tool_choice": "auto"}, "tools[0].function.parameters.$defs.a.$ref"),
    ({"grammar": "root ::= root"}, "grammar"),
])
def test_looping_schema_is_400_naming_the_field(server, fields, param):  # noqa: F811 (the fixture)
    status, out = _chat(server, **fields)
    assert status == 400, out
    assert isinstance(out, dict) and out["error"]["param"] == param, out
    assert out["error"]["type"] == "invalid_request_error"
    assert param in out["error"]["message"]


def test_recursive_schema_that_reads_input_is_served(server):  # noqa: F811 (the fixture)
    """A tree recurses through a property: served, the reply a prefix of a tree (or a whole one)."""
    status, out = _chat(server, json_schema=TREE, temperature=1.0, seed=1)
    assert status == 200, out
    choice = out["choices"][0]
    assert choice["message"]["content"].startswith("{"), choice
    assert choice["finish_reason"] in ("stop", "length")
