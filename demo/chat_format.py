"""Training conversations in exactly the form `hybridmoe serve` renders them.

Every chat example of the corpus is rendered with the server's own harmony template
(`hybridmoe.tokenizer.chat_template.render_chat` on `hybridmoe/data/harmony_template.jinja`): the
prompt up to the generation header `<|start|>assistant`, then the text the model must generate after
it. So a prompt at serving time is token-identical to the training prompts (tests/test_demo_model.py
checks this against the server's renderer), and the completion is what the harmony parser expects.
"""
from __future__ import annotations

import json
from importlib import resources
from typing import Any

from hybridmoe.tokenizer.chat_template import render_chat
from lookup_verse import LOOKUP_VERSE_TOOL  # noqa: F401  (re-exported: the tool the corpus teaches)

TEMPLATE = resources.files("hybridmoe.data").joinpath("harmony_template.jinja").read_text()

def render_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, effort: str,
                  date: str) -> str:
    """The prompt the server builds for this request, ending with the generation header."""
    return render_chat(TEMPLATE, messages, tools=tools, add_generation_prompt=True,
                       extra_vars={"reasoning_effort": effort, "current_date": date})


def final_reply(answer: str, reasoning: str = "") -> str:
    """What the model generates for a final answer, optionally after analysis-channel reasoning."""
    head = f"<|channel|>analysis<|message|>{reasoning}<|end|><|start|>assistant" if reasoning else ""
    return f"{head}<|channel|>final<|message|>{answer}<|return|>"


def tool_call_reply(name: str, args: dict[str, Any], reasoning: str = "") -> str:
    """What the model generates to call a function tool (compact JSON arguments, ends with <|call|>)."""
    head = f"<|channel|>analysis<|message|>{reasoning}<|end|><|start|>assistant" if reasoning else ""
    payload = json.dumps(args, separators=(",", ":"), ensure_ascii=False)
    return f"{head}<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{payload}<|call|>"


def call_message(name: str, args: dict[str, Any], reasoning: str = "") -> dict[str, Any]:
    """The assistant message a client sends back after receiving that tool call."""
    msg: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_0", "type": "function",
        "function": {"name": name, "arguments": json.dumps(args, separators=(",", ":"), ensure_ascii=False)}}]}
    if reasoning:
        msg["reasoning_content"] = reasoning
    return msg
