"""Each API's renderer fed scripted engine events: a synthetic vocabulary, the harmony format's
parser and the reply builder, no model and no server."""

from __future__ import annotations

import json

import pytest

from hybridmoe.engine.engine import EngineEvent, GenerationRequest, Usage
from hybridmoe.engine.sampler import SamplingParams, TokenLogprobs
from hybridmoe.server.chat_completions import ChatRender
from hybridmoe.server.completions import CompletionRender
from hybridmoe.server.generation import SSEvent
from hybridmoe.server.messages_api import MessagesRender
from hybridmoe.server.native_completion import NativeCompletionRequest, NativeRender
from hybridmoe.server.native_result import native_final
from hybridmoe.server.protocol import APIError
from hybridmoe.server.reply import Reply, ReplyBuilder, ReplyEvent
from hybridmoe.server.responses_api import ResponsesRender, ResponsesRequest
from hybridmoe.server.responses_store import ResponseStore
from hybridmoe.server.responses_tools import ToolMap
from hybridmoe.settings import SamplingDefaults
from hybridmoe.tokenizer import Tokenizer
from hybridmoe.tokenizer.harmony import HarmonyFormat
from hybridmoe.tokenizer.synthetic import make_vocab

REASONED = ("<|channel|>analysis<|message|>Think.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Hello there<|return|>")
CALL = ('<|channel|>analysis<|message|>Weather.<|end|><|start|>assistant<|channel|>commentary '
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')
TIMINGS = {"cache_n": 0, "prompt_n": 3, "prompt_ms": 1.0, "prompt_per_second": 3000.0, "predicted_n": 2,
           "predicted_ms": 2.0, "predicted_per_second": 1000.0}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_metadata(make_vocab(4096, seed=3, preset="tiny"))


def request(logprobs: int | None = None, stop: tuple[str, ...] = ()) -> GenerationRequest:
    return GenerationRequest(prompt_ids=[1, 2, 3], params=SamplingParams(max_tokens=64), logprobs=logprobs, stop=stop)


def script(tok: Tokenizer, text: str, raw: bool = False, finish: str = "stop", stop_word: str | None = None,
           logprobs: bool = False) -> tuple[list[list[ReplyEvent]], Reply]:
    """One batch of reply events per engine event of `text` (a trailing end token ends it)."""
    ids = tok.encode(text, allow_special=True)
    end = ids.pop() if finish == "stop" and stop_word is None and ids[-1] in tok.eog_ids else None
    builder = ReplyBuilder(None) if raw else ReplyBuilder(HarmonyFormat(tok).parser(), is_special=tok.is_special)
    batches = [builder.push(EngineEvent(token_id=i, text=tok.decode([i]),
                                        logprob=TokenLogprobs(i, -0.5, [(i, -0.5)]) if logprobs else None))
               for i in ids]
    batches.append(builder.push(EngineEvent(finish_reason=finish, stop_token_id=end, stop_word=stop_word,
                                            timings=TIMINGS, usage=Usage(3, len(ids) + (end is not None), 1))))
    return batches, builder.reply


def streamed(render, batches: list[list[ReplyEvent]]) -> list[SSEvent]:
    out = render.opening()
    for b in batches:
        out += render.events(0, b)
    return out + render.closing()


def no_failure(reply: Reply) -> APIError | None:
    return None


def no_verbose(req: GenerationRequest, reply: Reply, stream: bool) -> None:
    return None


def chat_render(tok: Tokenizer, req: GenerationRequest, include_usage: bool = False) -> ChatRender:
    return ChatRender({"id": "chatcmpl-1", "model": "m"}, [req], tok.token_bytes, no_failure, no_verbose, include_usage)


def test_chat_json_splits_reasoning_text_and_calls(tok):
    _, reply = script(tok, CALL)
    out = chat_render(tok, request()).json([reply])
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["logprobs"] is None
    msg = choice["message"]
    assert msg["content"] is None and msg["reasoning_content"] == "Weather."
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    n = reply.usage.completion_tokens
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n,
                            "prompt_tokens_details": {"cached_tokens": 1}}


def test_chat_stream_deltas_logprobs_and_usage(tok):
    batches, _ = script(tok, REASONED, logprobs=True)
    events = streamed(chat_render(tok, request(logprobs=0), include_usage=True), batches)
    chunks = [e.data for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    deltas = [c["choices"][0]["delta"] for c in chunks[1:] if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Think."
    assert "".join(d.get("content", "") or "" for d in deltas) == "Hello there"
    lps = [c["choices"][0]["logprobs"] for c in chunks if c["choices"]]
    n_lp = sum(len(lp["content"]) for lp in lps if lp)
    assert n_lp == len(batches) - 1  # every generated token's logprobs, once
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and "timings" not in chunks[-2]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == 3 and "timings" in chunks[-1]
    assert events[-1].frame() == "data: [DONE]\n\n"


def test_chat_stream_call_deltas_are_indexed(tok):
    batches, _ = script(tok, CALL)
    events = streamed(chat_render(tok, request()), batches)
    calls = [c for e in events if isinstance(e.data, dict) and e.data["choices"]
             for c in e.data["choices"][0]["delta"].get("tool_calls", [])]
    assert calls[0]["index"] == 0 and calls[0]["function"]["name"] == "get_weather" and calls[0]["id"]
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Paris"}
    assert events[-2].data["choices"][0]["finish_reason"] == "tool_calls"


def test_chat_stream_failure_is_an_error_event(tok):
    batches, _ = script(tok, "<|channel|>final<|message|>Hi", finish="error")

    def failed(reply: Reply) -> APIError | None:
        return APIError(500, "generation failed: boom", type="server_error")

    render = ChatRender({"id": "x", "model": "m"}, [request()], tok.token_bytes, failed, no_verbose)
    events = streamed(render, batches)
    assert events[-2].data["error"]["message"] == "generation failed: boom"


def test_completions_text_logprobs_and_stream(tok):
    batches, reply = script(tok, "Once upon a time", raw=True, finish="length", logprobs=True)
    render = CompletionRender({"id": "cmpl-1"}, [request(logprobs=1)], "Echo: ", tok.token_text, tok.token_bytes,
                              no_failure, no_verbose)
    out = render.json([reply])
    assert out["choices"][0]["text"] == "Echo: Once upon a time" and out["choices"][0]["finish_reason"] == "length"
    assert out["choices"][0]["logprobs"]["token_logprobs"] == [-0.5] * (len(batches) - 1)
    events = streamed(render, batches)
    chunks = [e.data for e in events[:-1]]
    assert chunks[0]["choices"][0]["text"] == "Echo: "
    assert "".join(c["choices"][0]["text"] for c in chunks[1:]) == "Once upon a time"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and "timings" in chunks[-1]


def test_native_result_names_the_stop_word(tok):
    batches, reply = script(tok, "Count: one two", raw=True, stop_word="three")
    req = request(stop=("three",))
    native = NativeCompletionRequest(prompt="x", n_probs=0)

    def final(r: GenerationRequest, rep: Reply, index: int, stream: bool) -> dict:
        return native_final(r, rep, index=index, model="m", n_ctx=256, prompt="x", stream=stream,
                            return_tokens=True, post_sampling=False, token_bytes=tok.token_bytes)

    render = NativeRender([req], native, final, no_failure, tok.token_bytes)
    out = render.json([reply])
    assert out["content"] == "Count: one two" and out["stop_type"] == "word" and out["stopping_word"] == "three"
    events = streamed(render, batches)
    assert [e.data["stop"] for e in events] == [False] * (len(batches) - 1) + [True]
    assert "".join(e.data["content"] for e in events) == "Count: one two"
    assert events[-1].data["tokens_predicted"] == reply.usage.completion_tokens


def responses_render(tok: Tokenizer, tools: list | None = None, include: list | None = None) -> ResponsesRender:
    req = ResponsesRequest(input="hi", store=False, tools=tools, include=include)
    return ResponsesRender(req, ResponseStore(), ToolMap.parse(tools), "m", None, SamplingDefaults(),
                           tok.token_bytes)


def test_responses_stream_items_and_completion(tok):
    batches, _ = script(tok, REASONED)
    events = streamed(responses_render(tok, include=["reasoning.encrypted_content"]), batches)
    kinds = [e.event for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert all(e.data["type"] == e.event for e in events)
    assert [e.data["sequence_number"] for e in events] == list(range(len(events)))
    done = events[-1].data["response"]
    assert [i["type"] for i in done["output"]] == ["reasoning", "message"]
    assert done["output"][1]["content"][0]["text"] == "Hello there"
    assert done["output"][0]["encrypted_content"]
    assert "".join(e.data["delta"] for e in events if e.event == "response.output_text.delta") == "Hello there"


def test_responses_json_function_call_and_length(tok):
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    _, reply = script(tok, CALL)
    out = responses_render(tok, tools).json([reply])
    assert out["status"] == "completed"
    call = out["output"][-1]
    assert (call["type"], call["name"], call["arguments"]) == ("function_call", "get_weather", '{"city": "Paris"}')
    _, cut = script(tok, "<|channel|>final<|message|>Hello there", finish="length")
    out = responses_render(tok).json([cut])
    assert out["status"] == "incomplete" and out["output"][-1]["status"] == "incomplete"


def test_messages_blocks_stop_sequence_and_raw_arguments(tok):
    _, reply = script(tok, "<|channel|>final<|message|>Hello there", stop_word="END")
    msg = MessagesRender("m", 3, no_failure).json([reply])
    assert msg["content"] == [{"type": "text", "text": "Hello there"}]
    assert (msg["stop_reason"], msg["stop_sequence"]) == ("stop_sequence", "END")
    _, bad = script(tok, CALL.replace('{"city": "Paris"}', '{"city": Par'))
    msg = MessagesRender("m", 3, no_failure).json([bad])
    assert msg["stop_reason"] == "tool_use"
    assert msg["content"][-1]["input"] == {"raw_arguments": '{"city": Par'}
    assert bad.anomalies  # logged once per request by the consumer


def test_messages_stream_events(tok):
    batches, _ = script(tok, REASONED)
    events = streamed(MessagesRender("m", 3, no_failure), batches)
    kinds = [e.event for e in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == 2 == kinds.count("content_block_stop")
    assert events[-2].data["delta"]["stop_reason"] == "end_turn"
