"""`/v1/responses` through the official `openai` SDK against a real `hybridmoe serve` process.

A random model writes no harmony, so replies are scripted (tests/server/scripted_serve.py): the
engine emits the given tokens; parsing, items, events, usage and the store are the production path.
"""

from __future__ import annotations

import json

import pytest

from tests.server.conftest import API_KEY
from tests.server.replies import ANSWER, REASONED, TOOL_CALL, chat_prompt_tokens, n_tokens

TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture
def client(scripted_server):
    from openai import OpenAI

    scripted_server.script()  # nothing left over from a failed test
    return OpenAI(base_url=scripted_server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_analysis_and_final_become_reasoning_and_message_items(client, scripted_server):
    srv = scripted_server
    scripted_server.script(REASONED)
    r = client.responses.create(model="tiny-test", input="Hi!", max_output_tokens=64, temperature=0)
    assert r.status == "completed" and r.object == "response" and r.id.startswith("resp_")
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and [c.text for c in reasoning.content] == ["The user greets me."]
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert [c.text for c in message.content] == ["Hello there!"] and r.output_text == "Hello there!"
    assert r.usage.output_tokens == n_tokens(srv, REASONED)  # <|return|> included
    # analysis content + its <|end|>
    assert r.usage.output_tokens_details.reasoning_tokens == n_tokens(srv, "The user greets me.") + 1
    assert r.usage.input_tokens == chat_prompt_tokens(srv, [{"role": "user", "content": "Hi!"}])
    assert r.usage.input_tokens_details.cached_tokens >= 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    count = client.responses.input_tokens.count(model="tiny-test", input="Hi!")
    assert count.input_tokens == r.usage.input_tokens


def test_stream_follows_the_documented_event_sequence(client, scripted_server):
    scripted_server.script(REASONED)
    with client.responses.stream(model="tiny-test", input="Hi!", max_output_tokens=64) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    collapsed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert collapsed == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (reasoning, text) == ("The user greets me.", "Hello there!")
    assert final.output_text == "Hello there!" and final.output[0].content[0].text == "The user greets me."
    assert final.usage.output_tokens > 0 and events[0].response.id == final.id


def test_function_call_round_trip(client, scripted_server):
    srv = scripted_server
    scripted_server.script(TOOL_CALL, ANSWER)
    r1 = client.responses.create(model="tiny-test", input=USER, tools=TOOLS, max_output_tokens=64)
    assert [o.type for o in r1.output] == ["reasoning", "function_call"]
    assert r1.output[0].content[0].text == "Need the weather."
    call = r1.output[1]
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert r1.usage.output_tokens_details.reasoning_tokens == n_tokens(srv, "Need the weather.") + 1

    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 21}'}
    history = USER + [o.model_dump(exclude_none=True) for o in r1.output] + [result]
    r2 = client.responses.create(model="tiny-test", input=history, tools=TOOLS, max_output_tokens=64)
    assert r2.output_text == "It is 21 C in Paris." and [o.type for o in r2.output] == ["message"]
    # The prompt is the one chat completions renders for the same turn (reasoning kept before the call).
    chat = USER + [
        {"role": "assistant", "content": None, "reasoning_content": "Need the weather.",
         "tool_calls": [{"id": call.call_id, "type": "function",
                         "function": {"name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"temp_c": 21}'}]
    assert r2.usage.input_tokens == chat_prompt_tokens(srv, chat, TOOLS)


def test_stateless_round_trip_with_encrypted_content(client, scripted_server):
    """store: false and include: ["reasoning.encrypted_content"] (Codex's way): the reasoning item
    carries its text there, and an item given back with only that field (no content) restores the
    same prompt as one given back whole."""
    srv = scripted_server
    scripted_server.script(TOOL_CALL, ANSWER, ANSWER)
    r1 = client.responses.create(model="tiny-test", input=USER, tools=TOOLS, max_output_tokens=64, store=False,
                                 include=["reasoning.encrypted_content"])
    reasoning, call = r1.output
    assert reasoning.encrypted_content and reasoning.content[0].text == "Need the weather."
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 21}'}
    whole = reasoning.model_dump(exclude_none=True)
    bare = {k: v for k, v in whole.items() if k != "content"}
    tokens = []
    for item in (whole, bare):
        r = client.responses.create(model="tiny-test", input=USER + [item, call.model_dump(exclude_none=True), result],
                                    tools=TOOLS, max_output_tokens=64, store=False)
        tokens.append(r.usage.input_tokens)
    assert tokens[0] == tokens[1], tokens
    plain = client.responses.create(model="tiny-test", input="Hi", max_output_tokens=8)
    assert all(getattr(o, "encrypted_content", None) is None for o in plain.output)  # only when asked


def test_previous_response_id_continues_a_stored_conversation(client, scripted_server):
    scripted_server.script(TOOL_CALL, ANSWER, ANSWER)
    r1 = client.responses.create(model="tiny-test", input=USER, tools=TOOLS, max_output_tokens=64)
    call = r1.output[1]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 21}'}
    chained = client.responses.create(model="tiny-test", previous_response_id=r1.id, input=[result], tools=TOOLS,
                                      max_output_tokens=64)
    full = USER + [o.model_dump(exclude_none=True) for o in r1.output] + [result]
    explicit = client.responses.create(model="tiny-test", input=full, tools=TOOLS, max_output_tokens=64, store=False)
    assert chained.previous_response_id == r1.id and chained.output_text == "It is 21 C in Paris."
    assert chained.usage.input_tokens == explicit.usage.input_tokens
    import openai

    with pytest.raises(openai.BadRequestError) as e:  # store=False: nothing to continue from
        client.responses.create(model="tiny-test", previous_response_id=explicit.id, input="more")
    assert e.value.body["param"] == "previous_response_id"


def test_streamed_function_call(client, scripted_server):
    scripted_server.script(TOOL_CALL)
    stream = client.responses.create(model="tiny-test", input=USER, tools=TOOLS, max_output_tokens=64, stream=True)
    events = list(stream)
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(args) == {"city": "Paris"} and done.arguments == args
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added] == ["reasoning", "function_call"] and added[1].name == "get_weather"
    assert events[-1].type == "response.completed"
    assert [o.type for o in events[-1].response.output] == ["reasoning", "function_call"]


def test_max_output_tokens_makes_an_incomplete_response(client, scripted_server):
    scripted_server.script(REASONED)
    r = client.responses.create(model="tiny-test", input="Hi!", max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and [o.status for o in r.output] == ["incomplete"]


def test_json_schema_text_format_constrains_the_answer(client):
    """Sampled from the random model: the answer is JSON the schema admits (or its prefix when cut)."""
    from hybridmoe.engine.constraints import json_schema_spec
    from tests.constraint_helpers import admits_prefix

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    r = client.responses.create(model="tiny-test", input="A number?", max_output_tokens=32, temperature=1.0,
                                text={"format": {"type": "json_schema", "name": "n", "schema": schema}})
    assert [o.type for o in r.output] == ["message"]  # JSON mode skips the analysis channel
    assert r.output_text and admits_prefix(json_schema_spec(schema, "s"), r.output_text.encode()), r.output_text
    if r.status == "completed":
        assert set(json.loads(r.output_text)) == {"n"}


def test_named_tool_choice_forces_a_call(client):
    """Sampled from the random model: the reply is a call to the named function whose arguments
    the parameter schema admits (a prefix when the token limit cuts them)."""
    from hybridmoe.engine.constraints import json_schema_spec
    from tests.constraint_helpers import admits_prefix

    r = client.responses.create(model="tiny-test", input=USER, tools=TOOLS, max_output_tokens=48, temperature=1.0,
                                tool_choice={"type": "function", "name": "get_weather"})
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert admits_prefix(json_schema_spec(TOOLS[0]["parameters"], "s", lenient=True), call.arguments.encode()), \
        call.arguments


@pytest.mark.parametrize("body,param,words", [
    ({"tools": [{"type": "function"}]}, "tools", "tools[0]"),
    ({"tools": TOOLS + [{"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": ""}]}]}, "tools",
     "tools[1].tools[0]"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input", "'input_image'"),
    ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, "input", "'computer_call_output'"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice", "nope"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "schema"),
    ({"max_output_tokens": 0}, "max_output_tokens", ""),
    ({"previous_response_id": "resp_missing"}, "previous_response_id", "not found"),
])
def test_refused_requests_name_the_field(scripted_server, body, param, words):
    status, out = scripted_server.request("POST", "/v1/responses", {"model": "tiny-test", "input": "Hi", **body})
    assert status == 400, out
    assert out["error"]["param"] == param and words in out["error"]["message"], out


def test_output_text_logprobs_with_the_include(client, scripted_server):
    """OpenAI's rule: `include: ["message.output_text.logprobs"]` fills the answer's logprobs (one
    entry per answer token, `top_logprobs` alternatives each); reasoning and markup have none,
    and `top_logprobs` alone leaves them empty."""
    inc = ["message.output_text.logprobs"]
    scripted_server.script(REASONED)
    r = client.responses.create(model="tiny-test", input="Hi!", max_output_tokens=64, temperature=0,
                                include=inc, top_logprobs=3)
    part = r.output[1].content[0]
    assert part.text == "Hello there!"
    assert b"".join(bytes(e.bytes) for e in part.logprobs) == b"Hello there!"
    assert all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in part.logprobs)
    assert all(e.token == bytes(e.bytes).decode() for e in part.logprobs)
    scripted_server.script(REASONED)
    with client.responses.stream(model="tiny-test", input="Hi!", max_output_tokens=64, include=inc,
                                 top_logprobs=1) as stream:
        events = list(stream)
    streamed = [e for ev in events if ev.type == "response.output_text.delta" for e in ev.logprobs]
    done = next(ev for ev in events if ev.type == "response.output_text.done")
    assert [e.token for e in streamed] == [e.token for e in done.logprobs] == [e.token for e in part.logprobs]
    scripted_server.script(REASONED)
    plain = client.responses.create(model="tiny-test", input="Hi!", max_output_tokens=64, top_logprobs=3)
    assert plain.output[1].content[0].logprobs == []


def test_the_routes_without_v1(scripted_server):
    """The newest llama-server also serves /responses and /responses/input_tokens."""
    scripted_server.script(REASONED)
    status, out = scripted_server.request("POST", "/responses", {"model": "tiny-test", "input": "Hi"})
    assert status == 200 and out["object"] == "response"
    assert [item["type"] for item in out["output"]] == ["reasoning", "message"]
    status, count = scripted_server.request("POST", "/responses/input_tokens", {"model": "tiny-test", "input": "Hi"})
    _, count_v1 = scripted_server.request("POST", "/v1/responses/input_tokens", {"model": "tiny-test", "input": "Hi"})
    assert status == 200 and count == count_v1 and count["input_tokens"] > 0, count
