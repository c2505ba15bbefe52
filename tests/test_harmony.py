"""Harmony output parser: hand-built token sequences from the synthetic vocab, streaming vs whole,
and a random-conversation check against a slow text-level reference parser written here."""

from __future__ import annotations

import random
import re

import pytest

from hybridmoe.tokenizer import Tokenizer
from hybridmoe.tokenizer.harmony import (
    Header,
    HarmonyParser,
    collect,
    parse_completion,
    parse_header,
    render_reasoning_none,
)
from hybridmoe.tokenizer.synthetic import make_vocab
from hybridmoe.tokenizer.tokenizer import BYTE_TO_CHAR


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_metadata(make_vocab(4096, seed=3, preset="tiny"))


def ids_of(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, allow_special=True)


def stream(tok: Tokenizer, ids: list[int]):
    """Push one token at a time; return events and per-target concatenations."""
    p = HarmonyParser(tok)
    events = []
    for i in ids:
        events += p.push(i)
    events += p.finish()
    return events, collect(events)


FMT_EXAMPLE = (
    '<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.<|end|>'
    "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>"
)


def test_analysis_then_final(tok):
    ids = ids_of(tok, FMT_EXAMPLE)
    assert ids[0] == tok.token_id("<|channel|>") and ids[-1] == tok.token_id("<|return|>")
    out = parse_completion(tok, ids)
    assert out.reasoning == 'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.'
    assert out.content == "2 + 2 = 4."
    assert out.tool_calls == []
    assert [(m.header.channel, m.end_token) for m in out.messages] == [("analysis", "<|end|>"), ("final", "<|return|>")]
    assert out.last_end_token == "<|return|>"


def test_events_in_order(tok):
    events, _ = stream(tok, ids_of(tok, FMT_EXAMPLE))
    kinds = [e.kind for e in events]
    assert kinds[0] == "start" and events[0].channel == "analysis"
    assert kinds.count("start") == 2 and kinds.count("end") == 2
    second = kinds.index("start", 1)
    assert kinds[second - 1] == "end" and events[second].channel == "final"
    assert all(e.kind != "delta" or e.text for e in events)  # no empty deltas


@pytest.mark.parametrize(
    "header",
    [
        "<|channel|>commentary to=functions.get_weather <|constrain|>json",
        "<|channel|>commentary to=functions.get_weather<|constrain|>json",
        " to=functions.get_weather<|channel|>commentary <|constrain|>json",
        " to=functions.get_weather<|channel|>commentary json",
        "<|channel|>analysis to=functions.get_weather json",
    ],
)
def test_tool_call_header_forms(tok, header):
    body = '{"location": "San Francisco", "unit": "celsius"}'
    text = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant" + header
    text += "<|message|>" + body + "<|call|>"
    out = parse_completion(tok, ids_of(tok, text))
    assert out.reasoning == "Need the weather."
    assert out.content == ""
    assert [(c.name, c.arguments_json) for c in out.tool_calls] == [("get_weather", body)]
    assert out.messages[-1].header.content_type == "json"
    assert out.last_end_token == "<|call|>"


def test_tool_call_as_first_message(tok):
    # generation right after "<|start|>assistant": the recipient may come before the channel
    text = ' to=functions.lookup<|channel|>commentary <|constrain|>json<|message|>{"q": 1}<|call|>'
    out = parse_completion(tok, ids_of(tok, text))
    assert [(c.name, c.arguments_json) for c in out.tool_calls] == [("lookup", '{"q": 1}')]


def test_streamed_tool_call_events(tok):
    text = '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": [1, 2]}<|call|>'
    events, _ = stream(tok, ids_of(tok, text))
    assert events[0].kind == "start" and events[0].header.tool_name == "f"
    assert events[0].target == "tool_call"
    assert "".join(e.text for e in events if e.kind == "delta") == '{"a": [1, 2]}'
    assert events[-1].kind == "end" and events[-1].end_token == "<|call|>"


def test_preamble_and_builtin_tools(tok):
    text = (
        "<|channel|>commentary<|message|>Let me check.<|end|>"
        '<|start|>assistant<|channel|>analysis to=browser.search <|constrain|>json<|message|>{"query": "x"}<|call|>'
    )
    out = parse_completion(tok, ids_of(tok, text))
    assert out.content == "Let me check."  # commentary without recipient is user-visible
    assert out.reasoning == '{"query": "x"}'  # built-in tool calls are not OpenAI function calls
    assert out.tool_calls == []


def test_plain_text_without_structure(tok):
    for text in ["Hello world, no harmony here.", "to be or not to be", "  t", "\n"]:
        out = parse_completion(tok, ids_of(tok, text))
        assert out.content == text and out.reasoning == "" and out.tool_calls == []


def test_plain_text_then_stop_token(tok):
    out = parse_completion(tok, ids_of(tok, "Just an answer.<|return|>"))
    assert out.content == "Just an answer." and out.last_end_token == "<|return|>"


def test_endoftext_ends_the_message(tok):
    out = parse_completion(tok, ids_of(tok, "<|channel|>final<|message|>bye<|endoftext|>"))
    assert out.content == "bye" and out.last_end_token == "<|endoftext|>"


def test_tolerates_full_start_and_missing_end(tok):
    # starts with <|start|>assistant; the analysis message is not closed before the next <|start|>
    text = "<|start|>assistant<|channel|>analysis<|message|>think<|start|>assistant<|channel|>final<|message|>done<|return|>"
    out = parse_completion(tok, ids_of(tok, text))
    assert (out.reasoning, out.content) == ("think", "done")
    assert [m.end_token for m in out.messages] == [None, "<|return|>"]
    # a new <|channel|> without <|end|><|start|> also closes the open message
    text = "<|channel|>analysis<|message|>hmm<|channel|>final<|message|>ok"
    out = parse_completion(tok, ids_of(tok, text))
    assert (out.reasoning, out.content) == ("hmm", "ok")


def test_stop_token_inside_header_recovers(tok):
    out = parse_completion(tok, ids_of(tok, "<|channel|>final<|return|>"))
    assert [(m.header.channel, m.text, m.end_token) for m in out.messages] == [("final", "", "<|return|>")]
    # Prose after <|channel|> is no header (the demo model wrote this on Claude Code's prompt): its words are text.
    out = parse_completion(tok, ids_of(tok, "<|channel|>anon-ECh, in the same example, 0.5.<|return|>"))
    assert out.content == "anon-ECh, in the same example, 0.5." and out.last_end_token == "<|return|>"


def test_truncated_output_keeps_partial_message(tok):
    # cut off at max_tokens in the middle of the final answer, mid-emoji
    ids = ids_of(tok, "<|channel|>final<|message|>Hi ") + [tok.token_id(BYTE_TO_CHAR[b]) for b in "🙂".encode()[:2]]
    p = HarmonyParser(tok)
    deltas = [e.text for i in ids for e in p.push(i) if e.kind == "delta"]
    assert "".join(deltas) == "Hi "  # incomplete UTF-8 held back
    tail = p.finish()
    assert [e.kind for e in tail] == ["delta", "end"] and tail[0].text == "\ufffd" and tail[1].end_token is None


def test_emoji_split_over_tokens_streams_whole(tok):
    emoji = [tok.token_id(BYTE_TO_CHAR[b]) for b in "🙂".encode()]
    ids = ids_of(tok, "<|channel|>final<|message|>") + emoji + ids_of(tok, "<|return|>")
    events, out = stream(tok, ids)
    assert [e.text for e in events if e.kind == "delta"] == ["🙂"]
    assert out.content == "🙂"


def test_partial_header_at_finish_gives_no_text(tok):
    out = parse_completion(tok, ids_of(tok, "<|channel|>analysis<|end|><|start|>assistant<|channel|>fin"))
    assert out.content == "" and out.reasoning == ""


def test_render_reasoning_none(tok):
    ids = ids_of(tok, FMT_EXAMPLE)
    raw = render_reasoning_none(tok, ids)
    assert raw == FMT_EXAMPLE[: -len("<|return|>")]
    assert render_reasoning_none(tok, ids[:-1]) == raw  # no stop token to drop


@pytest.mark.parametrize(
    "text, role, expected",
    [
        ("<|channel|>analysis", "assistant", Header("assistant", "analysis", None, None)),
        ("assistant<|channel|>final", None, Header("assistant", "final", None, None)),
        ("assistant to=functions.f<|channel|>commentary <|constrain|>json", None, Header("assistant", "commentary", "functions.f", "json")),
        ("functions.f to=assistant<|channel|>commentary", None, Header("functions.f", "commentary", "assistant", None)),
        ("<|channel|>commentary functions.f json", "assistant", Header("assistant", "commentary", "functions.f", "json")),
        ("<|channel|>commentary to=python code", "assistant", Header("assistant", "commentary", "python", "code")),
    ],
)
def test_parse_header(text, role, expected):
    assert parse_header(text, role) == expected


def test_header_targets():
    assert Header(channel="analysis").target == "reasoning"
    assert Header(channel="final").target == "content"
    assert Header(channel="commentary").target == "content"
    assert Header(channel="commentary", recipient="functions.x").target == "tool_call"
    assert Header(channel="commentary", recipient="functions.x").tool_name == "x"
    assert Header(channel="analysis", recipient="browser.open").target == "reasoning"


# ---------- random conversations vs a text-level reference ----------
_WORDS = ["Hello", "world", "the", "answer", "is", "42", "🙂", "日本", "naïve", "{", "}", '"k"', ":", ",", "\n", "  "]


def _random_body(rng: random.Random) -> str:
    return "".join(rng.choice(_WORDS) + rng.choice(["", " "]) for _ in range(rng.randint(0, 12)))


def _random_message(rng: random.Random) -> tuple[str, str]:
    kind = rng.choice(["analysis", "final", "preamble", "tool", "tool_after"])
    ctype = rng.choice([" <|constrain|>json", "<|constrain|>json", " json"])
    name = rng.choice(["get_weather", "search_docs", "f"])
    header = {
        "analysis": "<|channel|>analysis",
        "final": "<|channel|>final",
        "preamble": "<|channel|>commentary",
        "tool": f" to=functions.{name}<|channel|>commentary{ctype}",
        "tool_after": f"<|channel|>commentary to=functions.{name}{ctype}",
    }[kind]
    end = "<|call|>" if kind.startswith("tool") else rng.choice(["<|end|>", "<|end|>", "<|return|>"])
    return header, _random_body(rng) + end


def _reference_parse(text: str) -> tuple[str, str, list[tuple[str, str]]]:
    """Slow text-level reference: split on <|start|>, header/body on <|message|>, regex the header."""
    reasoning, content, calls = "", "", []
    for chunk in text.split("<|start|>"):
        if "<|message|>" not in chunk:
            continue
        header, body = chunk.split("<|message|>", 1)
        body = re.sub(r"(<\|end\|>|<\|return\|>|<\|call\|>)$", "", body)
        channel = re.search(r"<\|channel\|>(\w+)", header).group(1)
        to = re.search(r"to=([\w.]+)", header)
        if to:
            calls.append((to.group(1).removeprefix("functions."), body))
        elif channel == "analysis":
            reasoning += body
        else:
            content += body
    return reasoning, content, calls


@pytest.mark.parametrize("seed", range(8))
def test_random_conversations_stream_equals_whole_and_reference(tok, seed):
    rng = random.Random(seed)
    for _ in range(10):
        parts = []
        for k in range(rng.randint(1, 5)):
            header, body = _random_message(rng)
            parts.append(("" if k == 0 else "<|start|>assistant") + header + "<|message|>" + body)
        text = "".join(parts)
        ids = ids_of(tok, text)
        events, streamed = stream(tok, ids)
        whole = parse_completion(tok, ids)
        assert (streamed.reasoning, streamed.content) == (whole.reasoning, whole.content)
        assert streamed.tool_calls == whole.tool_calls
        ref_reasoning, ref_content, ref_calls = _reference_parse(text)
        assert whole.reasoning == ref_reasoning, text
        assert whole.content == ref_content, text
        assert [(c.name, c.arguments_json) for c in whole.tool_calls] == ref_calls, text
        # each delta belongs to the message opened by the last start event
        current = None
        for e in events:
            if e.kind == "start":
                current = e.header
            assert e.header == current
