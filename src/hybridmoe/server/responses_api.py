"""OpenAI Responses API (`POST /v1/responses`, `/v1/responses/input_tokens`) over the chat path.

A request becomes a `ChatJob` (input items -> chat messages, server/responses_items.py; tools ->
functions, server/responses_tools.py), so templates, sampling, constrained JSON and the chat
format's parsing are the chat path's. The reply's blocks become output items: reasoning ->
`reasoning`, text -> `message`, calls -> `function_call` (with `namespace` for a namespace tool's
function) or `custom_tool_call` (a freeform tool); a call with no function name stays text.
Stored responses (`store`, the API's default) serve `previous_response_id`: server/responses_store.py.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from pydantic import Field, ValidationError, field_validator, model_validator

from hybridmoe.engine.engine import PromptProgress
from hybridmoe.server.generation import SSEvent
from hybridmoe.server.jobs import ChatJob
from hybridmoe.server.logprob_json import TokenBytes, responses_entry
from hybridmoe.server.protocol import (
    ChatMessage,
    Lenient,
    SamplingFields,
    bad_request,
    check_forced_tool,
    forced_tool,
)
from hybridmoe.server.reply import Block, BlockClose, BlockDelta, BlockOpen, Finished, Reply, ReplyEvent
from hybridmoe.server.response_files import ResponseFiles
from hybridmoe.server.responses_items import (
    InputItem,
    MessageItem,
    carry_reasoning,
    declared_tools,
    items_to_messages,
    parse_items,
)
from hybridmoe.server.responses_store import ResponseStore
from hybridmoe.server.responses_tools import Route, ToolMap, freeform_input, wire_name
from hybridmoe.server.wiring import Wiring
from hybridmoe.settings import SamplingDefaults


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


# ---- request -> job ---------------------------------------------------------------------------
def responses_job(req: ResponsesRequest, history: list[InputItem], tools: ToolMap | None = None) -> ChatJob:
    """The conversation (stored history, then this request's items) as a chat job; 400 naming the field."""
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
    offered = tools.offered or None
    try:
        sampling = SamplingFields(model=req.model, temperature=req.temperature, top_p=req.top_p,
                                  response_format=response_format)
        forced = forced_tool(choice)
        check_forced_tool(forced, offered, sampling.constrained())
    except (ValidationError, ValueError) as e:  # a tool_choice naming an unknown function, a schema refused
        msg = str(e.errors()[0]["msg"] if isinstance(e, ValidationError) else e).removeprefix("Value error, ")
        param = "tool_choice" if msg.startswith("tool_choice") else "text.format"
        raise bad_request(msg.replace("response_format", "text.format"), param=param) from None
    return ChatJob(messages=messages, sampling=sampling, tools=None if choice == "none" else offered,
                   forced_tool=forced, token_limit=req.max_output_tokens,
                   logprobs=(req.top_logprobs or 0) if req.wants_logprobs() else None,
                   reasoning_effort=req.effort(), reasoning_format="auto")


# ---- reply events -> output items and stream events -------------------------------------------
class ResponsesRender:
    """One response: reply events -> output items, stream events, the final response object.
    `effort`: the reasoning effort it ran with; `defaults`: the server's sampling defaults."""

    def __init__(self, req: ResponsesRequest, store: ResponseStore, tools: ToolMap, model: str, effort: str | None,
                 defaults: SamplingDefaults, token_bytes: TokenBytes) -> None:
        self.req, self.store, self.tools, self.model, self.effort = req, store, tools, model, effort
        self.defaults, self.token_bytes = defaults, token_bytes
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.items: list[dict[str, Any]] = []  # output items, in their final form once done
        self.status = "in_progress"
        self.failed: str | None = None
        self.reply: Reply | None = None
        self._seq = 0
        self._held_lp: list[dict[str, Any]] = []  # answer tokens' logprobs whose text has not come yet

    def json(self, replies: list[Reply]) -> dict[str, Any]:
        r = self.reply = replies[0]
        last = len(r.blocks) - 1
        self.items = [self._item(b, "incomplete" if r.finish_reason == "length" and b.index == last else "completed")
                      for b in r.blocks]
        self._complete(r)
        return self.response()

    def _complete(self, r: Reply) -> None:
        self.status = "incomplete" if r.finish_reason == "length" else "completed"
        if self.req.store:
            self.store.put(self.id, self.req.input_items(), self.items, self.req.previous_response_id)

    def opening(self) -> list[SSEvent]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def progress(self, i: int, p: PromptProgress) -> list[SSEvent]:
        return []

    def events(self, i: int, events: list[ReplyEvent]) -> list[SSEvent]:
        """The documented stream: per item added/deltas/done, then completed (or incomplete at
        the token limit, failed on an engine error or a cancel)."""
        out: list[SSEvent] = []
        for ev in events:
            if isinstance(ev, Finished):
                self.reply = ev.reply
            elif isinstance(ev, (BlockOpen, BlockDelta, BlockClose)):
                out += self._on_block(ev)
        if self.reply is None:
            return out
        r = self.reply
        if r.finish_reason in ("error", "cancelled"):
            self.status = "failed"
            self.failed = r.error or "cancelled"
            return out + [self._event("response.failed", response=self.response())]
        self._complete(r)
        return out + [self._event(f"response.{self.status}", response=self.response())]

    def closing(self) -> list[SSEvent]:
        return []

    def _event(self, kind: str, **fields: Any) -> SSEvent:
        ev = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return SSEvent(ev, event=kind)

    def _shape(self, b: Block) -> str:
        """What a block becomes: reasoning, text, a function call or a freeform (custom) call."""
        return self.tools.route(b.name).kind if b.kind == "call" else b.kind

    def _on_block(self, bev: BlockOpen | BlockDelta | BlockClose) -> list[SSEvent]:
        b, pos, shape = bev.block, bev.block.index, self._shape(bev.block)
        if isinstance(bev, BlockOpen):
            item = self._item(b, "in_progress")
            self.items.append(item)
            out = [self._event("response.output_item.added", output_index=pos, item=item)]
            if shape in ("text", "reasoning"):
                out.append(self._event("response.content_part.added", item_id=item["id"], output_index=pos,
                                       content_index=0, part=self._part(shape, "")))
            return out
        item_id = self.items[pos]["id"]
        if isinstance(bev, BlockDelta):
            return self._delta(bev, shape, item_id)
        # close: the last item is cut short when the token limit ended the reply
        status = "incomplete" if self.reply is not None and self.reply.finish_reason == "length" else "completed"
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

    def _delta(self, bev: BlockDelta, shape: str, item_id: str) -> list[SSEvent]:
        at = {"item_id": item_id, "output_index": bev.block.index}
        if shape == "function":
            return [self._event("response.function_call_arguments.delta", **at, delta=bev.text)] if bev.text else []
        if shape == "custom":
            return []
        if shape == "reasoning":
            return [self._event("response.reasoning_text.delta", **at, content_index=0, delta=bev.text)]
        self._held_lp += [responses_entry(lp, self.token_bytes) for lp in bev.logprobs]
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
            return call_item(self.tools.route(b.name), b, suffix, status, done)
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
        return [responses_entry(lp, self.token_bytes) for lp in b.logprobs]

    def response(self) -> dict[str, Any]:
        """The response object as it stands (the stream's snapshots, and the non-streamed answer)."""
        req, d, r = self.req, self.defaults, self.reply
        fmt = req.text.format if req.text else TextFormat()
        usage = None
        if r is not None and r.usage is not None and self.status != "in_progress":
            u = r.usage
            usage = {"input_tokens": u.prompt_tokens,
                     "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
                     "output_tokens": u.completion_tokens,
                     "output_tokens_details": {"reasoning_tokens": r.reasoning_tokens},
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
            "model": self.model,
            "output": self.items if self.status != "in_progress" else [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": self.effort, "summary": None},
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


def call_item(route: Route, b: Block, suffix: str, status: str, done: bool) -> dict[str, Any]:
    """A call as the client declared its tool: `function_call` (with `namespace` for a namespace
    tool's function, as Codex routes it) or `custom_tool_call` carrying the freeform input."""
    ns = {"namespace": route.namespace} if route.namespace else {}
    if route.kind == "custom":
        return {"id": f"ctc_{suffix}", "type": "custom_tool_call", "status": status, "call_id": b.call_id,
                "name": route.name, **ns, "input": freeform_input(b.text) if done else ""}
    return {"id": f"fc_{suffix}", "type": "function_call", "status": status, "call_id": b.call_id,
            "name": route.name, **ns, "arguments": b.text if done else ""}


# ---- routes -------------------------------------------------------------------------------------
def register(app: FastAPI, w: Wiring) -> None:
    store = ResponseStore(ResponseFiles(w.state.responses_dir) if w.state.responses_dir else None)

    def history(req: ResponsesRequest) -> list[InputItem]:
        return store.history(req.previous_response_id) if req.previous_response_id else []

    @app.post("/v1/responses")
    @app.post("/responses")
    async def responses(req: ResponsesRequest, request: Request) -> Any:
        s = w.service()
        past = history(req)
        tools = req.tool_map(past)
        tools.note_dropped()
        job = responses_job(req, past, tools)
        gen = await s.start_chat(job)
        render = ResponsesRender(req, store, tools, s.model_id, job.reasoning_effort or s.config.reasoning_effort,
                                 s.config.defaults, s.tokenizer.token_bytes)
        if req.stream:
            return s.consumer.stream(gen, render, w.ping_interval(req))
        return render.json(await s.consumer.replies(gen, request.is_disconnected))

    @app.post("/v1/responses/input_tokens")
    @app.post("/responses/input_tokens")
    async def input_tokens(req: ResponsesRequest) -> Any:
        past = history(req)
        _, ids = await w.service().chat_prompt(responses_job(req, past, req.tool_map(past)))
        return {"object": "response.input_tokens", "input_tokens": len(ids)}
