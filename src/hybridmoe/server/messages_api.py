"""Anthropic Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) over the chat path.

A request becomes a `ChatCompletionRequest` and goes through `Serving.start_chat` (templates,
sampling, harmony parsing are the chat path's). The reply's harmony messages become content
blocks: analysis -> `thinking` (gpt-oss always reasons, so these come whatever `thinking` says;
it sets the reasoning effort), final -> `text`, calls to `functions.NAME` -> `tool_use`.
Errors on these routes use Anthropic's shape (`anthropic_error_body`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator

from hybridmoe.server.chat_view import ChatView
from hybridmoe.server.output_blocks import Block, BlockEvent, BlockFolder
from hybridmoe.server.protocol import (
    APIError,
    Lenient,
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDef,
    Tool,
    ToolCall,
    bad_request,
    validate_tagged,
)
from hybridmoe.server.serving import Disconnected, Serving, events

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
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]

    def blocks(self, what: str) -> list[Any]:
        if isinstance(self.content, str):
            return [TextBlockIn(type="text", text=self.content)]
        return [validate_tagged(b, _BLOCKS, f"{what}.content[{j}]") for j, b in enumerate(self.content)]


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


# ---- request -> chat request ------------------------------------------------------------------
def to_messages(req: MessagesInput) -> list[ChatMessage]:
    """Blocks in order: a user turn's tool results become tool messages, its text a user message;
    an assistant turn's thinking, text and tool uses one assistant message."""
    out: list[ChatMessage] = []
    system = req.system_text()
    if system:
        out.append(ChatMessage(role="system", content=system))
    for i, m in enumerate(req.messages):
        what = f"messages[{i}]"
        blocks = m.blocks(what)
        if m.role == "assistant":
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


def _chat_request(req: MessagesInput, max_tokens: int | None) -> ChatCompletionRequest:
    tools = [Tool(function=FunctionDef(name=t.name, description=t.description, parameters=t.input_schema))
             for t in req.custom_tools()] or None
    tc = req.tool_choice
    choice: str | dict[str, Any] | None = None
    if tc is not None:
        if tc.type == "tool" and not tc.name:
            raise bad_request("tool_choice of type 'tool' needs a 'name'", param="tool_choice")
        choice = {"auto": "auto", "any": "required", "none": "none"}.get(tc.type) or \
            {"type": "function", "function": {"name": tc.name}}
    try:
        chat = ChatCompletionRequest(
            model=req.model, messages=to_messages(req), max_tokens=max_tokens, temperature=req.temperature,
            top_p=req.top_p, top_k=req.top_k, tools=tools, tool_choice=choice,
            reasoning_effort=req.thinking.effort() if req.thinking else None, reasoning_format="auto",
            reasoning_budget_tokens=req.thinking.budget() if req.thinking else -1,
        )
    except ValidationError as e:  # a tool_choice naming a function that is not in `tools`
        raise bad_request(str(e.errors()[0]["msg"]).removeprefix("Value error, "), param="tool_choice") from None
    chat.stop = [s for s in req.stop_sequences or () if s]  # after validation: Anthropic sets no limit of 4
    return chat


async def count_tokens(serving: Serving, req: MessagesInput) -> dict[str, Any]:
    return {"input_tokens": len(await serving.chat_prompt_ids(_chat_request(req, None)))}


async def create(serving: Serving, req: MessagesRequest,
                 disconnected: Disconnected | None = None) -> dict[str, Any] | AsyncIterator[str]:
    handle, view = await serving.start_chat(_chat_request(req, req.max_tokens))
    run = _Run(serving, view, len(handle.request.prompt_ids), list(handle.request.stop))
    if req.stream:
        return run.sse(handle)
    async for _ in run.events(events(handle, disconnected)):
        pass
    final = run.folder.final
    if final is None or final.finish_reason in ("error", "cancelled"):
        raise APIError(500, f"generation failed: {final.error if final else 'cancelled'}", type="server_error")
    return run.message()


# ---- engine events -> content blocks and stream events ----------------------------------------
def _tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic clients expect; text that is not a JSON object
    is passed on under `raw_arguments` rather than dropped."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        value = None
    return value if isinstance(value, dict) else {"raw_arguments": arguments}


class _Run:
    def __init__(self, serving: Serving, view: ChatView, n_prompt: int, stops: list[str]) -> None:
        self.serving = serving
        self.stops = stops
        self.folder = BlockFolder(view)
        self.id = f"msg_{uuid.uuid4().hex}"
        self.n_prompt = n_prompt

    async def sse(self, handle: Any) -> AsyncIterator[str]:
        try:
            async for ev in self.events(handle):
                yield f"event: {ev['type']}\ndata: {json.dumps(ev, ensure_ascii=False)}\n\n"
        finally:
            handle.cancel()

    async def events(self, engine_events: AsyncIterator[Any]) -> AsyncIterator[dict[str, Any]]:
        """message_start, ping, per block start/deltas/stop, message_delta (stop reason, usage),
        message_stop; an engine failure ends the stream with an `error` event."""
        yield {"type": "message_start", "message": {**self.message(), "content": [], "stop_reason": None}}
        yield {"type": "ping"}
        async for bev in self.folder.stream(engine_events):
            yield from_block(bev)
        final = self.folder.final
        if final is None or final.finish_reason in ("error", "cancelled"):
            err = APIError(500, f"generation failed: {final.error if final else 'cancelled'}", type="server_error")
            yield anthropic_error_body(err)
            return
        msg = self.message()
        yield {"type": "message_delta", "delta": {"stop_reason": msg["stop_reason"],
                                                  "stop_sequence": msg["stop_sequence"]}, "usage": msg["usage"]}
        yield {"type": "message_stop"}

    def message(self) -> dict[str, Any]:
        final, view = self.folder.final, self.folder.view
        content = [_block(b) for b in self.folder.blocks]
        stop_reason = stop_sequence = None
        if final is not None:
            if final.finish_reason == "length":
                stop_reason = "max_tokens"
            elif any(b.kind == "call" for b in self.folder.blocks):
                stop_reason = "tool_use"
            elif view.stop_sequence is not None:
                stop_reason, stop_sequence = "stop_sequence", view.stop_sequence
            elif final.finish_reason == "stop" and final.stop_token_id is None and self.stops:
                # cut by a stop string inside harmony markup, where the parsed text never shows it
                stop_reason, stop_sequence = "stop_sequence", self._stop_in_raw_text()
            else:
                stop_reason = "end_turn"
        u = final.usage if final is not None else None
        cached = u.cached_tokens if u else 0
        usage = {"input_tokens": (u.prompt_tokens if u else self.n_prompt) - cached,
                 "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
                 "output_tokens": u.completion_tokens if u else 0,
                 "output_tokens_details": {"thinking_tokens": view.reasoning_tokens}}
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.serving.model_id,
                "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}

    def _stop_in_raw_text(self) -> str | None:
        """The earliest of the request's stop strings in the reply's raw text (markup included)."""
        raw = self.serving.tokenizer.decode(self.folder.token_ids)
        hits = [(raw.find(s), s) for s in self.stops if s and s in raw]
        return min(hits)[1] if hits else None


def _block(b: Block) -> dict[str, Any]:
    if b.kind == "reasoning":
        return {"type": "thinking", "thinking": b.text, "signature": ""}
    if b.kind == "call":
        return {"type": "tool_use", "id": b.call_id, "name": b.name, "input": _tool_input(b.text)}
    return {"type": "text", "text": b.text}


def from_block(bev: BlockEvent) -> dict[str, Any]:
    b = bev.block
    if bev.kind == "open":
        start = {"reasoning": {"type": "thinking", "thinking": "", "signature": ""},
                 "text": {"type": "text", "text": ""},
                 "call": {"type": "tool_use", "id": b.call_id, "name": b.name, "input": {}}}[b.kind]
        return {"type": "content_block_start", "index": b.index, "content_block": start}
    if bev.kind == "delta":
        delta = {"reasoning": {"type": "thinking_delta", "thinking": bev.text},
                 "text": {"type": "text_delta", "text": bev.text},
                 "call": {"type": "input_json_delta", "partial_json": bev.text}}[b.kind]
        return {"type": "content_block_delta", "index": b.index, "delta": delta}
    return {"type": "content_block_stop", "index": b.index}
