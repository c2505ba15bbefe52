"""OpenAI Responses API (`POST /v1/responses`, `/v1/responses/input_tokens`) over the chat path.

A request becomes a `ChatCompletionRequest` (input items -> chat messages, server/responses_items.py;
tools -> functions, server/responses_tools.py) and goes through `Serving.start_chat`, so templates,
sampling, constrained JSON and harmony parsing are the chat path's. The reply's harmony messages
become output items: analysis -> `reasoning`, final (and commentary preambles) -> `message`, calls
to `functions.NAME` -> `function_call` (with `namespace` for a namespace tool's function) or
`custom_tool_call` (a freeform tool).

Stored responses (`store`, the API's default) stay in memory for `previous_response_id`:
at most `ResponseStore.MAX_RESPONSES` responses and `MAX_CHARS` characters of items, the oldest
dropped first; nothing survives a restart unless --responses-dir also writes them to files
(server/response_files.py), which replicas behind a gateway share.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from hybridmoe.server.chat_view import ChatView
from hybridmoe.server.output_blocks import Block, BlockEvent, BlockFolder
from hybridmoe.server.response_files import ResponseFiles
from hybridmoe.server.protocol import APIError, ChatCompletionRequest, ChatMessage, Lenient, bad_request
from hybridmoe.server.responses_items import (  # noqa: F401  (parse_items, items_to_messages: tests use them here)
    InputItem,
    MessageItem,
    carry_reasoning,
    declared_tools,
    items_to_messages,
    parse_items,
)
from hybridmoe.server.responses_tools import Route, ToolMap, freeform_input, wire_name
from hybridmoe.server.serving import Disconnected, Serving, events


# ---- request ----------------------------------------------------------------------------------
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
    def _tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        ToolMap.parse(v)
        return v

    @field_validator("tool_choice")
    @classmethod
    def _choice(cls, v: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if isinstance(v, str) and v not in ("none", "auto", "required"):
            raise ValueError("must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}, "
                             f"got {v!r}")
        if isinstance(v, dict) and (v.get("type") not in ("function", "custom") or not isinstance(v.get("name"), str)):
            raise ValueError("only {\"type\": \"function\" or \"custom\", \"name\": ...} objects are supported, "
                             f"got {v!r}")
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

    def tool_map(self, history: list[InputItem] | None = None) -> ToolMap:
        """The functions the model is offered and where its calls go back (validated already)."""
        return declared_tools(self.tools, [*(history or ()), *self.input_items()])

    def effort(self) -> str | None:
        e = self.reasoning.effort if self.reasoning else None
        return {"none": "low", "minimal": "low", "xhigh": "high"}.get(e, e) if e else None


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
def _chat_request(req: ResponsesRequest, history: list[InputItem],
                  tools: ToolMap | None = None) -> ChatCompletionRequest:
    tools = req.tool_map(history) if tools is None else tools
    messages = items_to_messages([*history, *req.input_items()])
    if req.instructions:
        messages.insert(0, ChatMessage(role="system", content=req.instructions))
    if not messages:
        raise bad_request("the request has no input", param="input")
    choice = req.tool_choice
    if isinstance(choice, dict):  # a namespaced function is named by its namespace too
        name = wire_name(choice["name"], choice.get("namespace") if isinstance(choice.get("namespace"), str) else None)
        choice = {"type": "function", "function": {"name": name}}
    fmt = req.text.format if req.text else TextFormat()
    response_format = None
    if fmt.type == "json_object":
        response_format = {"type": "json_object"}
    elif fmt.type == "json_schema":
        response_format = {"type": "json_schema", "json_schema": {"name": fmt.name or "output", "schema": fmt.schema_}}
    try:
        return ChatCompletionRequest(
            model=req.model, messages=messages, max_tokens=req.max_output_tokens, temperature=req.temperature,
            top_p=req.top_p, tools=tools.offered or None, tool_choice=choice, reasoning_effort=req.effort(),
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
    history = _history(store, req)
    chat = _chat_request(req, history, req.tool_map(history))
    return {"object": "response.input_tokens", "input_tokens": len(await serving.chat_prompt_ids(chat))}


async def create(serving: Serving, store: ResponseStore, req: ResponsesRequest,
                 disconnected: Disconnected | None = None) -> dict[str, Any] | AsyncIterator[str]:
    history = _history(store, req)
    tools = req.tool_map(history)
    tools.note_dropped()
    chat = _chat_request(req, history, tools)
    handle, view = await serving.start_chat(chat)
    run = _Run(serving, store, req, chat, view, tools)
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
                 view: ChatView, tools: ToolMap) -> None:
        self.serving, self.store, self.req, self.chat, self.tools = serving, store, req, chat, tools
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

    def _shape(self, b: Block) -> str:
        """What a block becomes: reasoning, text, a function call or a freeform (custom) call. A
        call with no function name (`to=functions.` alone) cannot be routed: its text is text."""
        if b.kind != "call":
            return b.kind
        return self.tools.route(b.name).kind if b.name else "text"

    def _on_block(self, bev: BlockEvent) -> list[dict[str, Any]]:
        b, pos, shape = bev.block, bev.block.index, self._shape(bev.block)
        if bev.kind == "open":
            item = self._item(b, "in_progress")
            self.items.append(item)
            out = [self._event("response.output_item.added", output_index=pos, item=item)]
            if shape in ("text", "reasoning"):
                out.append(self._event("response.content_part.added", item_id=item["id"], output_index=pos,
                                       content_index=0, part=self._part(shape, "")))
            return out
        item_id = self.items[pos]["id"]
        if bev.kind == "delta":
            return self._delta(bev, shape, item_id)
        # close: the last item is cut short when the token limit ended the reply
        final = self.folder.final
        status = "incomplete" if final is not None and final.finish_reason == "length" else "completed"
        self.items[pos] = item = self._item(b, status)
        at = {"item_id": item_id, "output_index": pos}
        if shape == "function":
            out = [self._event("response.function_call_arguments.done", **at, arguments=b.text)]
        elif shape == "custom":  # its input is known once the JSON that carries it is complete
            out = [self._event("response.custom_tool_call_input.delta", **at, delta=item["input"]),
                   self._event("response.custom_tool_call_input.done", **at, input=item["input"])]
        elif shape == "reasoning":
            out = [self._event("response.reasoning_text.done", **at, content_index=0, text=b.text)]
        else:
            self._held_lp = []
            out = [self._event("response.output_text.done", **at, content_index=0, text=b.text,
                               logprobs=self._logprobs(b))]
        if shape in ("text", "reasoning"):
            out.append(self._event("response.content_part.done", **at, content_index=0,
                                   part=self._part(shape, b.text, self._logprobs(b))))
        return out + [self._event("response.output_item.done", output_index=pos, item=item)]

    def _delta(self, bev: BlockEvent, shape: str, item_id: str) -> list[dict[str, Any]]:
        at = {"item_id": item_id, "output_index": bev.block.index}
        if shape == "function":
            return [self._event("response.function_call_arguments.delta", **at, delta=bev.text)]
        if shape == "custom":
            return []
        if shape == "reasoning":
            return [self._event("response.reasoning_text.delta", **at, content_index=0, delta=bev.text)]
        self._held_lp += [self._logprob(lp) for lp in bev.logprobs]
        if not bev.text:
            return []
        lps, self._held_lp = self._held_lp, []
        return [self._event("response.output_text.delta", **at, content_index=0, delta=bev.text, logprobs=lps)]

    def _item(self, b: Block, status: str) -> dict[str, Any]:
        """An output item; an open one is empty (its text arrives as deltas)."""
        done = status != "in_progress"
        suffix = self.id.removeprefix("resp_") + f"_{b.index}"
        shape = self._shape(b)
        if shape in ("function", "custom"):
            return _call_item(self.tools.route(b.name), b, suffix, status, done)
        if shape == "reasoning":
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
            "tools": req.tools or [],
            "top_p": d.top_p if req.top_p is None else req.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": req.user,
            "metadata": req.metadata or {},
        }


def _call_item(route: Route, b: Block, suffix: str, status: str, done: bool) -> dict[str, Any]:
    """A call as the client declared its tool: `function_call` (with `namespace` for a namespace
    tool's function, as Codex routes it) or `custom_tool_call` carrying the freeform input."""
    ns = {"namespace": route.namespace} if route.namespace else {}
    if route.kind == "custom":
        return {"id": f"ctc_{suffix}", "type": "custom_tool_call", "status": status, "call_id": b.call_id,
                "name": route.name, **ns, "input": freeform_input(b.text) if done else ""}
    return {"id": f"fc_{suffix}", "type": "function_call", "status": status, "call_id": b.call_id,
            "name": route.name, **ns, "arguments": b.text if done else ""}
