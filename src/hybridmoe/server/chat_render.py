"""Chat template rendering with the variables llama-server gives a template, and continuation.

Variables: `messages`, `tools`, `add_generation_prompt`, `bos_token`, `eos_token`,
`enable_thinking` (from `--reasoning`, overridden by `chat_template_kwargs.enable_thinking` or
`reasoning_effort: "none"`), `date_string` ("%d %b %Y") and `datetime` ("%b %d %Y"), then the
server's and the request's `chat_template_kwargs` (the request's win) and `reasoning_effort`.

Continuing a final assistant message (llama-server's prefill): the chat format writes the message
after the generation prompt (harmony: its channels, open, as llama-server does for gpt-oss), or,
for formats that leave it to the template, the rendered message is cut where its content ends.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from hybridmoe.server.chat_checks import RenderPlan
from hybridmoe.server.protocol import ChatMessage, Tool, bad_request
from hybridmoe.tokenizer.chat_format import ChatFormat
from hybridmoe.tokenizer.chat_template import RESERVED_TEMPLATE_VARS, ChatTemplateError, render_chat

_MARKER = "\x00hybridmoe-continuation\x00"


@dataclass(frozen=True)
class Rendered:
    prompt: str
    continuation: str  # the tail of `prompt` the model continues (already part of its reply), "" if none
    enable_thinking: bool


def thinking_enabled(reasoning: str, kwargs: dict[str, Any], effort: str | None) -> bool:
    """llama-server's rule: --reasoning on/auto -> True, off -> False; the request's
    chat_template_kwargs.enable_thinking (a boolean) wins; reasoning_effort "none" turns it off."""
    enabled = reasoning != "off"
    if "enable_thinking" in kwargs:
        v = kwargs["enable_thinking"]
        if not isinstance(v, bool):
            raise bad_request(f'invalid type for "enable_thinking" (expected boolean, got {type(v).__name__})',
                              param="chat_template_kwargs.enable_thinking")
        enabled = v
    if effort == "none":
        enabled = False
    return enabled


class ChatRenderer:
    """Renders conversations with one template and the server-wide template settings."""

    def __init__(self, template: str, tokenizer: Any, server_kwargs: dict[str, Any], reasoning: str,
                 chat_format: ChatFormat) -> None:
        self.template = template
        self.server_kwargs = dict(server_kwargs)
        self.reasoning = reasoning  # on | off | auto
        self.format = chat_format
        self.special = {
            "bos_token": tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id is not None else "",
            "eos_token": tokenizer.token_text(tokenizer.eos_id) if tokenizer.eos_id is not None else "",
        }

    def variables(self, kwargs: dict[str, Any] | None, effort: str | None) -> dict[str, Any]:
        request_kwargs = kwargs or {}
        now = dt.datetime.now()
        merged = {k: v for k, v in {**self.server_kwargs, **request_kwargs}.items()
                  if k not in RESERVED_TEMPLATE_VARS}
        out: dict[str, Any] = {
            **self.special,
            "date_string": now.strftime("%d %b %Y"),
            "datetime": now.strftime("%b %d %Y"),
            **merged,
            "enable_thinking": thinking_enabled(self.reasoning, merged, effort),
        }
        if effort is not None and effort != "none":
            out["reasoning_effort"] = effort
        elif effort == "none":
            out.pop("reasoning_effort", None)
        return out

    def render(self, messages: list[ChatMessage], tools: list[Tool] | None, effort: str | None,
               kwargs: dict[str, Any] | None, plan: RenderPlan) -> Rendered:
        variables = self.variables(kwargs, effort)
        tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
        msgs = [m.for_template() for m in messages]
        if not plan.continue_final:
            prompt = self._render(msgs, tool_dicts, plan.add_generation_prompt, variables)
            return Rendered(prompt, "", variables["enable_thinking"])
        last = messages[-1]
        content = last.text() or ""
        reasoning = last.reasoning_content or last.thinking or ""
        tail = self.format.continuation(reasoning, content)
        if tail is not None:
            head = self._render(msgs[:-1], tool_dicts, True, variables)
            return Rendered(head + tail, tail, variables["enable_thinking"])
        marked = [*msgs[:-1], {**msgs[-1], "content": _MARKER}]
        text = self._render(marked, tool_dicts, False, variables)
        cut = text.rfind(_MARKER)
        if cut < 0:
            raise bad_request("the chat template does not render the final assistant message's content, so it "
                              "cannot be continued", param="continue_final_message")
        return Rendered(text[:cut] + content, content, variables["enable_thinking"])

    def _render(self, msgs: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool,
                variables: dict[str, Any]) -> str:
        try:
            return render_chat(self.template, msgs, tools=tools, add_generation_prompt=add_generation_prompt,
                               extra_vars=variables)
        except ChatTemplateError as e:  # raise_exception in the template, bad roles: the request's fault
            raise bad_request(f"chat template failed: {e}", param="messages") from None
