"""One suite for every chat format in the table (tokenizer/formats.py): each case spells replies
in its format's own syntax, and the same checks run on all of them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

import pytest

from hybridmoe.tokenizer import Tokenizer
from hybridmoe.tokenizer.chat_format import ChatFormat, OutputEvent
from hybridmoe.tokenizer.formats import FORMATS, choose_format
from hybridmoe.tokenizer.harmony import HarmonyFormat
from hybridmoe.tokenizer.plain_format import PlainFormat
from hybridmoe.tokenizer.synthetic import harmony_template, make_vocab


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_metadata(make_vocab(4096, seed=3, preset="tiny"))


@dataclass(frozen=True)
class Spelling:
    """How one format writes an answer and a call, and a template that selects it."""

    kind: type
    template: str
    answer: str  # {text}
    call: str  # {name}, {args}
    broken_call: str  # a call the format cannot parse


HARMONY = Spelling(HarmonyFormat, harmony_template(), "<|channel|>final<|message|>{text}<|return|>",
                   "<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{args}<|call|>",
                   "<|channel|>commentary to=functions.<|message|>{args}<|call|>")
PLAIN = Spelling(PlainFormat, resources.files("hybridmoe.data").joinpath("chatml_template.jinja").read_text(),
                 "{text}", '<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>',
                 "<tool_call>{{not json {args}</tool_call>")
SPELLINGS = {"harmony": HARMONY, "plain": PLAIN}


@pytest.fixture(params=list(SPELLINGS))
def case(request, tok) -> tuple[Spelling, ChatFormat]:
    spelling = SPELLINGS[request.param]
    return spelling, choose_format(spelling.template, tok)


def parse(fmt: ChatFormat, tok: Tokenizer, text: str) -> tuple[list[OutputEvent], list[str]]:
    parser = fmt.parser()
    events = [ev for i in tok.encode(text, allow_special=True) for ev in parser.push(i)] + parser.finish()
    return events, parser.anomalies


def joined(events: list[OutputEvent], target: str) -> str:
    return "".join(ev.text for ev in events if ev.kind == "delta" and ev.target == target)


def test_the_table_covers_every_format_once():
    assert {s.kind for s in SPELLINGS.values()} == set(FORMATS)


def test_the_template_picks_the_format(case):
    spelling, fmt = case
    assert isinstance(fmt, spelling.kind)


def test_an_answer_is_content(case, tok):
    spelling, fmt = case
    events, anomalies = parse(fmt, tok, spelling.answer.format(text="The answer is 42."))
    assert joined(events, "content") == "The answer is 42." and not anomalies
    assert not any(ev.target == "tool_call" for ev in events)


def test_a_call_has_its_name_and_arguments(case, tok):
    spelling, fmt = case
    args = '{"city": "Paris"}'
    events, anomalies = parse(fmt, tok, spelling.call.format(name="get_weather", args=args))
    starts = [ev for ev in events if ev.kind == "start" and ev.target == "tool_call"]
    assert [ev.tool_name for ev in starts] == ["get_weather"] and not anomalies
    assert json.loads(joined(events, "tool_call")) == {"city": "Paris"}


def test_a_broken_call_stays_text_and_is_noted(case, tok):
    spelling, fmt = case
    events, anomalies = parse(fmt, tok, spelling.broken_call.format(args='{"x": 1}'))
    assert not any(ev.target == "tool_call" and ev.tool_name for ev in events)
    assert '{"x": 1}' in joined(events, "content") + joined(events, "reasoning") + joined(events, "tool_call")
    assert anomalies


def test_a_forced_call_prefix_parses_as_a_call(case, tok):
    spelling, fmt = case
    prefix = fmt.forced_call("get_weather")
    if prefix is None:
        assert fmt.tool_call_marks() is None  # no syntax to force: the server answers 400
        return
    events, _ = parse(fmt, tok, prefix + '{"city": "Oslo"}' + spelling.call.split("{args}")[1])
    assert [ev.tool_name for ev in events if ev.kind == "start"] == ["get_weather"]


def test_thinking_marks_exist_only_where_the_format_thinks(case, tok):
    _, fmt = case
    marks = fmt.budget_marks()
    assert (marks is not None) == isinstance(fmt, HarmonyFormat)  # the plain format does not think
    if marks is not None:
        events, _ = parse(fmt, tok, tok.decode(list(marks.start)) + "hmm" + tok.decode(list(marks.end)))
        assert joined(events, "reasoning") == "hmm"


def test_a_continued_message_reads_back_as_itself(case, tok):
    _, fmt = case
    tail = fmt.continuation("", "Partial answer")
    if tail is None:  # the template's own rendering is cut instead
        return
    events, _ = parse(fmt, tok, tail)
    assert joined(events, "content") == "Partial answer"
