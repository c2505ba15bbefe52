"""Checks on a chat conversation before it is rendered, with llama-server's rules.

A trailing assistant message is continued (prefilled) rather than answered, two trailing
assistant messages are refused, `continue_final_message` excludes `add_generation_prompt`,
and a past tool call's arguments must be JSON. Errors name the message index and role.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from hybridmoe.server.protocol import ChatMessage, bad_request


@dataclass(frozen=True)
class RenderPlan:
    """How to render: with a generation prompt, or continuing the last (assistant) message."""

    add_generation_prompt: bool
    continue_final: bool


def _where(i: int, m: ChatMessage) -> str:
    return f"messages[{i}] (role '{m.role}')"


def check_messages(messages: list[ChatMessage], add_generation_prompt: bool,
                   continue_final_message: bool | None) -> RenderPlan:
    """The render plan for `messages`, or an APIError (400) naming the offending message."""
    for i, m in enumerate(messages):
        for j, call in enumerate(m.tool_calls or []):
            args = call.function.arguments
            if isinstance(args, str):
                try:
                    json.loads(args)
                except json.JSONDecodeError as e:
                    raise bad_request(f"{_where(i, m)}: tool_calls[{j}].function.arguments is not valid JSON "
                                      f"({e.msg} at character {e.pos})",
                                      param=f"messages[{i}].tool_calls[{j}].function.arguments") from None
    last = len(messages) - 1
    cont = bool(continue_final_message)
    if continue_final_message is None and messages[last].role == "assistant":
        # llama-server's prefill: a final assistant message is continued, not answered.
        if last >= 1 and messages[last - 1].role == "assistant":
            raise bad_request(f"{_where(last, messages[last])}: cannot have 2 or more assistant messages at the "
                              "end of the list", param=f"messages[{last}]")
        cont, add_generation_prompt = True, False
    if cont and add_generation_prompt:
        raise bad_request("cannot set both add_generation_prompt and continue_final_message to true",
                          param="continue_final_message")
    if cont:
        m = messages[last]
        if m.role != "assistant":
            raise bad_request(f"{_where(last, m)}: continue_final_message needs a final assistant message",
                              param="continue_final_message")
        if m.tool_calls:
            raise bad_request(f"{_where(last, m)}: cannot continue an assistant message that contains tool calls",
                              param="continue_final_message")
    return RenderPlan(add_generation_prompt=add_generation_prompt, continue_final=cont)

