"""The reply builder on scripted engine events (real tokenizer and chat formats, no model)."""

from __future__ import annotations

import json

from hybridmoe.engine.engine import EngineEvent
from hybridmoe.server.reply import BlockDelta, BlockOpen, Finished, ReplyBuilder, TokenOut
from hybridmoe.tokenizer.harmony import HarmonyFormat

TWO_CALLS = ('<|channel|>commentary to=functions.a <|constrain|>json<|message|>{"x": 1}<|call|>'
             '<|start|>assistant<|channel|>commentary to=functions.b <|constrain|>json<|message|>{"y": 2}<|call|>')


def run(tok, text: str, raw: bool = False, stop=(), finish: str = "stop", stop_word: str | None = None):
    """Feed `text`'s tokens as engine events; a trailing end-of-generation id becomes the final event's."""
    ids = tok.encode(text, allow_special=True)
    stop_id = ids.pop() if finish == "stop" and ids[-1] in tok.eog_ids else None
    builder = ReplyBuilder(None) if raw else ReplyBuilder(HarmonyFormat(tok).parser(), stop=stop,
                                                          is_special=tok.is_special)
    events = []
    for i in ids:
        events += builder.push(EngineEvent(token_id=i, text=tok.decode([i])))
    events += builder.push(EngineEvent(finish_reason=finish, stop_token_id=stop_id, stop_word=stop_word))
    return builder.reply, events


def test_two_tool_calls_in_one_turn(served_llm):
    reply, events = run(served_llm.tokenizer, TWO_CALLS)
    calls = reply.calls()
    assert [c.name for c in calls] == ["a", "b"]
    assert [json.loads(c.text) for c in calls] == [{"x": 1}, {"y": 2}]
    assert reply.joined("text") == "" and reply.finish_reason == "stop"
    opened = [ev.block.index for ev in events if isinstance(ev, BlockOpen) and ev.block.kind == "call"]
    assert opened == [0, 1] and len({c.call_id for c in calls}) == 2
    assert isinstance(events[-1], Finished) and events[-1].reply is reply


def test_stop_string_cuts_the_parsed_channel(served_llm):
    text = ("<|channel|>analysis<|message|>think END more<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Hi END there")
    reply, events = run(served_llm.tokenizer, text, stop=["END"], stop_word="END")
    # The engine would have stopped at the first END; the builder must cut at the same place.
    assert reply.joined("reasoning") == "think " and reply.joined("text") == ""
    assert "".join(ev.text for ev in events if isinstance(ev, BlockDelta) and ev.block.kind == "reasoning") == "think "
    assert reply.stop_word == "END"


def test_length_mid_tool_call_keeps_length(served_llm):
    text = '<|channel|>commentary to=functions.a <|constrain|>json<|message|>{"x": '
    reply, _ = run(served_llm.tokenizer, text, finish="length")
    assert reply.finish_reason == "length"
    assert reply.calls()[0].text.startswith('{"x":')


def test_raw_mode_passes_text_through(served_llm):
    text = "<|channel|>final<|message|>Hi<|return|>"
    reply, events = run(served_llm.tokenizer, text, raw=True)
    assert reply.joined("text") == "<|channel|>final<|message|>Hi" == reply.text
    assert "".join(ev.text for ev in events if isinstance(ev, TokenOut)) == reply.text


def test_well_formed_output_cut_at_the_limit_notes_nothing(served_llm):
    text = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hello"
    reply, _ = run(served_llm.tokenizer, text, finish="length")
    assert reply.joined("text") == "Hello" and reply.anomalies == []


def test_a_call_with_no_function_name_is_text(served_llm):
    reply, _ = run(served_llm.tokenizer, "<|channel|>commentary to=functions.<|message|>{}<|call|>")
    assert reply.calls() == [] and reply.joined("text") == "{}" and reply.anomalies
