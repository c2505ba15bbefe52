"""Responses tools in-process, on request bodies Codex CLI 0.169.0 really sent (tests/data/codex/,
trimmed of ids, paths and its long instructions): namespace functions offered flat, freeform tools
offered as one string held to their grammar, hosted tools left out, calls mapped back to the items
Codex routes, and its resent history rendered as the model wrote it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from hybridmoe.engine.constraints import json_schema_spec
from hybridmoe.server import responses_api, responses_tools
from hybridmoe.server.lark_regex import NotRegular, lark_to_regex
from hybridmoe.server.reply import Block
from hybridmoe.server.responses_api import ResponsesRequest, call_item
from hybridmoe.server.responses_tools import CustomTool, ToolMap, freeform_input, input_pattern
from tests.constraint_helpers import feeds
from tests.server.test_api_mappings import render

DATA = Path(__file__).resolve().parents[1] / "data" / "codex"
PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+Hello from the demo model\n*** End Patch\n"


def codex_request(name: str) -> ResponsesRequest:
    return ResponsesRequest.model_validate(json.loads((DATA / name).read_text()))


def offered(req: ResponsesRequest) -> dict[str, dict]:
    return {t.function.name: t.function.model_dump() for t in req.tool_map().offered}


def test_a_namespace_is_offered_as_its_functions_and_hosted_tools_are_left_out():
    req = codex_request("exec_first_request.json")  # tools: 7 functions, namespace multi_agent_v1, web_search
    names = offered(req)
    assert {"exec_command", "write_stdin", "multi_agent_v1__close_agent", "multi_agent_v1__spawn_agent"} <= set(names)
    assert not any(n == "multi_agent_v1" or "web_search" in n for n in names)
    assert names["multi_agent_v1__close_agent"]["description"].startswith("Tools for spawning and managing sub-agents.")
    assert req.tool_map().dropped == ["web_search"]
    prompt = render(responses_api.responses_job(req, []))
    assert "type multi_agent_v1__close_agent = (_: {" in prompt and "web_search" not in prompt


def test_a_freeform_tool_is_offered_as_one_string_held_to_its_grammar():
    req = codex_request("apply_patch_followup_request.json")  # custom apply_patch, tool_search, web_search
    tools = req.tool_map()
    assert sorted(tools.dropped) == ["tool_search", "web_search"]
    params = offered(req)["apply_patch"]["parameters"]
    assert list(params["properties"]) == ["input"] and params["required"] == ["input"]
    spec = json_schema_spec(params, "p", lenient=True)
    assert feeds(spec, json.dumps({"input": PATCH}).encode())
    assert not feeds(spec, json.dumps({"input": "*** Begin Patch\nrm -rf /\n*** End Patch\n"}).encode())
    assert not feeds(spec, json.dumps({"input": PATCH.replace("+Hello", "Hello")}).encode())


def test_codexs_resent_history_renders_as_the_model_wrote_it():
    """store: false: reasoning (with our encrypted_content), the custom tool call, a call to a
    name the request did not declare, and both outputs come back as input items."""
    prompt = render(responses_api.responses_job(codex_request("apply_patch_followup_request.json"), []))
    call = ("<|start|>assistant<|channel|>commentary to=functions.apply_patch <|constrain|>json<|message|>"
            + json.dumps({"input": PATCH}) + "<|call|>")
    assert "<|channel|>analysis<|message|>I will write the file.<|end|>" + call in prompt
    assert "<|start|>functions.apply_patch to=assistant<|channel|>commentary<|message|>Exit code: 0" in prompt
    assert "to=functions.multi_agent_v1__close_agent <|constrain|>json<|message|>" in prompt
    prompt = render(responses_api.responses_job(codex_request("namespace_followup_request.json"), []))
    assert ("to=functions.multi_agent_v1__close_agent <|constrain|>json<|message|>{\"target\": \"nobody\"}<|call|>"
            "<|start|>functions.multi_agent_v1__close_agent to=assistant") in prompt


def call(name: str, arguments: str) -> Block:
    return Block("call", 1, text=arguments, name=name, call_id="call_1")


def test_calls_come_back_in_the_shape_codex_routes():
    tools = codex_request("exec_first_request.json").tool_map()
    item = call_item(tools.route("multi_agent_v1__close_agent"), call("x", '{"target": "a"}'), "r_1", "completed",
                      True)
    assert (item["type"], item["name"], item["namespace"], item["arguments"]) == \
        ("function_call", "close_agent", "multi_agent_v1", '{"target": "a"}')
    assert tools.route("close_agent").namespace == "multi_agent_v1"  # its bare name is unique: Codex's resolution
    plain = call_item(tools.route("exec_command"), call("exec_command", "{}"), "r_1", "completed", True)
    assert "namespace" not in plain and plain["id"].startswith("fc_")
    assert tools.route("nope") == responses_tools.Route("function", "nope")  # undeclared: the client answers it
    tools = codex_request("apply_patch_followup_request.json").tool_map()
    item = call_item(tools.route("apply_patch"), call("apply_patch", json.dumps({"input": PATCH})), "r_1",
                      "completed", True)
    assert (item["type"], item["name"], item["input"], item["id"][:4]) == \
        ("custom_tool_call", "apply_patch", PATCH, "ctc_")


@pytest.mark.parametrize("arguments", ['{"input": "*** Begin', "*** Begin Patch\n", '{"patch": "x"}', "[]"])
def test_a_malformed_freeform_call_keeps_what_the_model_wrote(arguments):
    assert freeform_input(arguments) == arguments


def test_hosted_and_unknown_tool_types_never_fail_a_request(caplog):
    hosted = [{"type": t} for t in ("web_search", "file_search", "image_generation", "code_interpreter", "mcp",
                                    "computer_use_preview", "local_shell", "some_future_tool")]
    req = ResponsesRequest(input="Hi", tools=hosted + [{"type": "namespace", "name": "ns", "tools": [
        {"type": "function", "name": "f"}, {"type": "web_search"}]}])
    with caplog.at_level(logging.INFO, logger="hybridmoe.server.responses_tools"):
        req.tool_map().note_dropped()
        req.tool_map().note_dropped()
    assert [t.function.name for t in req.tool_map().offered] == ["ns__f"]
    notes = [r.message for r in caplog.records if "left out of the prompt" in r.message]
    assert len(notes) <= 1 and all("some_future_tool" in n for n in notes)  # once per process and type


@pytest.mark.parametrize("tools,words", [
    ([{"type": "function"}], "tools[0]"),
    ([{"type": "custom", "name": "c", "format": {"type": "grammar", "syntax": "peg", "definition": "x"}}],
     "tools[0] (custom): format.syntax"),
    ([{"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": ""}]}], "tools[0].tools[0]"),
    (["web_search"], "tools.0"),
])
def test_malformed_declared_tools_are_refused_by_name(tools, words):
    with pytest.raises(ValueError) as e:
        ResponsesRequest(input="Hi", tools=tools)
    assert words in str(e.value)


def test_additional_tools_items_declare_tools_and_redeclaring_replaces():
    """Codex's code-mode models send tools as an input item, again on every turn."""
    extra = {"type": "additional_tools", "role": "developer", "tools": [{"type": "namespace", "name": "functions",
             "tools": [{"type": "custom", "name": "exec", "description": "Run JavaScript"}]}]}
    req = ResponsesRequest(input=[extra, {"role": "user", "content": "Go"}, extra], tools=[])
    tools = req.tool_map()
    assert [t.function.name for t in tools.offered] == ["exec"]  # the default namespace adds no prefix
    assert tools.route("exec") == responses_tools.Route("custom", "exec", "functions")
    chat = responses_api.responses_job(req, [])
    assert [m.role for m in chat.messages] == ["user"]


def test_a_grammar_with_no_regex_leaves_the_string_free():
    recursive = CustomTool(type="custom", name="r", format={"type": "grammar", "syntax": "lark",
                                                            "definition": 'start: "(" start? ")"'})
    assert input_pattern(recursive) is None
    regex = CustomTool(type="custom", name="d", format={"type": "grammar", "syntax": "regex", "definition": "[0-9]+"})
    assert input_pattern(regex) == "^(?:[0-9]+)$"
    assert input_pattern(CustomTool(type="custom", name="t")) is None  # format text: any string


def test_lark_to_regex_covers_the_operators_it_claims():
    grammar = 'start: WORD ("," WORD)* [" !"] "x"~2 NUM\nWORD: "a".."c"+\nNUM: /[0-9]/i\n%import common.LF'
    pattern = lark_to_regex(grammar)
    import re
    assert re.fullmatch(pattern, "ab,c !xx7") and re.fullmatch(pattern, "axx0")
    assert not re.fullmatch(pattern, "ab,xx7") and not re.fullmatch(pattern, "axxx0")
    for bad in ('start: a\na: "x" a?', 'start: "x"\n%ignore " "', "rule: 'x'"):
        with pytest.raises(NotRegular):
            lark_to_regex(bad)


def test_tool_choice_may_name_a_freeform_or_namespaced_tool():
    req = ResponsesRequest(input="Hi", tools=[{"type": "custom", "name": "apply_patch"}, {
        "type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "f"}]}],
        tool_choice={"type": "custom", "name": "apply_patch"})
    assert responses_api.responses_job(req, []).forced_tool == "apply_patch"
    req = req.model_copy(update={"tool_choice": {"type": "function", "name": "f", "namespace": "ns"}})
    assert responses_api.responses_job(req, []).forced_tool == "ns__f"
