"""Responses API input items (and our stored output items) -> chat messages.

Clients that keep the conversation themselves (Codex CLI: `store: false`) send every item back:
messages, reasoning (with our `encrypted_content`), function and freeform tool calls and their
outputs. Calls render under the flat name the model was offered (server/responses_tools.py), so
the prompt reads as the model wrote it.
"""

from __future__ import annotations

import base64
from typing import Any, Literal

from pydantic import BaseModel, Field

from hybridmoe.server.protocol import ChatMessage, FunctionCall, Lenient, ToolCall, validate_tagged
from hybridmoe.server.responses_tools import ToolMap, freeform_arguments, wire_name


class TextPart(Lenient):
    type: str
    text: str


_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


def text_parts(parts: str | list[Any], what: str) -> str:
    """A content list's text (text parts only: images, files and audio are refused by name)."""
    if isinstance(parts, str):
        return parts
    out = []
    for j, part in enumerate(parts):
        out.append(validate_tagged(part, dict.fromkeys(_TEXT_PARTS, TextPart), f"{what}.content[{j}]").text)
    return "".join(out)


class MessageItem(Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]

    def text(self, what: str) -> str:
        return text_parts(self.content, what)


class FunctionCallItem(Lenient):
    type: Literal["function_call"]
    call_id: str
    name: str = Field(min_length=1)
    arguments: str
    namespace: str | None = None  # a function of a `namespace` tool (Codex)


class CustomToolCallItem(Lenient):
    """A call to a freeform tool: `input` is the raw text (Codex's apply_patch patch)."""

    type: Literal["custom_tool_call"]
    call_id: str
    name: str = Field(min_length=1)
    input: str
    namespace: str | None = None


class FunctionCallOutputItem(Lenient):
    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: str
    output: str | list[dict[str, Any]]


# `encrypted_content` of our reasoning items (include: ["reasoning.encrypted_content"], for clients
# that keep no state, store: false): not encrypted, the reasoning text in base64 behind a tag, so
# an item given back with only that field still restores the reasoning.
_CARRIED = "hybridmoe-reasoning-v1:"


def carry_reasoning(text: str) -> str:
    return _CARRIED + base64.b64encode(text.encode("utf-8")).decode("ascii")


def _carried_text(value: str | None) -> str | None:
    """The text in one of our `encrypted_content` values; None for anything else (another server's)."""
    if not value or not value.startswith(_CARRIED):
        return None
    try:
        return base64.b64decode(value[len(_CARRIED):], validate=True).decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        return None


class ReasoningItem(Lenient):
    type: Literal["reasoning"]
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None

    def text(self, what: str) -> str:
        """The raw reasoning (content) when given back, else what our encrypted_content carries,
        else its summary."""
        if self.content:
            return text_parts(self.content, what)
        carried = _carried_text(self.encrypted_content)
        return carried if carried is not None else text_parts(self.summary, what)


class AdditionalToolsItem(Lenient):
    """Tools declared among the input items (Codex's incremental tools for its newest models):
    offered like `tools`; not a turn of the conversation."""

    type: Literal["additional_tools"]
    tools: list[dict[str, Any]] = Field(default_factory=list)


InputItem = (AdditionalToolsItem | MessageItem | FunctionCallItem | CustomToolCallItem | FunctionCallOutputItem
             | ReasoningItem)
_ITEM_KINDS: dict[str, type[BaseModel]] = {
    "message": MessageItem, "function_call": FunctionCallItem, "custom_tool_call": CustomToolCallItem,
    "function_call_output": FunctionCallOutputItem, "custom_tool_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem, "additional_tools": AdditionalToolsItem}


def parse_items(raw: list[Any], what: str = "input") -> list[InputItem]:
    """Validate input items (an item without `type` is a message, as in the API); ValueError names
    the item. Text-only content is checked here too, so rendering cannot fail on a part type."""
    items = []
    for i, obj in enumerate(raw):
        item = validate_tagged(obj, _ITEM_KINDS, f"{what}[{i}]", default="message")
        if isinstance(item, (MessageItem, ReasoningItem)):
            item.text(f"{what}[{i}]")
        elif isinstance(item, FunctionCallOutputItem):
            text_parts(item.output, f"{what}[{i}].output")
        elif isinstance(item, AdditionalToolsItem):
            ToolMap.parse(item.tools, f"{what}[{i}].tools")
        items.append(item)
    return items


def _call(item: FunctionCallItem | CustomToolCallItem) -> ToolCall:
    """The chat tool call the model wrote for this item (flat name; a freeform input re-wrapped)."""
    name = wire_name(item.name, item.namespace)
    if isinstance(item, CustomToolCallItem):
        arguments = freeform_arguments(item.input)
    else:
        arguments = item.arguments
    return ToolCall(id=item.call_id, function=FunctionCall(name=name, arguments=arguments))


def items_to_messages(items: list[InputItem]) -> list[ChatMessage]:
    """Reasoning items, assistant messages and tool calls that follow each other form one
    assistant turn (harmony re-renders its analysis only before calls); outputs become tool messages."""
    out: list[ChatMessage] = []
    turn: ChatMessage | None = None  # the assistant message being assembled

    def assistant() -> ChatMessage:
        nonlocal turn
        if turn is None:
            turn = ChatMessage(role="assistant")
            out.append(turn)
        return turn

    for i, item in enumerate(items):
        what = f"input[{i}]"
        if isinstance(item, AdditionalToolsItem):
            continue
        if isinstance(item, ReasoningItem):
            if turn is not None and (turn.content or turn.tool_calls):
                turn = None
            msg = assistant()
            msg.reasoning_content = (msg.reasoning_content or "") + item.text(what)
        elif isinstance(item, (FunctionCallItem, CustomToolCallItem)):
            msg = assistant()
            msg.tool_calls = [*(msg.tool_calls or []), _call(item)]
        elif isinstance(item, FunctionCallOutputItem):
            turn = None
            out.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=text_parts(item.output, what)))
        elif item.role == "assistant":
            if turn is not None and (turn.content or turn.tool_calls):
                turn = None
            assistant().content = item.text(what)
        else:
            turn = None
            out.append(ChatMessage(role=item.role, content=item.text(what)))
    return out


def declared_tools(tools: list[dict[str, Any]] | None, items: list[InputItem]) -> ToolMap:
    """A request's tools: its `tools` and those of its `additional_tools` items, later ones
    replacing earlier ones of the same name."""
    out = ToolMap.parse(tools)
    for i, item in enumerate(items):
        if isinstance(item, AdditionalToolsItem):
            out.add(item.tools, f"input[{i}].tools")
    return out
