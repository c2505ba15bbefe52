"""`/v1/messages` through the official `anthropic` SDK against a real `hybridmoe serve` process.

Replies are scripted (tests/server/scripted_serve.py): the engine emits the given harmony tokens;
parsing, content blocks, events, stop reasons, usage and error shapes are the production path.
"""

from __future__ import annotations

import anthropic
import pytest

from tests.server.conftest import API_KEY
from tests.server.test_responses_api import ANSWER, REASONED, TOOL_CALL, chat_prompt_tokens, n_tokens

TOOLS = [{"name": "get_weather", "description": "Current weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture
def client(scripted_server):
    scripted_server.script()  # nothing left over from a failed test
    # The SDK sends the key as `x-api-key`.
    return anthropic.Anthropic(base_url=scripted_server.base_url, api_key=API_KEY, max_retries=0, timeout=60)


def test_analysis_and_final_become_thinking_and_text_blocks(client, scripted_server):
    srv = scripted_server
    scripted_server.script(REASONED)
    m = client.messages.create(model="tiny-test", max_tokens=64, system="Be brief.",
                               messages=[{"role": "user", "content": "Hi!"}], thinking={"type": "enabled",
                                                                                     "budget_tokens": 2048})
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    thinking, text = m.content
    assert thinking.type == "thinking" and thinking.thinking == "The user greets me."
    assert text.type == "text" and text.text == "Hello there!"
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    assert m.usage.output_tokens == n_tokens(srv, REASONED)
    assert m.usage.output_tokens_details.thinking_tokens == n_tokens(srv, "The user greets me.") + 1
    prompt = chat_prompt_tokens(srv, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}])
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == prompt
    count = client.messages.count_tokens(model="tiny-test", system="Be brief.",
                                         messages=[{"role": "user", "content": "Hi!"}],
                                         thinking={"type": "enabled", "budget_tokens": 2048})
    assert count.input_tokens == prompt


def test_stream_follows_the_documented_event_sequence(client, scripted_server):
    scripted_server.script(REASONED)
    with client.messages.stream(model="tiny-test", max_tokens=64, messages=[{"role": "user", "content": "Hi!"}]) as s:
        events = list(s)
        final = s.get_final_message()
    raw = [e for e in events if not e.type.startswith(("text", "thinking", "input_json", "citation", "signature"))]
    kinds = [e.type for e in raw]
    collapsed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert collapsed == ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                         "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
                         "message_stop"]
    starts = [e.content_block.type for e in raw if e.type == "content_block_start"]
    assert starts == ["thinking", "text"]
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "The user greets me." and final.content[1].text == "Hello there!"
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == n_tokens(scripted_server, REASONED)


def test_tool_use_round_trip(client, scripted_server):
    srv = scripted_server
    scripted_server.script(TOOL_CALL, ANSWER)
    m1 = client.messages.create(model="tiny-test", max_tokens=64, messages=USER, tools=TOOLS)
    assert m1.stop_reason == "tool_use"
    thinking, use = m1.content
    assert thinking.type == "thinking" and thinking.thinking == "Need the weather."
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"} and use.id

    history = USER + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m1.content]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                    "content": '{"temp_c": 21}'}]}]
    m2 = client.messages.create(model="tiny-test", max_tokens=64, messages=history, tools=TOOLS)
    assert [b.type for b in m2.content] == ["text"] and m2.content[0].text == "It is 21 C in Paris."
    assert m2.stop_reason == "end_turn"
    chat = USER + [
        {"role": "assistant", "content": "", "reasoning_content": "Need the weather.",
         "tool_calls": [{"id": use.id, "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": use.id, "content": '{"temp_c": 21}'}]
    tools = [{"name": t["name"], "description": t["description"], "parameters": t["input_schema"]} for t in TOOLS]
    assert m2.usage.input_tokens + m2.usage.cache_read_input_tokens == chat_prompt_tokens(srv, chat, tools)


def test_streamed_tool_use(client, scripted_server):
    scripted_server.script(TOOL_CALL)
    with client.messages.stream(model="tiny-test", max_tokens=64, messages=USER, tools=TOOLS) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "tool_use"]
    assert final.content[1].input == {"city": "Paris"} and final.stop_reason == "tool_use"


def test_stop_sequence_and_max_tokens_stop_reasons(client, scripted_server):
    scripted_server.script("<|channel|>final<|message|>Hello there! END of it<|return|>", REASONED)
    m = client.messages.create(model="tiny-test", max_tokens=64, messages=USER, stop_sequences=["END"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "END"
    assert [b.text for b in m.content] == ["Hello there! "]
    cut = client.messages.create(model="tiny-test", max_tokens=5, messages=USER)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 5
    # a stop string inside harmony markup ("nal" of "final"): the parsed text never shows it, but
    # the reply was cut by it, so the reason says so (llama-server names the string too)
    scripted_server.script("<|channel|>final<|message|>Hello there!<|return|>")
    inside = client.messages.create(model="tiny-test", max_tokens=64, messages=USER, stop_sequences=["nal"])
    assert inside.stop_reason == "stop_sequence" and inside.stop_sequence == "nal", inside


def test_named_tool_choice_forces_a_tool_use(client):
    """Sampled from the random model: the reply is a tool_use of the named tool (its input an
    object when the arguments closed within max_tokens)."""
    m = client.messages.create(model="tiny-test", max_tokens=48, messages=USER, tools=TOOLS,
                               extra_body={"temperature": 1.0},  # this SDK has no temperature argument
                               tool_choice={"type": "tool", "name": "get_weather"})
    (use,) = m.content
    assert use.type == "tool_use" and use.name == "get_weather" and isinstance(use.input, dict)
    assert m.stop_reason in ("tool_use", "max_tokens")


def test_errors_take_anthropics_shape(client, scripted_server):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tiny-test", max_tokens=8, messages=USER,
                               tools=[{"type": "web_search_20250305", "name": "web_search"}])
    body = e.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "tools[0] has type 'web_search_20250305'" in body["error"]["message"]
    status, out = scripted_server.request("POST", "/v1/messages", {"model": "tiny-test", "messages": USER})
    assert status == 400 and out["type"] == "error" and "max_tokens" in out["error"]["message"], out
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=scripted_server.base_url, api_key="wrong", max_retries=0).messages.create(
            model="tiny-test", max_tokens=8, messages=USER)
    assert e.value.body["error"]["type"] == "authentication_error"
    # Any model name is served (as llama-server does; clients hard-code names).
    assert client.messages.create(model="claude-none", max_tokens=8, messages=USER).model == "tiny-test"


@pytest.mark.parametrize("body,words", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "content[0] has type 'image'"),
    ({"messages": USER + [{"role": "assistant", "content": "Sure"}]}, "prefill"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS}, "nope"),
    ({"temperature": 1.5}, "temperature"),
])
def test_refused_requests_name_the_field(scripted_server, body, words):
    status, out = scripted_server.request(
        "POST", "/v1/messages", {"model": "tiny-test", "max_tokens": 8, "messages": USER, **body})
    assert status == 400 and out["error"]["type"] == "invalid_request_error", out
    assert words in out["error"]["message"], out


def test_system_message_inside_messages_is_accepted(scripted_server):
    """Claude Code's first request carries its environment as a role "system" message after the
    user's: answered (not a 400 that makes it resend), the text in the user turn's prompt."""
    env = "# Environment\nWorking directory: /tmp/project"
    messages = [{"role": "user", "content": "Hi!"}, {"role": "system", "content": [{"type": "text", "text": env}]}]
    body = {"model": "tiny-test", "max_tokens": 64, "system": "Be brief.", "messages": messages}
    scripted_server.script(ANSWER)
    status, out = scripted_server.request("POST", "/v1/messages", body)
    assert status == 200 and out["content"][-1]["text"] == "It is 21 C in Paris.", out
    folded = [{"role": "system", "content": "Be brief."},
              {"role": "user", "content": f"Hi!\n\n<system-reminder>\n{env}\n</system-reminder>"}]
    prompt = chat_prompt_tokens(scripted_server, folded)
    assert out["usage"]["input_tokens"] + out["usage"]["cache_read_input_tokens"] == prompt
    status, count = scripted_server.request("POST", "/v1/messages/count_tokens", body)
    assert status == 200 and count["input_tokens"] == prompt, count


def test_model_may_be_left_out_as_llama_server_allows(server):
    body = {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    status, out = server.request("POST", "/v1/messages", body)
    assert status == 200 and out["type"] == "message", out
