"""ChatView on scripted engine events (real tokenizer and harmony parser, no model)."""

from __future__ import annotations

import json

from hybridmoe.engine.engine import EngineEvent
from hybridmoe.server.chat_view import ChatView

TWO_CALLS = ('<|channel|>commentary to=functions.a <|constrain|>json<|message|>{"x": 1}<|call|>'
             '<|start|>assistant<|channel|>commentary to=functions.b <|constrain|>json<|message|>{"y": 2}<|call|>')


def run(tok, text: str, raw: bool = False, stop=(), finish: str = "stop"):
    """Feed `text`'s tokens as engine events; a trailing end-of-generation id becomes the final event's."""
    ids = tok.encode(text, allow_special=True)
    stop_id = ids.pop() if finish == "stop" and ids[-1] in tok.eog_ids else None
    view = ChatView(tok, raw=raw, stop=stop)
    deltas = []
    for i in ids:
        deltas += view.push(EngineEvent(token_id=i, text=tok.decode([i])))
    deltas += view.push(EngineEvent(finish_reason=finish, stop_token_id=stop_id))
    return view, deltas


def test_two_tool_calls_in_one_turn(served_llm):
    view, deltas = run(served_llm.tokenizer, TWO_CALLS)
    msg = view.message()
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["a", "b"]
    assert [json.loads(c["function"]["arguments"]) for c in msg["tool_calls"]] == [{"x": 1}, {"y": 2}]
    assert msg["content"] is None and view.finish_reason("stop") == "tool_calls"
    indices = [d["tool_calls"][0]["index"] for d in deltas if "tool_calls" in d]
    assert indices == sorted(indices) and set(indices) == {0, 1}


def test_stop_string_cuts_the_parsed_channel(served_llm):
    text = "<|channel|>analysis<|message|>think END more<|end|><|start|>assistant<|channel|>final<|message|>Hi END there"
    view, deltas = run(served_llm.tokenizer, text, stop=["END"])
    # The engine would have stopped at the first END; here the view must cut at the same place.
    assert view.message() == {"content": "", "reasoning_content": "think "}
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "think "


def test_length_mid_tool_call_keeps_length(served_llm):
    text = '<|channel|>commentary to=functions.a <|constrain|>json<|message|>{"x": '
    view, _ = run(served_llm.tokenizer, text, finish="length")
    assert view.finish_reason("length") == "length"
    assert view.message()["tool_calls"][0]["function"]["arguments"].startswith('{"x":')


def test_raw_mode_passes_text_through(served_llm):
    text = "<|channel|>final<|message|>Hi<|return|>"
    view, deltas = run(served_llm.tokenizer, text, raw=True)
    assert view.message() == {"content": "<|channel|>final<|message|>Hi"}
    assert "".join(d["content"] for d in deltas) == "<|channel|>final<|message|>Hi"
