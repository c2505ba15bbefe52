"""Reasoning split and tool calls through the real server.

A random model never writes harmony markup, so these replies are scripted (the tests-only seam of
tests/server/scripted_serve.py): the model still runs every step, but the runner emits the given
tokens instead of sampled ones. Everything after the runner (harmony parsing, deltas, tool_calls,
finish_reason, usage) is the production path.
"""

from __future__ import annotations

import json

import pytest

REASONED = ("<|channel|>analysis<|message|>The user greets me.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Hello there!<|return|>")
TOOL_CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|>"
             "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
             '<|message|>{"city": "Paris"}<|call|>')
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
USER = [{"role": "user", "content": "Hi!"}]


@pytest.fixture
def ask(client, server):
    """A chat request whose reply is `scripted` (one harmony text), in reasoning format `fmt`."""
    def ask(scripted: str, fmt: str | None = None, **kw):
        server.script(scripted)
        extra = {} if fmt is None else {"reasoning_format": fmt}
        return client.chat.completions.create(model="tiny-test", messages=kw.pop("messages", USER),
                                              max_tokens=64, temperature=0, extra_body=extra, **kw)

    return ask


def test_server_started_from_the_llama_server_line(server):
    log = server.log()
    assert f"listening on {server.base_url}" in log


def test_reasoning_format_none_returns_raw_harmony(ask):
    r = ask(REASONED)  # the server runs with --reasoning-format none
    msg = r.choices[0].message
    assert msg.content == REASONED.removesuffix("<|return|>")
    assert msg.model_extra.get("reasoning_content") is None
    assert r.choices[0].finish_reason == "stop"


def test_reasoning_format_auto_splits_channels(ask, server):
    r = ask(REASONED, "auto")
    msg = r.choices[0].message
    assert msg.content == "Hello there!"
    assert msg.model_extra["reasoning_content"] == "The user greets me."
    assert r.choices[0].finish_reason == "stop"
    _, tok = server.request("POST", "/tokenize", {"content": REASONED})
    assert r.usage.completion_tokens == len(tok["tokens"])  # the stop token <|return|> included


def test_reasoning_format_auto_streams_reasoning_then_content(ask):
    chunks = list(ask(REASONED, "auto", stream=True))
    kinds, reasoning, content = [], "", ""
    for c in chunks:
        if not c.choices:
            continue
        d = c.choices[0].delta
        r = (d.model_extra or {}).get("reasoning_content")
        if r:
            kinds.append("r")
            reasoning += r
        if d.content:
            kinds.append("c")
            content += d.content
    assert (reasoning, content) == ("The user greets me.", "Hello there!")
    assert kinds == sorted(kinds, reverse=True)  # every reasoning delta before the first content delta
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_tool_call_parsed(ask):
    r = ask(TOOL_CALL, "auto", tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert choice.message.model_extra["reasoning_content"] == "Need the weather."
    assert not choice.message.content


def test_tool_call_streamed(ask):
    calls: dict[int, dict] = {}
    finish = None
    for c in ask(TOOL_CALL, "auto", tools=TOOLS, stream=True):
        if not c.choices:
            continue
        for tc in c.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": "", "id": None})
            if tc.id:
                entry["id"] = tc.id
            if tc.function and tc.function.name:
                entry["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                entry["arguments"] += tc.function.arguments
        finish = c.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["id"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}


def test_tool_result_turn_accepted(ask, server):
    first = ask(TOOL_CALL, "auto", tools=TOOLS).choices[0].message
    call = first.tool_calls[0]
    history = USER + [
        {"role": "assistant", "content": None, "reasoning_content": "Need the weather.",
         "tool_calls": [{"id": call.id, "type": "function",
                         "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'},
    ]
    r = ask(REASONED, "auto", tools=TOOLS, messages=history)
    assert r.choices[0].message.content == "Hello there!"
    status, body = server.request("POST", "/apply-template", {"messages": history, "tools": TOOLS})
    assert status == 200
    prompt = body["prompt"]
    assert "functions.get_weather" in prompt and '{"temp_c": 21}' in prompt and "Need the weather." in prompt
    assert prompt.endswith("<|start|>assistant")


@pytest.mark.parametrize("how", ["field", "kwargs"])
def test_reasoning_effort_reaches_the_template(server, how):
    body = {"messages": USER}
    if how == "field":
        body["reasoning_effort"] = "high"
    else:
        body["chat_template_kwargs"] = {"reasoning_effort": "high"}
    status, out = server.request("POST", "/apply-template", body)
    assert status == 200 and "Reasoning: high" in out["prompt"]


def test_system_and_developer_messages_reach_the_prompt(server):
    msgs = [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hi!"}]
    status, out = server.request("POST", "/apply-template", {"messages": msgs})
    assert status == 200
    assert "<|start|>developer<|message|># Instructions\n\nAnswer in French." in out["prompt"]
    assert "<|start|>user<|message|>Hi!<|end|>" in out["prompt"]


NAMED = {"type": "function", "function": {"name": "get_weather"}}
TOOLS2 = TOOLS + [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


def _prompt_tokens(ask, **kw) -> int:
    return ask("x<|return|>", "auto", **kw).usage.prompt_tokens


@pytest.mark.parametrize("choice,forced", [
    (NAMED, '{"city": "Paris"}<|call|>'),  # header forced up to <|message|>: the model writes the args
    ("required", '.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'),  # and the name
])
def test_tool_choice_forces_a_tool_call(ask, server, choice, forced):
    """tool_choice named / 'required' puts the harmony tool-call header after the prompt's
    <|start|>assistant, so the reply must be a call; the header's tokens count as prompt tokens."""
    r = ask(forced, "auto", tools=TOOLS2, tool_choice=choice)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert not c.message.content and not c.message.model_extra.get("reasoning_content")
    header = ("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>" if choice == NAMED
              else "<|channel|>commentary to=functions")
    _, tok = server.request("POST", "/tokenize", {"content": header})
    assert r.usage.prompt_tokens == _prompt_tokens(ask, tools=TOOLS2) + len(tok["tokens"])


def test_tool_choice_named_streams_the_call(ask):
    calls, finish = {}, None
    for ch in ask('{"city": "Oslo"}<|call|>', "auto", tools=TOOLS2, tool_choice=NAMED, stream=True):
        if not ch.choices:
            continue
        for tc in ch.choices[0].delta.tool_calls or []:
            e = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            e["name"] += (tc.function.name or "") if tc.function else ""
            e["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = ch.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls == {0: {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}


def test_tool_choice_named_raw_format_shows_the_header(ask):
    r = ask('{"city": "Paris"}<|call|>', tools=TOOLS2, tool_choice=NAMED)  # server default: none
    assert r.choices[0].message.content == ('<|channel|>commentary to=functions.get_weather <|constrain|>json'
                                            '<|message|>{"city": "Paris"}')


@pytest.mark.parametrize("body,msg", [
    ({"tool_choice": "required"}, "non-empty 'tools'"),
    ({"tool_choice": NAMED, "tools": TOOLS2[1:]}, "not in 'tools'"),
    ({"tool_choice": {"type": "function"}, "tools": TOOLS}, "tool_choice object"),
    ({"tool_choice": {"type": "function", "function": {"name": ""}}, "tools": TOOLS}, "tool_choice object"),
])
def test_tool_choice_errors(server, body, msg):
    status, out = server.request("POST", "/v1/chat/completions", {"model": "tiny-test", "messages": USER, **body})
    assert status == 400 and msg in out["error"]["message"], out


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                          "mood": {"enum": ["calm", "busy"]}},
          "required": ["name", "age", "mood"]}


@pytest.mark.parametrize("fmt,status,msg", [
    ({"type": "text"}, 200, None),
    ({"type": "json_object"}, 200, None),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}, 200, None),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}, 200, None),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "v": {"anyOf": [{"type": "integer"}, {"type": "number"}]}}}}}, 200, None),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}, 400, "not"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, 400, "needs"),
    ({"type": "yaml"}, 400, "not supported"),
])
def test_response_format_kinds(server, fmt, status, msg):
    body = {"model": "tiny-test", "messages": USER, "max_tokens": 2, "response_format": fmt}
    got, out = server.request("POST", "/v1/chat/completions", body)
    assert got == status, out
    if msg:
        assert msg in out["error"]["message"], out


def test_json_schema_output_follows_the_schema(client):
    """A schema'd reply on a random model, sampled: a prefix the schema admits; complete ones
    parse and carry exactly the required keys with the right types."""
    from hybridmoe.engine.constraints import json_schema_spec
    from tests.constraint_helpers import admits_prefix

    for seed in range(3):
        r = client.chat.completions.create(
            model="tiny-test", messages=USER, max_tokens=64, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
            extra_body={"reasoning_format": "auto"})
        c = r.choices[0]
        text = c.message.content
        assert text and admits_prefix(json_schema_spec(PERSON, "s"), text.encode()), text
        if c.finish_reason == "stop":
            v = json.loads(text)
            assert set(v) == {"name", "age", "mood"} and isinstance(v["age"], int) and v["mood"] in ("calm", "busy")


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_json_mode_output_is_json(client, temperature):
    """response_format json_object on a random model: the answer (final channel, forced after
    <|start|>assistant) is a JSON object text, or its valid prefix when max_tokens cut it."""
    from hybridmoe.engine.constraints import json_object_spec
    from tests.constraint_helpers import admits_prefix

    r = client.chat.completions.create(model="tiny-test", messages=USER, max_tokens=48, temperature=temperature,
                                       response_format={"type": "json_object"},
                                       extra_body={"reasoning_format": "auto"})
    c = r.choices[0]
    assert not c.message.model_extra.get("reasoning_content")
    text = c.message.content
    assert text and admits_prefix(json_object_spec(), text.encode()), text
    if c.finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert c.finish_reason == "length" and r.usage.completion_tokens == 48


@pytest.mark.parametrize("extra,msg", [({"tools": TOOLS, "tool_choice": NAMED}, "cannot be combined"),
                                       ({"ignore_eos": True}, "ignore_eos")])
def test_json_mode_conflicts(server, extra, msg):
    body = {"model": "tiny-test", "messages": USER, "response_format": {"type": "json_object"}, **extra}
    status, out = server.request("POST", "/v1/chat/completions", body)
    assert status == 400 and msg in out["error"]["message"], out


def test_named_tool_call_arguments_follow_the_parameter_schema(client):
    """tool_choice named, sampled from a random model: the arguments are constrained by the
    function's parameters (here one required enum), and the call ends with <|call|>."""
    tools = [{"type": "function", "function": {"name": "set_unit", "parameters": {
        "type": "object", "properties": {"unit": {"enum": ["C", "F"]}}, "required": ["unit"],
        "additionalProperties": False}}}]
    named = {"type": "function", "function": {"name": "set_unit"}}
    done, args = 0, []
    for seed in range(3):
        r = client.chat.completions.create(model="tiny-test", messages=USER, max_tokens=200, temperature=1.0,
                                           seed=seed, tools=tools, tool_choice=named,
                                           extra_body={"reasoning_format": "auto"})
        c = r.choices[0]
        (call,) = c.message.tool_calls
        assert call.function.name == "set_unit"
        if c.finish_reason == "tool_calls":
            assert json.loads(call.function.arguments) in ({"unit": "C"}, {"unit": "F"})
            done += 1
            args.append(call.function.arguments)
    assert done >= 1, done
    assert len(set(args)) > 1 or done < 2, args  # seeds differ: so do the samples


def test_required_tool_call_names_a_declared_function(client):
    """tool_choice "required", sampled from a random model (which knows no harmony): the call names
    one of the declared functions, and its arguments follow that function's parameters."""
    tools = [{"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "properties": {"unit": {"enum": ["C", "F"]}}, "required": ["unit"],
        "additionalProperties": False}}} for n in ("set_unit", "get_unit")]
    names, done = set(), 0
    for seed in range(4):
        r = client.chat.completions.create(model="tiny-test", messages=USER, max_tokens=200, temperature=1.0,
                                           seed=seed, tools=tools, tool_choice="required",
                                           extra_body={"reasoning_format": "auto"})
        c = r.choices[0]
        (call,) = c.message.tool_calls
        assert call.function.name in ("set_unit", "get_unit"), call
        names.add(call.function.name)
        if c.finish_reason == "tool_calls":
            assert json.loads(call.function.arguments) in ({"unit": "C"}, {"unit": "F"})
            done += 1
    assert done >= 1, done


@pytest.mark.parametrize("budget", [3, 0])
def test_reasoning_budget_closes_the_analysis(server, budget):
    """llama-server's reasoning_budget_tokens: after that many analysis tokens the budget message
    and <|end|> are written for the model (the analysis opening is scripted; the rest sampled)."""
    server.script("<|channel|>analysis<|message|>")
    status, r = server.request("POST", "/v1/chat/completions", {
        "messages": USER, "max_tokens": 24, "temperature": 0, "logprobs": True,
        "reasoning_budget_tokens": budget, "reasoning_budget_message": " Enough."})
    assert status == 200, r
    tokens = [e["token"] for e in r["choices"][0]["logprobs"]["content"]]
    opened = tokens.index("<|message|>") + 1
    _, forced = server.request("POST", "/tokenize", {"content": " Enough.<|end|>", "with_pieces": True})
    pieces = [p["piece"] for p in forced["tokens"]]
    assert tokens[opened + budget : opened + budget + len(pieces)] == pieces
    assert "<|end|>" not in tokens[opened : opened + budget]


def test_messages_thinking_budget_is_held(server):
    """Anthropic's thinking.budget_tokens becomes the reasoning budget: the thinking block is what a
    chat request with that budget (and the effort it maps to) thinks."""
    server.script("<|channel|>analysis<|message|>")
    _, chat = server.request("POST", "/v1/chat/completions", {
        "messages": USER, "max_tokens": 40, "temperature": 0, "reasoning_format": "auto",
        "reasoning_effort": "low", "reasoning_budget_tokens": 2})
    server.script("<|channel|>analysis<|message|>")
    status, r = server.request("POST", "/v1/messages", {
        "max_tokens": 40, "temperature": 0, "messages": USER,
        "thinking": {"type": "enabled", "budget_tokens": 2}})
    assert status == 200, r
    thinking = [b["thinking"] for b in r["content"] if b["type"] == "thinking"]
    assert thinking == [chat["choices"][0]["message"]["reasoning_content"]]


def _stream_lines(server, body: dict):
    """The data lines of a streamed chat completion, as they arrive."""
    import urllib.request

    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {server.api_key}"}
    url = server.base_url + "/v1/chat/completions"
    req = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


@pytest.mark.parametrize("armed", [True, False])
def test_reasoning_control_ends_the_thinking_of_a_running_chat(server, armed):
    """llama-server's POST /v1/chat/completions/control {id, action: reasoning_end}: the analysis of
    a running completion that armed it (reasoning_control) is closed at once; the model goes on."""
    long_thinking = " a" * 600
    server.script("<|channel|>analysis<|message|>" + long_thinking)
    body = {"messages": USER, "max_tokens": 700, "temperature": 0, "stream": True, "reasoning_format": "auto",
            "reasoning_control": armed}
    reasoning, answers, finish = "", [], None
    for chunk in _stream_lines(server, body):
        delta = chunk["choices"][0]["delta"] if chunk["choices"] else {}
        reasoning += delta.get("reasoning_content") or ""
        finish = chunk["choices"][0].get("finish_reason") if chunk["choices"] else finish
        if not answers and reasoning.count("a") >= 3:
            status, answer = server.request("POST", "/v1/chat/completions/control",
                                            {"id": chunk["id"], "action": "reasoning_end"})
            assert status == 200, answer
            answers.append((chunk["id"], answer))
    cmpl_id, answer = answers[0]
    if armed:
        assert answer == {"success": True}
        assert reasoning.startswith(" a a a") and not reasoning.startswith(" a" * 100), reasoning  # closed at once
    else:
        assert answer == {"success": False, "message": "reasoning control not enabled for this completion"}
        assert reasoning.startswith(long_thinking)
    assert finish is not None
    status, after = server.request("POST", "/v1/chat/completions/control", {"id": cmpl_id, "action": "reasoning_end"})
    assert (status, after) == (200, {"success": False, "message": "no active completion for this id"})


@pytest.mark.parametrize("body,param", [({"action": "reasoning_end"}, "id"),
                                        ({"id": "chatcmpl-x", "action": "stop"}, "action")])
def test_reasoning_control_bad_requests(server, body, param):
    status, err = server.request("POST", "/v1/chat/completions/control", body)
    assert status == 400 and err["error"]["param"] == param, err
