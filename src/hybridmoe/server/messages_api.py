"""Anthropic Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) over the chat path.

A request becomes a `ChatJob` (templates, sampling and the chat format's parsing are the chat
path's). The reply's blocks become content blocks: reasoning -> `thinking` (gpt-oss always
reasons, so these come whatever `thinking` says; it sets the reasoning effort), text -> `text`,
calls -> `tool_use` (arguments that are not a JSON object under `raw_arguments`).
Errors on these routes use Anthropic's shape (`anthropic_error_body`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from pydantic import BaseModel, Field, field_validator

from hybridmoe.engine.engine import PromptProgress
from hybridmoe.server.generation import SSEvent
from hybridmoe.server.jobs import ChatJob
from hybridmoe.server.protocol import (
    APIError,
    ChatMessage,
    FunctionCall,
    FunctionDef,
    Lenient,
    SamplingFields,
    Tool,
    ToolCall,
    bad_request,
    check_forced_tool,
    forced_tool,
    validate_tagged,
)
from hybridmoe.server.reply import Block, BlockClose, BlockDelta, BlockOpen, Finished, Reply, ReplyEvent
from hybridmoe.server.wiring import Wiring

# Anthropic's error type per HTTP status (their documented set; 503 is their "overloaded").
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_body(err: APIError) -> dict[str, Any]:
    """`{"type": "error", "error": {"type", "message"}}`; the parameter, when known, leads the message."""
    kind = _ERROR_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "api_error")
    msg = err.message if not err.param or err.message.startswith(err.param) else f"{err.param}: {err.message}"
    return {"type": "error", "error": {"type": kind, "message": msg}}


# ---- request ----------------------------------------------------------------------------------
class TextBlockIn(Lenient):
    type: Literal["text"]
    text: str


class ToolUseBlockIn(Lenient):
    type: Literal["tool_use"]
    id: str
    name: str = Field(min_length=1)
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlockIn(Lenient):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[dict[str, Any]] = ""
    is_error: bool = False

    def text(self, what: str) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(validate_tagged(b, {"text": TextBlockIn}, f"{what}.content[{j}]").text
                       for j, b in enumerate(self.content))


class ThinkingBlockIn(Lenient):
    type: Literal["thinking"]
    thinking: str


class RedactedThinkingBlockIn(Lenient):
    type: Literal["redacted_thinking"]  # encrypted reasoning from another server: nothing to re-feed


_BLOCKS: dict[str, type[BaseModel]] = {
    "text": TextBlockIn, "tool_use": ToolUseBlockIn, "tool_result": ToolResultBlockIn,
    "thinking": ThinkingBlockIn, "redacted_thinking": RedactedThinkingBlockIn}


class InputMessage(Lenient):
    role: Literal["user", "assistant", "system"]  # "system": context Claude Code sends inside the chat
    content: str | list[dict[str, Any]]

    def blocks(self, what: str) -> list[Any]:
        if isinstance(self.content, str):
            return [TextBlockIn(type="text", text=self.content)]
        kinds = {"text": TextBlockIn} if self.role == "system" else _BLOCKS
        return [validate_tagged(b, kinds, f"{what}.content[{j}]") for j, b in enumerate(self.content)]


class ToolIn(Lenient):
    type: Literal["custom"] = "custom"
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]


class ThinkingConfig(Lenient):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=0)

    def effort(self) -> str | None:
        """gpt-oss reasons at three levels: a budget picks one (Anthropic's minimum budget is 1024)."""
        if self.type == "disabled":
            return "low"
        if self.type == "adaptive" or self.budget_tokens is None:
            return None
        return "low" if self.budget_tokens <= 4096 else "medium" if self.budget_tokens <= 16384 else "high"

    def budget(self) -> int:
        """The thinking tokens allowed: `budget_tokens` when enabled (held to it, as the server's
        reasoning budget does), else -1 (the server's default)."""
        return self.budget_tokens if self.type == "enabled" and self.budget_tokens is not None else -1


class ToolChoiceIn(Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class MessagesInput(Lenient):
    """What `count_tokens` takes: a request less its generation settings."""

    model: str | None = None  # Anthropic requires it; llama-server (any model is served) does not
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoiceIn | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    thinking: ThinkingConfig | None = None

    @field_validator("messages")
    @classmethod
    def _blocks(cls, v: list[InputMessage]) -> list[InputMessage]:
        for i, m in enumerate(v):
            for block in m.blocks(f"messages[{i}]"):
                if isinstance(block, ToolResultBlockIn):
                    block.text(f"messages[{i}]")
        if v[-1].role == "assistant":
            raise ValueError("a final assistant message (prefill) is not supported: gpt-oss answers in its own "
                             "harmony channels")
        return v

    @field_validator("system")
    @classmethod
    def _system_text(cls, v: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        for j, b in enumerate(v if isinstance(v, list) else ()):
            validate_tagged(b, {"text": TextBlockIn}, f"system[{j}]")
        return v

    @field_validator("tools")
    @classmethod
    def _custom_tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, t in enumerate(v or ()):
            validate_tagged(t, {"custom": ToolIn}, f"tools[{i}]", default="custom")
        return v

    def system_text(self) -> str | None:
        if isinstance(self.system, list):
            return "\n\n".join(TextBlockIn.model_validate(b).text for b in self.system)
        return self.system

    def custom_tools(self) -> list[ToolIn]:
        return [ToolIn.model_validate({"type": "custom", **t}) for t in self.tools or ()]


class MessagesRequest(MessagesInput):
    max_tokens: int = Field(ge=1)  # required, as Anthropic requires it
    stream: bool = False


# ---- request -> job ---------------------------------------------------------------------------
@dataclass
class Turn:
    what: str  # the message it comes from, as error messages name it
    role: Literal["user", "assistant"]
    blocks: list[Any]


def turns(messages: list[InputMessage]) -> list[Turn]:
    """The user and assistant turns, each role "system" message folded into the neighbouring user
    turn as a `<system-reminder>` text block, as Claude Code itself resends it to servers that
    refuse the role: into the user turn before it, else the one after, else a turn of its own.
    (Merged into the top-level system prompt it would change the prompt's start every turn and
    lose the cached prompt.)"""
    out: list[Turn] = []
    waiting: list[TextBlockIn] = []  # reminders that came after an assistant turn
    for i, m in enumerate(messages):
        what = f"messages[{i}]"
        blocks = m.blocks(what)
        if m.role == "system":
            text = "\n\n".join(b.text for b in blocks if b.text)
            if not text:  # Claude Code sends settings-only ones (`content: []`)
                continue
            reminder = TextBlockIn(type="text", text=f"<system-reminder>\n{text}\n</system-reminder>")
            if out and out[-1].role == "user":
                out[-1].blocks.append(reminder)
            else:
                waiting.append(reminder)
        elif m.role == "user":
            out.append(Turn(what, "user", [*waiting, *blocks]))
            waiting = []
        else:
            out.append(Turn(what, "assistant", blocks))
    if waiting:
        out.append(Turn(f"messages[{len(messages) - 1}]", "user", waiting))
    return out


def to_messages(req: MessagesInput) -> list[ChatMessage]:
    """Blocks in order: a user turn's tool results become tool messages, its text a user message;
    an assistant turn's thinking, text and tool uses one assistant message."""
    out: list[ChatMessage] = []
    system = req.system_text()
    if system:
        out.append(ChatMessage(role="system", content=system))
    for turn in turns(req.messages):
        what, blocks = turn.what, turn.blocks
        if turn.role == "assistant":
            msg = ChatMessage(role="assistant", content="".join(b.text for b in blocks if isinstance(b, TextBlockIn)))
            thinking = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlockIn))
            msg.reasoning_content = thinking or None
            calls = [ToolCall(id=b.id, function=FunctionCall(name=b.name, arguments=json.dumps(b.input)))
                     for b in blocks if isinstance(b, ToolUseBlockIn)]
            msg.tool_calls = calls or None
            out.append(msg)
            continue
        text: list[str] = []
        for b in blocks:
            if isinstance(b, ToolResultBlockIn):
                result = b.text(what)
                out.append(ChatMessage(role="tool", tool_call_id=b.tool_use_id,
                                       content=f"Error: {result}" if b.is_error else result))
            elif isinstance(b, TextBlockIn):
                text.append(b.text)
        if text:
            out.append(ChatMessage(role="user", content="\n\n".join(text)))
    return out


def messages_job(req: MessagesInput, max_tokens: int | None) -> ChatJob:
    tools = [Tool(function=FunctionDef(name=t.name, description=t.description, parameters=t.input_schema))
             for t in req.custom_tools()] or None
    tc = req.tool_choice
    choice: str | dict[str, Any] | None = None
    if tc is not None:
        if tc.type == "tool" and not tc.name:
            raise bad_request("tool_choice of type 'tool' needs a 'name'", param="tool_choice")
        choice = {"auto": "auto", "any": "required", "none": "none"}.get(tc.type) or \
            {"type": "function", "function": {"name": tc.name}}
    forced = forced_tool(choice)
    try:
        check_forced_tool(forced, tools, constrained=False)
    except ValueError as e:  # a tool_choice naming a function that is not in `tools`
        raise bad_request(str(e), param="tool_choice") from None
    sampling = SamplingFields(model=req.model, max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                              top_k=req.top_k)
    sampling.stop = [s for s in req.stop_sequences or () if s]  # after validation: Anthropic sets no limit of 4
    return ChatJob(messages=to_messages(req), sampling=sampling, tools=None if choice == "none" else tools,
                   forced_tool=forced, token_limit=max_tokens,
                   reasoning_effort=req.thinking.effort() if req.thinking else None, reasoning_format="auto",
                   reasoning_budget_tokens=req.thinking.budget() if req.thinking else -1)


# ---- reply events -> content blocks and stream events -------------------------------------------
def _tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic clients expect; text that is not a JSON object
    is passed on under `raw_arguments` rather than dropped."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        value = None
    return value if isinstance(value, dict) else {"raw_arguments": arguments}


def content_block(b: Block) -> dict[str, Any]:
    if b.kind == "reasoning":
        return {"type": "thinking", "thinking": b.text, "signature": ""}
    if b.kind == "call":
        return {"type": "tool_use", "id": b.call_id, "name": b.name, "input": _tool_input(b.text)}
    return {"type": "text", "text": b.text}


def block_event(bev: BlockOpen | BlockDelta | BlockClose) -> dict[str, Any] | None:
    """The stream event of one block event (None: a delta with no text, such as logprobs alone)."""
    b = bev.block
    if isinstance(bev, BlockOpen):
        start = {"reasoning": {"type": "thinking", "thinking": "", "signature": ""},
                 "text": {"type": "text", "text": ""},
                 "call": {"type": "tool_use", "id": b.call_id, "name": b.name, "input": {}}}[b.kind]
        return {"type": "content_block_start", "index": b.index, "content_block": start}
    if isinstance(bev, BlockDelta):
        if not bev.text:
            return None
        delta = {"reasoning": {"type": "thinking_delta", "thinking": bev.text},
                 "text": {"type": "text_delta", "text": bev.text},
                 "call": {"type": "input_json_delta", "partial_json": bev.text}}[b.kind]
        return {"type": "content_block_delta", "index": b.index, "delta": delta}
    return {"type": "content_block_stop", "index": b.index}


class MessagesRender:
    """One message: its JSON object, or message_start, ping, per block start/deltas/stop,
    message_delta (stop reason, usage), message_stop; a failed reply ends the stream with an
    `error` event. `failure`: the error a finished reply stands for."""

    def __init__(self, model: str, n_prompt: int, failure: Callable[[Reply], APIError | None]) -> None:
        self.model, self.n_prompt, self.failure = model, n_prompt, failure
        self.id = f"msg_{uuid.uuid4().hex}"
        self.reply: Reply | None = None

    def json(self, replies: list[Reply]) -> dict[str, Any]:
        self.reply = replies[0]
        return self.message()

    def _event(self, ev: dict[str, Any]) -> SSEvent:
        return SSEvent(ev, event=ev["type"])

    def opening(self) -> list[SSEvent]:
        start = {"type": "message_start", "message": {**self.message(), "content": [], "stop_reason": None}}
        return [self._event(start), self._event({"type": "ping"})]

    def progress(self, i: int, p: PromptProgress) -> list[SSEvent]:
        return []

    def events(self, i: int, events: list[ReplyEvent]) -> list[SSEvent]:
        out = []
        for ev in events:
            if isinstance(ev, (BlockOpen, BlockDelta, BlockClose)):
                out += [self._event(e) for e in (block_event(ev),) if e is not None]
            elif isinstance(ev, Finished):
                out += self._finished(ev.reply)
        return out

    def _finished(self, reply: Reply) -> list[SSEvent]:
        self.reply = reply
        if reply.finish_reason in ("error", "cancelled"):
            err = self.failure(reply) or APIError(500, f"generation failed: {reply.error or 'cancelled'}",
                                                  type="server_error")
            return [self._event(anthropic_error_body(err))]
        msg = self.message()
        return [self._event({"type": "message_delta", "delta": {"stop_reason": msg["stop_reason"],
                                                                  "stop_sequence": msg["stop_sequence"]},
                             "usage": msg["usage"]}),
                self._event({"type": "message_stop"})]

    def closing(self) -> list[SSEvent]:
        return []

    def message(self) -> dict[str, Any]:
        r = self.reply
        stop_reason = stop_sequence = None
        if r is not None:
            if r.finish_reason == "length":
                stop_reason = "max_tokens"
            elif r.calls():
                stop_reason = "tool_use"
            elif r.stop_word is not None:
                stop_reason, stop_sequence = "stop_sequence", r.stop_word
            else:
                stop_reason = "end_turn"
        u = r.usage if r is not None else None
        cached = u.cached_tokens if u else 0
        usage = {"input_tokens": (u.prompt_tokens if u else self.n_prompt) - cached,
                 "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
                 "output_tokens": u.completion_tokens if u else 0,
                 "output_tokens_details": {"thinking_tokens": r.reasoning_tokens if r is not None else 0}}
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [content_block(b) for b in r.blocks] if r is not None else [],
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}


def register(app: FastAPI, w: Wiring) -> None:
    @app.post("/v1/messages")
    async def messages(req: MessagesRequest, request: Request) -> Any:
        s = w.service()
        gen = await s.start_chat(messages_job(req, req.max_tokens))
        render = MessagesRender(s.model_id, len(gen.requests[0].prompt_ids), s.consumer.failure)
        if req.stream:
            return s.consumer.stream(gen, render, w.ping_interval(req))
        return render.json(await s.consumer.replies(gen, request.is_disconnected))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(req: MessagesInput) -> Any:
        _, ids = await w.service().chat_prompt(messages_job(req, None))
        return {"input_tokens": len(ids)}
