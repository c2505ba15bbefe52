"""Scripted harmony replies and prompt-size helpers shared by the Responses and Messages API tests."""

from __future__ import annotations

from tests.server.conftest import ServerProcess

REASONED = ("<|channel|>analysis<|message|>The user greets me.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Hello there!<|return|>")
TOOL_CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|>"
             "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
             '<|message|>{"city": "Paris"}<|call|>')
ANSWER = "<|channel|>final<|message|>It is 21 C in Paris.<|return|>"


def n_tokens(server: ServerProcess, text: str) -> int:
    status, out = server.request("POST", "/tokenize", {"content": text})
    assert status == 200, out
    return len(out["tokens"])


def chat_prompt_tokens(server: ServerProcess, messages: list[dict], tools: list[dict] | None = None) -> int:
    """Tokens of the prompt /v1/chat/completions renders for these messages (tools: name,
    description, parameters)."""
    chat_tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}}
                  for t in tools or ()]
    status, out = server.request("POST", "/apply-template", {"messages": messages, "tools": chat_tools or None})
    assert status == 200, out
    return n_tokens(server, out["prompt"])
