"""Sandboxed chat-template rendering and our harmony template (expected strings from harmony.md)."""

from __future__ import annotations

import datetime
import json

import pytest

from hybridmoe.tokenizer import Tokenizer
from hybridmoe.tokenizer.chat_template import ChatTemplateError, render_chat
from hybridmoe.tokenizer.harmony import parse_completion
from hybridmoe.tokenizer.synthetic import harmony_template, make_vocab

DATE = "2025-08-05"
SYSTEM = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    f"Knowledge cutoff: 2024-06\nCurrent date: {DATE}\n\nReasoning: medium\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
)
CALLS_LINE = "\nCalls to these tools must go to the commentary channel: 'functions'."

WEATHER_TOOLS = [
    {"type": "function", "function": {"name": "get_location", "description": "Gets the location of the user."}},
    {
        "type": "function",
        "function": {
            "name": "get_current_weather",
            "description": "Gets the current weather in the provided location.",
            "parameters": {
                "type": "object",
                "properties": {
                    "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
                    "format": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
                },
                "required": ["location"],
            },
        },
    },
]
WEATHER_NAMESPACE = """# Tools

## functions

namespace functions {

// Gets the location of the user.
type get_location = () => any;

// Gets the current weather in the provided location.
type get_current_weather = (_: {
// The city and state, e.g. San Francisco, CA
location: string,
format?: "celsius" | "fahrenheit", // default: celsius
}) => any;

} // namespace functions"""


def harmony(messages, tools=None, add_generation_prompt: bool = True, **variables) -> str:
    variables.setdefault("current_date", DATE)
    return render_chat(harmony_template(), messages, tools, add_generation_prompt, extra_vars=variables)


# ---------- harmony template ----------
def test_minimal_prompt_matches_reference_vector():
    got = harmony([{"role": "user", "content": "What is 2 + 2?"}])
    assert got == SYSTEM + "<|end|><|start|>user<|message|>What is 2 + 2?<|end|><|start|>assistant"


def test_no_generation_prompt_and_effort():
    got = harmony([{"role": "user", "content": "hi"}], add_generation_prompt=False, reasoning_effort="high")
    assert got == SYSTEM.replace("Reasoning: medium", "Reasoning: high") + "<|end|><|start|>user<|message|>hi<|end|>"
    with pytest.raises(ChatTemplateError, match="reasoning_effort must be low, medium or high"):
        harmony([{"role": "user", "content": "hi"}], reasoning_effort="extreme")


def test_identity_cutoff_and_default_date():
    got = render_chat(
        harmony_template(), [{"role": "user", "content": "x"}],
        extra_vars={"model_identity": "You are Bob.", "knowledge_cutoff": "2030-01"})
    today = datetime.date.today().strftime("%Y-%m-%d")
    yesterday = (datetime.date.today() - datetime.timedelta(days=1)).strftime("%Y-%m-%d")  # midnight race
    assert got.startswith("<|start|>system<|message|>You are Bob.\nKnowledge cutoff: 2030-01\nCurrent date: ")
    assert f"Current date: {today}\n" in got or f"Current date: {yesterday}\n" in got


def test_developer_message_with_instructions_and_tools():
    msgs = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Weather?"}]
    got = harmony(msgs, tools=WEATHER_TOOLS)
    expected = (
        SYSTEM + CALLS_LINE + "<|end|>"
        "<|start|>developer<|message|># Instructions\n\nAnswer briefly.\n\n" + WEATHER_NAMESPACE + "<|end|>"
        "<|start|>user<|message|>Weather?<|end|><|start|>assistant"
    )
    assert got == expected


def test_developer_role_and_tools_only():
    got = harmony([{"role": "developer", "content": "Be nice."}, {"role": "user", "content": "x"}])
    assert "<|start|>developer<|message|># Instructions\n\nBe nice.<|end|><|start|>user" in got
    got = harmony([{"role": "user", "content": "x"}], tools=[t["function"] for t in WEATHER_TOOLS])  # bare form
    assert "<|start|>developer<|message|>" + WEATHER_NAMESPACE + "<|end|>" in got
    assert "# Instructions" not in got


def test_typescript_schema_mapping():
    tool = {
        "name": "complex",
        "description": "Line one.\nLine two.",
        "parameters": {
            "type": "object",
            "properties": {
                "count": {"type": "integer", "default": 3},
                "ratio": {"type": "number"},
                "flag": {"type": "boolean", "default": False},
                "tags": {"type": "array", "items": {"type": "string"}},
                "mixed": {"type": "array", "items": {"type": ["string", "number"]}},
                "maybe": {"type": "string", "nullable": True},
                "either": {"oneOf": [{"type": "string"}, {"type": "integer"}]},
                "mode": {"type": "string", "default": "fast"},
                "nested": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]},
                "blob": {"type": "object"},
                "anything": {},
            },
            "required": ["count"],
        },
    }
    got = harmony([{"role": "user", "content": "x"}], tools=[tool])
    body = got.split("namespace functions {\n\n", 1)[1].split("\n} // namespace functions", 1)[0]
    assert body == (
        "// Line one.\n// Line two.\n"
        "type complex = (_: {\n"
        "count: number, // default: 3\n"
        "ratio?: number,\n"
        "flag?: boolean, // default: false\n"
        "tags?: string[],\n"
        "mixed?: (string | number)[],\n"
        "maybe?: string | null,\n"
        "either?: string | number,\n"
        'mode?: string, // default: "fast"\n'
        "nested?: {\nx: number,\n},\n"
        "blob?: object,\n"
        "anything?: any,\n"
        "}) => any;\n"
    )


def test_tool_call_history_and_results():
    msgs = [
        {"role": "user", "content": "Weather in SF?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Need to call get_current_weather.",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_current_weather", "arguments": '{"location":"SF"}'}},
                {"id": "call_2", "type": "function", "function": {"name": "get_location", "arguments": {}}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 20}'},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "San Francisco"}]},
    ]
    got = harmony(msgs, tools=WEATHER_TOOLS)
    tail = got.split("<|start|>user<|message|>Weather in SF?<|end|>", 1)[1]
    assert tail == (
        "<|start|>assistant<|channel|>analysis<|message|>Need to call get_current_weather.<|end|>"
        '<|start|>assistant<|channel|>commentary to=functions.get_current_weather <|constrain|>json<|message|>{"location":"SF"}<|call|>'
        "<|start|>assistant<|channel|>commentary to=functions.get_location <|constrain|>json<|message|>{}<|call|>"
        '<|start|>functions.get_current_weather to=assistant<|channel|>commentary<|message|>{"temp": 20}<|end|>'
        "<|start|>functions.get_location to=assistant<|channel|>commentary<|message|>San Francisco<|end|>"
        "<|start|>assistant"
    )


def test_previous_turns_analysis_dropped():
    msgs = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "reasoning_content": "old chain", "tool_calls": [{"id": "a", "function": {"name": "get_location", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "a", "content": "Paris"},
        {"role": "assistant", "content": "It is sunny in Paris."},
        {"role": "user", "content": "Thanks"},
    ]
    got = harmony(msgs, tools=WEATHER_TOOLS)
    assert "greet back" not in got and "old chain" not in got and "<|channel|>analysis" not in got
    assert "<|start|>assistant<|channel|>final<|message|>Hello!<|end|>" in got
    assert "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris.<|end|><|start|>user" in got


def test_tool_message_name_fallbacks_and_errors():
    base = [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}]
    got = harmony(base + [{"role": "tool", "content": "r"}])  # no id: the latest call's name
    assert "<|start|>functions.f to=assistant<|channel|>commentary<|message|>r<|end|>" in got
    got = harmony(base + [{"role": "tool", "name": "g", "content": "r"}])
    assert "<|start|>functions.g to=assistant" in got
    with pytest.raises(ChatTemplateError, match="no name and no preceding assistant tool call"):
        harmony([{"role": "user", "content": "q"}, {"role": "tool", "content": "r"}])
    with pytest.raises(ChatTemplateError, match="unknown message role"):
        harmony([{"role": "wizard", "content": "q"}])


def test_builtin_tools_section():
    got = harmony([{"role": "user", "content": "x"}], builtin_tools=["python"])
    assert "Reasoning: medium\n\n# Tools\n\n## python\n\n" in got
    assert "\n\n# Valid channels" in got
    with pytest.raises(ChatTemplateError, match="unknown builtin tool"):
        harmony([{"role": "user", "content": "x"}], builtin_tools=["teleport"])


def test_generated_tool_call_refeeds_verbatim():
    # what the model generated after "<|start|>assistant" comes back unchanged in the next prompt
    tok = Tokenizer.from_metadata(make_vocab(2048, seed=0, preset="tiny"))
    generated = '<|channel|>commentary to=functions.get_location <|constrain|>json<|message|>{"precise":true}<|call|>'
    out = parse_completion(tok, tok.encode(generated))
    call = out.tool_calls[0]
    msgs = [
        {"role": "user", "content": "Where am I?"},
        {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": call.name, "arguments": call.arguments_json}}]},
    ]
    prompt = harmony(msgs, tools=WEATHER_TOOLS, add_generation_prompt=False)
    assert prompt.endswith("<|start|>assistant" + generated)
    ids = tok.encode(prompt)
    assert tok.decode(ids) == prompt
    assert ids[0] == tok.token_id("<|start|>")  # no BOS in harmony prompts
    assert ids.count(tok.token_id("<|call|>")) == 1


@pytest.mark.slow  # importing transformers takes several seconds
def test_harmony_template_same_under_transformers_renderer():
    utils = pytest.importorskip("transformers.utils.chat_template_utils")
    msgs = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Weather in SF?"},
        {"role": "assistant", "reasoning": "Need weather.", "tool_calls": [{"id": "1", "type": "function", "function": {"name": "get_current_weather", "arguments": {"location": "SF"}}}]},
        {"role": "tool", "tool_call_id": "1", "content": "20 C"},
    ]
    ours = harmony(msgs, tools=WEATHER_TOOLS, reasoning_effort="low")
    rendered, _ = utils.render_jinja_template(
        conversations=[msgs], tools=WEATHER_TOOLS, chat_template=harmony_template(), add_generation_prompt=True,
        current_date=DATE, reasoning_effort="low",
    )
    assert rendered[0] == ours
    assert "<|channel|>analysis<|message|>Need weather.<|end|>" in ours


# ---------- renderer ----------
def test_tojson_matches_hf_arguments():
    tpl = "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ x | tojson(ensure_ascii=True) }}|{{ x | tojson(separators=(',', ':'), sort_keys=True) }}"
    x = {"b": "<é>", "a": [1, 2]}
    got = render_chat(tpl, [], extra_vars={"x": x}).split("|")
    assert got == [json.dumps(x, ensure_ascii=False), json.dumps(x, indent=2, ensure_ascii=False), json.dumps(x), json.dumps(x, separators=(",", ":"), sort_keys=True, ensure_ascii=False)]


def test_chatml_like_template_with_loop_controls():
    tpl = (
        "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% if loop.index >= 3 %}{% break %}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    msgs = [{"role": "user", "content": "a"}, {"role": "skip", "content": "b"}, {"role": "assistant", "content": "c"}, {"role": "user", "content": "d"}]
    assert render_chat(tpl, msgs) == "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nc<|im_end|>\n<|im_start|>assistant\n"


def test_trim_blocks_and_generation_block():
    tpl = "{% if true %}\n  A\n{% endif %}\n{% generation %}B{% endgeneration %}"
    assert render_chat(tpl, []) == "  A\nB"


def test_strftime_now_and_kwargs():
    got = render_chat("{{ strftime_now('%Y') }} {{ bos_token }}", [], extra_vars={"bos_token": "<s>"})
    assert got in {f"{datetime.date.today().year} <s>", f"{datetime.date.today().year - 1} <s>"}


def test_template_errors_are_chat_template_errors():
    with pytest.raises(ChatTemplateError, match="rejected the request: nope"):
        render_chat("{{ raise_exception('nope') }}", [])
    with pytest.raises(ChatTemplateError, match="syntax error at line 1"):
        render_chat("{% if %}", [])
    with pytest.raises(ChatTemplateError, match="unsafe operation"):
        render_chat("{{ messages.append(1) }}", [])
    with pytest.raises(ChatTemplateError):
        render_chat("{{ ''.__class__.__mro__[1].__subclasses__() }}", [])
    with pytest.raises(ChatTemplateError, match="empty"):
        render_chat("  ", [])
    with pytest.raises(ChatTemplateError, match="'messages' is set from"):
        render_chat("{{ messages }}", [], extra_vars={"messages": "x"})


@pytest.mark.parametrize(
    "messages, message",
    [("hello", "must be a list"), ([1], r"messages\[0\] must be an object"), ([{"content": "x"}], r"messages\[0\] has no string 'role'")],
)
def test_bad_messages(messages, message):
    with pytest.raises(ChatTemplateError, match=message):
        render_chat("{{ messages }}", messages)
