"""The Responses / Messages request mappings in-process: items -> chat messages -> the harmony
prompt the bundled template renders, effort mapping, the store's bound, Anthropic error bodies."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from hybridmoe.server import messages_api, responses_api
from hybridmoe.server.messages_api import MessagesInput, anthropic_error_body
from hybridmoe.server.jobs import ChatJob
from hybridmoe.server.protocol import APIError
from hybridmoe.server.responses_api import ResponsesRequest, ResponseStore, parse_items
from hybridmoe.tokenizer.chat_template import render_chat
from hybridmoe.tokenizer.synthetic import harmony_template


def render(chat: ChatJob) -> str:
    tools = [t.model_dump(exclude_none=True) for t in chat.tools or ()] or None
    extra = {"reasoning_effort": chat.reasoning_effort} if chat.reasoning_effort else {}
    return render_chat(harmony_template(), [m.for_template() for m in chat.messages], tools=tools, extra_vars=extra)


TOOL = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}


def test_responses_items_render_as_the_harmony_turns_they_came_from():
    req = ResponsesRequest(instructions="Be brief.", reasoning={"effort": "minimal"}, tools=[TOOL], input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Go"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Call f."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
    ])
    chat = responses_api.responses_job(req, [])
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool"]
    assert chat.reasoning_effort == "low"
    prompt = render(chat)
    assert "# Instructions\n\nBe brief." in prompt and "Reasoning: low" in prompt
    assert ("<|start|>assistant<|channel|>analysis<|message|>Call f.<|end|>"
            "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>"
            "<|start|>functions.f to=assistant<|channel|>commentary<|message|>42<|end|>") in prompt
    assert prompt.endswith("<|start|>assistant")


def test_responses_turns_split_at_each_answer():
    items = parse_items([{"role": "user", "content": "a"},
                         {"type": "reasoning", "summary": [{"type": "summary_text", "text": "r1"}]},
                         {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "A"}]},
                         {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "r2"}]},
                         {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}])
    msgs = responses_api.items_to_messages(items)
    assert [(m.role, m.content, m.reasoning_content, bool(m.tool_calls)) for m in msgs] == [
        ("user", "a", None, False), ("assistant", "A", "r1", False), ("assistant", None, "r2", True)]


@pytest.mark.parametrize("effort,expected", [("none", "low"), ("minimal", "low"), ("medium", "medium"),
                                             ("xhigh", "high"), (None, None)])
def test_responses_effort(effort, expected):
    req = ResponsesRequest(input="x", reasoning={"effort": effort} if effort else None)
    assert responses_api.responses_job(req, []).reasoning_effort == expected


def test_store_is_bounded_and_names_a_dropped_ancestor(monkeypatch):
    monkeypatch.setattr(ResponseStore, "MAX_RESPONSES", 2)
    store = ResponseStore()
    out = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "A"}]}]
    store.put("r1", parse_items([{"role": "user", "content": "1"}]), out, None)
    store.put("r2", parse_items([{"role": "user", "content": "2"}]), out, "r1")
    assert [getattr(i, "content", None) for i in store.history("r2")] == ["1", out[0]["content"], "2",
                                                                          out[0]["content"]]
    store.put("r3", parse_items([{"role": "user", "content": "3"}]), out, "r2")  # r1 dropped
    with pytest.raises(APIError) as e:
        store.history("r3")
    assert e.value.status == 400 and "ancestor r1" in e.value.message and e.value.param == "previous_response_id"


def test_stores_sharing_a_responses_dir_continue_each_others_chains(tmp_path, monkeypatch):
    """--responses-dir: two replicas' stores over one directory; a chain started on one is read by
    the other (and by a restarted one), oldest item first; a pruned file is a missing ancestor."""
    from hybridmoe.server.response_files import ResponseFiles

    a, b = ResponseStore(ResponseFiles(tmp_path)), ResponseStore(ResponseFiles(tmp_path))
    out = [{"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
           {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "A"}]}]
    a.put("resp_1", parse_items([{"role": "user", "content": "1"}]), out, None)
    b.put("resp_2", parse_items([{"role": "user", "content": "2"}]), out, "resp_1")
    for store in (a, ResponseStore(ResponseFiles(tmp_path))):
        items = store.history("resp_2")
        assert [i.type for i in items] == ["message", "reasoning", "message", "message", "reasoning", "message"]
        assert items[0].content == "1" and items[3].content == "2" and items[1].text("x") == "think"
    assert ResponseFiles(tmp_path).read("../etc/passwd") is None and not list(tmp_path.glob(".tmp-*"))
    monkeypatch.setattr(ResponseFiles, "MAX_FILES", 1)
    ResponseFiles(tmp_path).prune()  # the oldest file goes
    with pytest.raises(APIError) as e:
        ResponseStore(ResponseFiles(tmp_path)).history("resp_2")
    assert "ancestor resp_1" in e.value.message and "--responses-dir" in e.value.message


@pytest.mark.parametrize("thinking,expected", [
    ({"type": "disabled"}, "low"), ({"type": "enabled", "budget_tokens": 1024}, "low"),
    ({"type": "enabled", "budget_tokens": 10000}, "medium"), ({"type": "enabled", "budget_tokens": 31999}, "high"),
    ({"type": "adaptive"}, None), (None, None)])
def test_messages_thinking_sets_the_effort(thinking, expected):
    req = MessagesInput(model="m", messages=[{"role": "user", "content": "x"}], thinking=thinking)
    assert messages_api.messages_job(req, 8).reasoning_effort == expected


def test_messages_blocks_become_chat_turns():
    req = MessagesInput(model="m", system=[{"type": "text", "text": "S"}], tools=[
        {"name": "f", "input_schema": {"type": "object"}}], messages=[
        {"role": "user", "content": "Go"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Call f.", "signature": ""},
                                          {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": "42"}], "is_error": True},
                                     {"type": "text", "text": "and?"}]}])
    chat = messages_api.messages_job(req, 8)
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "user"]
    assert chat.messages[3].content == "Error: 42" and chat.messages[3].tool_call_id == "t1"
    prompt = render(chat)
    assert '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1}<|call|>' in prompt
    assert "<|start|>functions.f to=assistant<|channel|>commentary<|message|>Error: 42<|end|>" in prompt


def test_messages_system_message_joins_the_neighbouring_user_turn():
    """A role "system" message inside `messages` (Claude Code's environment) is rendered where it
    stands, as a <system-reminder> in the user turn before it; the system prompt does not change."""
    env = "# Environment\nWorking directory: /tmp/project"
    req = MessagesInput(model="m", system="S", messages=[
        {"role": "user", "content": "Say hello."},
        {"role": "system", "content": [{"type": "text", "text": env, "cache_control": {"type": "ephemeral"}}]}])
    chat = messages_api.messages_job(req, 8)
    folded = f"Say hello.\n\n<system-reminder>\n{env}\n</system-reminder>"
    assert [(m.role, m.content) for m in chat.messages] == [("system", "S"), ("user", folded)]
    prompt = render(chat)
    assert f"<|start|>user<|message|>{folded}<|end|>" in prompt
    assert prompt.count("# Environment") == 1
    # After an assistant turn it joins the next user turn; after the last one, it is a user turn of
    # its own; one without text is left out.
    req = MessagesInput(model="m", messages=[
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "system", "content": "r1"},
        {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}, {"role": "system", "content": []},
        {"role": "system", "content": "r2"}])
    assert [(m.role, m.content) for m in messages_api.to_messages(req)] == [
        ("user", "a"), ("assistant", "b"), ("user", "<system-reminder>\nr1\n</system-reminder>\n\nc"),
        ("assistant", "d"), ("user", "<system-reminder>\nr2\n</system-reminder>")]
    with pytest.raises(ValidationError, match=r"messages\[1\]\.content\[0\] has type 'image'"):
        MessagesInput(model="m", messages=[{"role": "user", "content": "a"},
                                           {"role": "system", "content": [{"type": "image", "source": {}}]}])


@pytest.mark.parametrize("status,kind", [(400, "invalid_request_error"), (401, "authentication_error"),
                                         (404, "not_found_error"), (500, "api_error"), (503, "overloaded_error")])
def test_anthropic_error_body(status, kind):
    body = anthropic_error_body(APIError(status, "bad thing", param="x"))
    assert body == {"type": "error", "error": {"type": kind, "message": "x: bad thing"}}
