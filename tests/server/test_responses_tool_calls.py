"""`/v1/responses` with the tools Codex declares, through a real `hybridmoe serve` (scripted replies,
tests/server/scripted_serve.py): freeform and namespaced calls come back as Codex's item shapes,
streamed and not, and whatever the model writes as a call never fails the request."""

from __future__ import annotations

import json

import pytest

from tests.server.conftest import API_KEY

PATCH = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch\n"
TOOLS = [
    {"type": "custom", "name": "apply_patch", "description": "Edit files.",
     "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch\\n" /(.|\\n)*/'}},
    {"type": "namespace", "name": "agents", "description": "Sub-agents.", "tools": [
        {"type": "function", "name": "close",
         "parameters": {"type": "object", "properties": {"id": {"type": "string"}}}}]},
    {"type": "web_search", "external_web_access": False},
]


def call(name: str, body: str) -> str:
    return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{body}<|call|>"


def post(srv, body: dict) -> dict:
    status, out = srv.request("POST", "/v1/responses", {"model": "tiny-test", "input": "Go", "tools": TOOLS,
                                                       "max_output_tokens": 256, **body})
    assert status == 200, out
    return out


def stream(srv, body: dict) -> list[dict]:
    """The SSE events of a streamed request (the openai SDK does not type custom tool events)."""
    import urllib.request

    data = json.dumps({"model": "tiny-test", "input": "Go", "tools": TOOLS, "max_output_tokens": 256, "stream": True,
                       **body}).encode()
    req = urllib.request.Request(srv.base_url + "/v1/responses", data=data, method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        text = r.read().decode()
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


def test_freeform_and_namespaced_calls_come_back_as_codex_items(scripted_server):
    scripted_server.script(call("apply_patch", json.dumps({"input": PATCH})), call("agents__close", '{"id": "x"}'))
    (item,) = post(scripted_server, {"store": False})["output"]
    assert {k: item[k] for k in ("type", "name", "input", "status")} == \
        {"type": "custom_tool_call", "name": "apply_patch", "input": PATCH, "status": "completed"}
    events = stream(scripted_server, {"store": False})
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(i["type"], i["name"], i["namespace"]) for i in done] == [("function_call", "close", "agents")]
    assert any(e["type"] == "response.function_call_arguments.delta" for e in events)
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["tools"] == TOOLS


def test_a_freeform_call_streams_its_input_once_complete(scripted_server):
    scripted_server.script(call("apply_patch", json.dumps({"input": PATCH})))
    events = stream(scripted_server, {})
    kinds = [e["type"] for e in events]
    assert "response.function_call_arguments.delta" not in kinds  # the JSON wrapper is not the input
    done = next(e for e in events if e["type"] == "response.custom_tool_call_input.done")
    assert done["input"] == PATCH
    assert kinds.index("response.custom_tool_call_input.done") < kinds.index("response.output_item.done")


@pytest.mark.parametrize("store", [True, False])
@pytest.mark.parametrize("reply,expect", [
    (call("apply_patch", "*** Begin Patch\nnot json"), ("custom_tool_call", "input", "*** Begin Patch\nnot json")),
    (call("agents__close", '{"id": '), ("function_call", "arguments", '{"id": ')),
    (call("", '{"a": 1}'), ("message", "text", '{"a": 1}')),
    (call("nobody_declared_this", "oops"), ("function_call", "arguments", "oops")),
    ("<|channel|>commentary to=functions.apply_patch <|constrain|>json<|message|>{\"input\": \"cut<|return|>", (
        "custom_tool_call", "input", '{"input": "cut')),
])
def test_malformed_tool_calls_never_fail_the_request(scripted_server, store, reply, expect):
    """What the model wrote comes back as it wrote it: a freeform input that is not our JSON as
    raw text, broken arguments as they are, a call with no name as text; the status says how the
    reply ended (a call the model ended with <|return|> is still a completed reply)."""
    for streamed in (False, True):
        scripted_server.script(reply)
        body = {"store": store}
        if streamed:
            events = stream(scripted_server, body)
            final = events[-1]["response"]
            assert events[-1]["type"] == "response.completed", events[-1]
        else:
            final = post(scripted_server, body)
        assert final["status"] == "completed" and final["error"] is None
        (item,) = final["output"]
        kind, field, value = expect
        got = item["content"][0]["text"] if kind == "message" else item[field]
        assert (item["type"], got) == (kind, value), item


def test_a_stored_freeform_call_continues_like_a_resent_one(scripted_server):
    """previous_response_id (our store) and store: false (Codex resends the items) give the same
    prompt for the turn after a freeform call."""
    scripted_server.script(call("apply_patch", json.dumps({"input": PATCH})),
                           "<|channel|>final<|message|>Patched.<|return|>")
    first = post(scripted_server, {})
    result = {"type": "custom_tool_call_output", "call_id": first["output"][0]["call_id"], "output": "Done!"}
    second = post(scripted_server, {"previous_response_id": first["id"], "input": [result]})
    assert second["output"][0]["content"][0]["text"] == "Patched."
    resent = [{"role": "user", "content": "Go"}, *first["output"], result]
    status, count = scripted_server.request("POST", "/v1/responses/input_tokens",
                                            {"model": "tiny-test", "input": resent, "tools": TOOLS})
    assert status == 200 and count["input_tokens"] == second["usage"]["input_tokens"], count
