"""OpenAI Responses API (`POST /v1/responses`, `/v1/responses/input_tokens`) over the chat path.

A request becomes a `ChatCompletionRequest` (input items -> chat messages) and goes through
`Serving.start_chat`, so templates, sampling, constrained JSON and harmony parsing are the chat
path's. The reply's harmony messages become output items: analysis -> `reasoning`, final (and
commentary preambles) -> `message`, calls to `functions.NAME` -> `function_call`.

Stored responses (`store`, the API's default) stay in memory for `previous_response_id`:
at most `ResponseStore.MAX_RESPONSES` responses and `MAX_CHARS` characters of items, the oldest
dropped first; nothing survives a restart unless --responses-dir also writes them to files
(server/response_files.py), which replicas behind a gateway share.
"""

from __future__ import annotations

import base64
import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from hybridmoe.server.chat_view import ChatView
from hybridmoe.server.output_blocks import Block, BlockEvent, BlockFolder
from hybridmoe.server.response_files import ResponseFiles
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


# ---- request ----------------------------------------------------------------------------------
class TextPart(Lenient):
    type: str
    text: str


_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


def _text_parts(parts: str | list[Any], what: str) -> str:
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
        return _text_parts(self.content, what)


class FunctionCallItem(Lenient):
    type: Literal["function_call"]
    call_id: str
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(Lenient):
    type: Literal["function_call_output"]
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
            return _text_parts(self.content, what)
        carried = _carried_text(self.encrypted_content)
        return carried if carried is not None else _text_parts(self.summary, what)


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
_ITEM_KINDS: dict[str, type[BaseModel]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                           "function_call_output": FunctionCallOutputItem,
                                           "reasoning": ReasoningItem}


def parse_items(raw: list[Any], what: str = "input") -> list[InputItem]:
    """Validate input items (an item without `type` is a message, as in the API); ValueError names
    the item. Text-only content is checked here too, so rendering cannot fail on a part type."""
    items = []
    for i, obj in enumerate(raw):
        item = validate_tagged(obj, _ITEM_KINDS, f"{what}[{i}]", default="message")
        if isinstance(item, (MessageItem, ReasoningItem)):
            item.text(f"{what}[{i}]")
        elif isinstance(item, FunctionCallOutputItem):
            _text_parts(item.output, f"{what}[{i}].output")
        items.append(item)
    return items


class FunctionTool(Lenient):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ReasoningConfig(Lenient):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None


class TextFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("a json_schema format needs a 'schema' object")
        return self


class TextConfig(Lenient):
    format: TextFormat = Field(default_factory=TextFormat)


class ResponsesRequest(Lenient):
    model: str | None = None
    input: str | list[Any] = ""
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    text: TextConfig | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    background: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None  # "reasoning.encrypted_content", "message.output_text.logprobs"
    top_logprobs: int | None = Field(default=None, ge=0, le=20)  # with the logprobs include: alternatives per token

    def wants_logprobs(self) -> bool:
        """OpenAI's rule: output_text parts carry logprobs only with this include (top_logprobs
        alone leaves them empty)."""
        return "message.output_text.logprobs" in (self.include or ())

    @field_validator("input")
    @classmethod
    def _items(cls, v: str | list[Any]) -> str | list[Any]:
        if isinstance(v, list):
            parse_items(v)
        return v

    @field_validator("tools")
    @classmethod
    def _function_tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, t in enumerate(v or ()):
            validate_tagged(t, {"function": FunctionTool}, f"tools[{i}]")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _choice(cls, v: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if isinstance(v, str) and v not in ("none", "auto", "required"):
            raise ValueError("must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}, "
                             f"got {v!r}")
        if isinstance(v, dict) and (v.get("type") != "function" or not isinstance(v.get("name"), str)):
            raise ValueError(f"only {{\"type\": \"function\", \"name\": ...}} objects are supported, got {v!r}")
        return v

    @field_validator("background")
    @classmethod
    def _foreground(cls, v: bool) -> bool:
        if v:
            raise ValueError("background responses are not supported")
        return v

    def input_items(self) -> list[InputItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)] if self.input else []
        return parse_items(self.input)

    def function_tools(self) -> list[FunctionTool]:
        return [FunctionTool.model_validate(t) for t in self.tools or ()]

    def effort(self) -> str | None:
        e = self.reasoning.effort if self.reasoning else None
        return {"none": "low", "minimal": "low", "xhigh": "high"}.get(e, e) if e else None


# ---- input items -> chat messages -------------------------------------------------------------
def items_to_messages(items: list[InputItem]) -> list[ChatMessage]:
    """Reasoning items, assistant messages and function calls that follow each other form one
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
        if isinstance(item, ReasoningItem):
            if turn is not None and (turn.content or turn.tool_calls):
                turn = None
            msg = assistant()
            msg.reasoning_content = (msg.reasoning_content or "") + item.text(what)
        elif isinstance(item, FunctionCallItem):
            msg = assistant()
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            msg.tool_calls = [*(msg.tool_calls or []), call]
        elif isinstance(item, FunctionCallOutputItem):
            turn = None
            out.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=_text_parts(item.output, what)))
        elif item.role == "assistant":
            if turn is not None and (turn.content or turn.tool_calls):
                turn = None
            assistant().content = item.text(what)
        else:
            turn = None
            out.append(ChatMessage(role=item.role, content=item.text(what)))
    return out


# ---- stored responses -------------------------------------------------------------------------
@dataclass
class _Stored:
    input: list[InputItem]  # this request's items (not its ancestors')
    output: list[InputItem]
    previous: str | None
    chars: int


class ResponseStore:
    """Bounded, in-memory `previous_response_id` history; a response links to its parent, so
    a long conversation costs its length once. With `files` (serve --responses-dir) every stored
    response is written there too, and an id missing from memory is read back from there."""

    MAX_RESPONSES = 1024
    MAX_CHARS = 64 * 1024 * 1024

    def __init__(self, files: ResponseFiles | None = None) -> None:
        self._entries: OrderedDict[str, _Stored] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        self.files = files

    def put(self, rid: str, inputs: list[InputItem], outputs: list[dict[str, Any]], previous: str | None) -> None:
        self._remember(rid, inputs, parse_items(outputs, "output"), previous)
        if self.files is not None:
            self.files.write(rid, [i.model_dump(mode="json", exclude_none=True) for i in inputs], outputs, previous)

    def _remember(self, rid: str, inputs: list[InputItem], outputs: list[InputItem], previous: str | None) -> _Stored:
        chars = sum(len(i.model_dump_json()) for i in [*inputs, *outputs])
        entry = _Stored(inputs, outputs, previous, chars)
        with self._lock:
            self._entries[rid] = entry
            self._chars += chars
            while len(self._entries) > self.MAX_RESPONSES or self._chars > self.MAX_CHARS:
                _, old = self._entries.popitem(last=False)
                self._chars -= old.chars
        return entry

    def _get(self, rid: str) -> _Stored | None:
        with self._lock:
            entry = self._entries.get(rid)
        if entry is not None or self.files is None:
            return entry
        found = self.files.read(rid)  # another replica's response, or one from before a restart
        if found is None:
            return None
        try:
            return self._remember(rid, parse_items(found[0], "input"), parse_items(found[1], "output"), found[2])
        except ValueError:
            return None

    def history(self, rid: str) -> list[InputItem]:
        """Every item of the conversation that ended with response `rid`, oldest first."""
        chain: list[_Stored] = []
        cur: str | None = rid
        while cur is not None:
            entry = self._get(cur)
            if entry is None:
                which = "" if cur == rid else f" (its ancestor {cur} was dropped from the store)"
                where = "in memory and in --responses-dir" if self.files is not None else "in memory"
                raise APIError(400, f"Previous response with id '{rid}' not found{which}; this server keeps "
                               f"the last {self.MAX_RESPONSES} stored responses {where}",
                               param="previous_response_id", code="previous_response_not_found")
            chain.append(entry)
            cur = entry.previous
        return [item for entry in reversed(chain) for item in (*entry.input, *entry.output)]


# ---- request -> chat request ------------------------------------------------------------------
def _chat_request(req: ResponsesRequest, history: list[InputItem]) -> ChatCompletionRequest:
    messages = items_to_messages([*history, *req.input_items()])
    if req.instructions:
        messages.insert(0, ChatMessage(role="system", content=req.instructions))
    if not messages:
        raise bad_request("the request has no input", param="input")
    tools = [Tool(function=FunctionDef(name=t.name, description=t.description, parameters=t.parameters))
             for t in req.function_tools()] or None
    choice = req.tool_choice
    if isinstance(choice, dict):
        choice = {"type": "function", "function": {"name": choice["name"]}}
    fmt = req.text.format if req.text else TextFormat()
    response_format = None
    if fmt.type == "json_object":
        response_format = {"type": "json_object"}
    elif fmt.type == "json_schema":
        response_format = {"type": "json_schema", "json_schema": {"name": fmt.name or "output", "schema": fmt.schema_}}
    try:
        return ChatCompletionRequest(
            model=req.model, messages=messages, max_tokens=req.max_output_tokens, temperature=req.temperature,
            top_p=req.top_p, tools=tools, tool_choice=choice, reasoning_effort=req.effort(),
            reasoning_format="auto", response_format=response_format,
            logprobs=req.wants_logprobs(), top_logprobs=req.top_logprobs if req.wants_logprobs() else None,
        )
    except ValidationError as e:  # tool_choice naming an unknown function, a schema the sampler cannot enforce
        msg = str(e.errors()[0]["msg"]).removeprefix("Value error, ")
        param = "tool_choice" if msg.startswith("tool_choice") else "text.format"
        raise bad_request(msg.replace("response_format", "text.format"), param=param) from None


def _history(store: ResponseStore, req: ResponsesRequest) -> list[InputItem]:
    return store.history(req.previous_response_id) if req.previous_response_id else []


async def input_tokens(serving: Serving, store: ResponseStore, req: ResponsesRequest) -> dict[str, Any]:
    chat = _chat_request(req, _history(store, req))
    return {"object": "response.input_tokens", "input_tokens": len(await serving.chat_prompt_ids(chat))}


async def create(serving: Serving, store: ResponseStore, req: ResponsesRequest,
                 disconnected: Disconnected | None = None) -> dict[str, Any] | AsyncIterator[str]:
    chat = _chat_request(req, _history(store, req))
    handle, view = await serving.start_chat(chat)
    run = _Run(serving, store, req, chat, view)
    if req.stream:
        return run.sse(handle)
    async for _ in run.events(events(handle, disconnected)):
        pass
    if run.failed:
        raise APIError(500, f"generation failed: {run.failed}", type="server_error")
    return run.response()


# ---- engine events -> items and stream events -------------------------------------------------
class _Run:
    """One response: block events -> output items, stream events, the final response object."""

    def __init__(self, serving: Serving, store: ResponseStore, req: ResponsesRequest, chat: ChatCompletionRequest,
                 view: ChatView) -> None:
        self.serving, self.store, self.req, self.chat = serving, store, req, chat
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.folder = BlockFolder(view)
        self.items: list[dict[str, Any]] = []  # output items, in their final form once done
        self.status = "in_progress"
        self.failed: str | None = None
        self._seq = 0
        self._held_lp: list[dict[str, Any]] = []  # answer tokens' logprobs whose text has not come yet

    async def sse(self, handle: Any) -> AsyncIterator[str]:
        try:
            async for ev in self.events(handle):
                yield f"event: {ev['type']}\ndata: {json.dumps(ev, ensure_ascii=False)}\n\n"
        finally:
            handle.cancel()  # client gone mid-stream: the engine frees the slot at its next step

    async def events(self, engine_events: AsyncIterator[Any]) -> AsyncIterator[dict[str, Any]]:
        """The documented stream: created, in_progress, per item added/deltas/done, then
        completed (or incomplete at the token limit, failed on an engine error)."""
        yield self._event("response.created", response=self.response())
        yield self._event("response.in_progress", response=self.response())
        async for bev in self.folder.stream(engine_events):
            for ev in self._on_block(bev):
                yield ev
        final = self.folder.final
        if final is None or final.finish_reason in ("error", "cancelled"):
            self.status = "failed"
            self.failed = (final.error if final else None) or "cancelled"
            yield self._event("response.failed", response=self.response())
            return
        self.status = "incomplete" if final.finish_reason == "length" else "completed"
        if self.req.store:
            self.store.put(self.id, self.req.input_items(), self.items, self.req.previous_response_id)
        yield self._event(f"response.{self.status}", response=self.response())

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return ev

    def _on_block(self, bev: BlockEvent) -> list[dict[str, Any]]:
        b, pos = bev.block, bev.block.index
        if bev.kind == "open":
            item = self._item(b, "in_progress")
            self.items.append(item)
            out = [self._event("response.output_item.added", output_index=pos, item=item)]
            if b.kind != "call":
                out.append(self._event("response.content_part.added", item_id=item["id"], output_index=pos,
                                       content_index=0, part=self._part(b.kind, "")))
            return out
        item_id = self.items[pos]["id"]
        if bev.kind == "delta":
            if b.kind == "call":
                return [self._event("response.function_call_arguments.delta", item_id=item_id, output_index=pos,
                                    delta=bev.text)]
            if b.kind == "reasoning":
                return [self._event("response.reasoning_text.delta", item_id=item_id, output_index=pos,
                                    content_index=0, delta=bev.text)]
            self._held_lp += [self._logprob(lp) for lp in bev.logprobs]
            if not bev.text:
                return []
            lps, self._held_lp = self._held_lp, []
            return [self._event("response.output_text.delta", item_id=item_id, output_index=pos, content_index=0,
                                delta=bev.text, logprobs=lps)]
        # close: the last item is cut short when the token limit ended the reply
        final = self.folder.final
        status = "incomplete" if final is not None and final.finish_reason == "length" else "completed"
        self.items[pos] = item = self._item(b, status)
        if b.kind == "call":
            out = [self._event("response.function_call_arguments.done", item_id=item_id, output_index=pos,
                               arguments=b.text)]
        elif b.kind == "reasoning":
            out = [self._event("response.reasoning_text.done", item_id=item_id, output_index=pos, content_index=0,
                               text=b.text)]
        else:
            self._held_lp = []
            out = [self._event("response.output_text.done", item_id=item_id, output_index=pos, content_index=0,
                               text=b.text, logprobs=self._logprobs(b))]
        if b.kind != "call":
            out.append(self._event("response.content_part.done", item_id=item_id, output_index=pos, content_index=0,
                                   part=self._part(b.kind, b.text, self._logprobs(b))))
        return out + [self._event("response.output_item.done", output_index=pos, item=item)]

    def _item(self, b: Block, status: str) -> dict[str, Any]:
        """An output item; an open one is empty (its text arrives as deltas)."""
        done = status != "in_progress"
        suffix = self.id.removeprefix("resp_") + f"_{b.index}"
        if b.kind == "call":
            return {"id": f"fc_{suffix}", "type": "function_call", "status": status, "call_id": b.call_id,
                    "name": b.name, "arguments": b.text if done else ""}
        if b.kind == "reasoning":
            item = {"id": f"rs_{suffix}", "type": "reasoning", "status": status, "summary": [],
                    "content": [self._part("reasoning", b.text)] if done else []}
            if "reasoning.encrypted_content" in (self.req.include or ()):
                item["encrypted_content"] = carry_reasoning(b.text) if done else ""
            return item
        return {"id": f"msg_{suffix}", "type": "message", "role": "assistant", "status": status,
                "content": [self._part("text", b.text, self._logprobs(b))] if done else []}

    @staticmethod
    def _part(kind: str, text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        if kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}

    def _logprobs(self, b: Block) -> list[dict[str, Any]]:
        return [self._logprob(lp) for lp in b.logprobs]

    def _logprob(self, lp: Any) -> dict[str, Any]:
        """OpenAI's Responses entry: token, logprob, bytes, top_logprobs (no llama-server id)."""
        e = self.serving.logprob_entry(lp)
        keys = ("token", "logprob", "bytes")
        return {**{k: e[k] for k in keys}, "top_logprobs": [{k: t[k] for k in keys} for t in e["top_logprobs"]]}

    def response(self) -> dict[str, Any]:
        """The response object as it stands (the stream's snapshots, and the non-streamed answer)."""
        req, d = self.req, self.serving.config.defaults
        final = self.folder.final
        fmt = req.text.format if req.text else TextFormat()
        usage = None
        if final is not None and final.usage is not None and self.status != "in_progress":
            u = final.usage
            usage = {"input_tokens": u.prompt_tokens,
                     "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
                     "output_tokens": u.completion_tokens,
                     "output_tokens_details": {"reasoning_tokens": self.folder.view.reasoning_tokens},
                     "total_tokens": u.prompt_tokens + u.completion_tokens}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "completed_at": int(time.time()) if self.status == "completed" else None,
            "status": self.status,
            "error": {"code": "server_error", "message": self.failed} if self.failed else None,
            "incomplete_details": {"reason": "max_output_tokens"} if self.status == "incomplete" else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.serving.model_id,
            "output": self.items if self.status != "in_progress" else [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": self.chat.reasoning_effort or self.serving.config.reasoning_effort, "summary": None},
            "store": req.store,
            "temperature": d.temperature if req.temperature is None else req.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)},
            "tool_choice": req.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.function_tools()],
            "top_p": d.top_p if req.top_p is None else req.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": req.user,
            "metadata": req.metadata or {},
        }
