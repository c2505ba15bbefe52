"""OpenAI chat completions (`POST /v1/chat/completions`), its token count (`/input_tokens`) and
llama-server's control route: the request model, its mapping to a `ChatJob`, and the renderer of
reply events as a `chat.completion` object or `chat.completion.chunk` SSE events.

Reply blocks map onto one message: reasoning -> `reasoning_content`, text -> `content`, calls ->
`tool_calls` (name first, then argument fragments); finish reason `tool_calls` when a reply that
stopped by itself made calls.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Literal

from fastapi import FastAPI, Request
from pydantic import Field, model_validator

from hybridmoe.engine.engine import GenerationRequest, PromptProgress
from hybridmoe.server.generation import SSEvent
from hybridmoe.server.jobs import ChatJob
from hybridmoe.server.logprob_json import TokenBytes, chat_entry
from hybridmoe.server.native_result import llama_timings
from hybridmoe.server.protocol import (
    NO_LIMIT,
    APIError,
    ChatMessage,
    Lenient,
    SamplingFields,
    Tool,
    check_forced_tool,
    forced_tool,
)
from hybridmoe.server.reply import Block, BlockDelta, BlockOpen, Finished, Reply, ReplyEvent, TokenOut
from hybridmoe.server.wiring import Wiring


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    n_probs: int | None = Field(default=None, ge=0, le=100)  # llama-server: logprobs with this many alternatives
    reasoning_effort: Literal["none", "low", "medium", "high"] | None = None  # "none": reasoning off
    # llama-server: thinking tokens allowed (-1: the server's --reasoning-budget), then the message
    # and the end of the thinking are written for the model
    reasoning_budget_tokens: int = Field(default=-1, ge=-1)
    reasoning_budget_message: str | None = Field(default=None, max_length=4096)
    # llama-server: the thinking may be ended early by POST /v1/chat/completions/control (reasoning_end)
    reasoning_control: bool = False
    reasoning_format: Literal["none", "auto", "deepseek"] | None = None  # llama-server extra
    add_generation_prompt: bool = True  # llama-server extras: see server/chat_checks.py
    continue_final_message: bool | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        check_forced_tool(forced_tool(self.tool_choice), self.tools, self.constrained())
        return self

    def logprobs_k(self) -> int | None:
        """Alternatives per token in the logprobs (None: no logprobs): OpenAI's top_logprobs, or
        llama-server's n_probs, which turns logprobs on by itself."""
        if self.logprobs:
            return self.top_logprobs or 0
        return self.n_probs or None

    def token_limit(self) -> int | None:
        """n_predict (llama-server) > max_completion_tokens > max_tokens; -1: up to the context;
        None: the server's -n."""
        for v in (self.n_predict, self.max_completion_tokens, self.max_tokens):
            if v is not None:
                return NO_LIMIT if v < 0 else v
        return None


class ControlRequest(Lenient):
    """llama-server's POST /v1/chat/completions/control: act on a running chat completion."""

    id: str = ""  # the completion's id, as its stream gave it
    action: str = ""  # "reasoning_end": close the thinking now, so the model goes on to its answer


def chat_job(req: ChatCompletionRequest, n: int | None = None) -> ChatJob:
    return ChatJob(
        messages=req.messages, sampling=req, tools=None if req.tool_choice == "none" else req.tools,
        forced_tool=forced_tool(req.tool_choice), token_limit=req.token_limit(), logprobs=req.logprobs_k(),
        n=req.n if n is None else n, reasoning_effort=req.reasoning_effort, reasoning_format=req.reasoning_format,
        chat_template_kwargs=req.chat_template_kwargs, add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message, reasoning_budget_tokens=req.reasoning_budget_tokens,
        reasoning_budget_message=req.reasoning_budget_message, reasoning_control=req.reasoning_control)


# ---- reply events -> chat.completion(.chunk) ----------------------------------------------------
def finish_reason(reply: Reply) -> str:
    return "tool_calls" if reply.calls() and reply.finish_reason == "stop" else reply.finish_reason


def message(reply: Reply) -> dict[str, Any]:
    """The assistant message of a finished reply."""
    calls = reply.calls()
    text = reply.joined("text")
    msg: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    reasoning = reply.joined("reasoning")
    if reasoning:
        msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = [{"id": b.call_id, "type": "function", "function": {"name": b.name, "arguments": b.text}}
                             for b in calls]
    return msg


def usage(replies: list[Reply]) -> dict[str, Any]:
    """Usage of one request, or of n choices of one prompt (completion tokens summed)."""
    u = replies[0].usage
    assert u is not None
    completion = sum(r.usage.completion_tokens for r in replies if r.usage is not None)
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": completion,
            "total_tokens": u.prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


class ChatRender:
    """One chat completion's JSON object or stream. `failure`: the error a finished reply stands for
    (server/generation.py); `verbose`: llama-server's `__verbose` of a reply, or None."""

    def __init__(self, head: dict[str, Any], requests: list[GenerationRequest], token_bytes: TokenBytes,
                 failure: Callable[[Reply], APIError | None],
                 verbose: Callable[[GenerationRequest, Reply, bool], dict[str, Any] | None],
                 include_usage: bool = False) -> None:
        self.head, self.requests, self.token_bytes = head, requests, token_bytes
        self.failure, self.verbose, self.include_usage = failure, verbose, include_usage
        self._finals: list[Reply] = []
        self._call_index: dict[tuple[int, int], int] = {}  # (choice, block index) -> tool_calls index

    def json(self, replies: list[Reply]) -> dict[str, Any]:
        choices = [{"index": i, "message": message(r),
                    "logprobs": {"content": [chat_entry(lp, self.token_bytes) for lp in r.logprobs]}
                    if self.requests[i].logprobs is not None else None,
                    "finish_reason": finish_reason(r)} for i, r in enumerate(replies)]
        out = {**self.head, "object": "chat.completion", "choices": choices, "usage": usage(replies),
               "timings": llama_timings(replies[0].timings)}
        verbose = self.verbose(self.requests[0], replies[0], False)
        if verbose is not None:
            out["__verbose"] = verbose
        return out

    def _chunk(self, i: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        return {**self.head, "object": "chat.completion.chunk",
                "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    def opening(self) -> list[SSEvent]:
        return [SSEvent(self._chunk(i, {"role": "assistant", "content": None})) for i in range(len(self.requests))]

    def progress(self, i: int, p: PromptProgress) -> list[SSEvent]:
        return [SSEvent({**self._chunk(i, {"role": "assistant", "content": None}), "prompt_progress": p.to_json()})]

    def events(self, i: int, events: list[ReplyEvent]) -> list[SSEvent]:
        lp, live, deltas = None, {}, []
        for ev in events:
            if isinstance(ev, TokenOut):
                if ev.logprob is not None:
                    lp = {"content": [chat_entry(ev.logprob, self.token_bytes)]}
                if ev.timings and self.requests[i].timings_per_token:
                    live = {"timings": llama_timings(ev.timings)}
            elif isinstance(ev, (BlockOpen, BlockDelta)):
                deltas += self._delta(i, ev)
        out = [SSEvent({**self._chunk(i, d, logprobs=lp if j == 0 else None), **live}) for j, d in enumerate(deltas)]
        if lp is not None and not deltas:
            out.append(SSEvent(self._chunk(i, {}, logprobs=lp)))
        finished = next((ev.reply for ev in events if isinstance(ev, Finished)), None)
        return out + (self._final(i, finished) if finished is not None else [])

    def _delta(self, i: int, ev: BlockOpen | BlockDelta) -> list[dict[str, Any]]:
        b: Block = ev.block
        if b.kind == "call":
            if isinstance(ev, BlockOpen):
                k = self._call_index[(i, b.index)] = sum(1 for c, _ in self._call_index if c == i)
                return [{"tool_calls": [{"index": k, "id": b.call_id, "type": "function",
                                         "function": {"name": b.name, "arguments": ""}}]}]
            k = self._call_index[(i, b.index)]
            return [{"tool_calls": [{"index": k, "function": {"arguments": ev.text}}]}] if ev.text else []
        if isinstance(ev, BlockOpen) or not ev.text:
            return []
        return [{"reasoning_content" if b.kind == "reasoning" else "content": ev.text}]

    def _final(self, i: int, reply: Reply) -> list[SSEvent]:
        failure = self.failure(reply)
        if failure is not None:
            return [SSEvent(failure.body())]
        self._finals.append(reply)
        final = self._chunk(i, {}, finish_reason(reply))
        if not self.include_usage:
            final["timings"] = llama_timings(reply.timings)
        verbose = self.verbose(self.requests[0], reply, True) if i == 0 else None
        if verbose is not None:
            final["__verbose"] = verbose
        return [SSEvent(final)]

    def closing(self) -> list[SSEvent]:
        out = []
        if self.include_usage and self._finals:
            # llama-server puts the timings on the last chunk: the usage chunk (choices: []).
            out.append(SSEvent({**self.head, "object": "chat.completion.chunk", "choices": [],
                                "usage": usage(self._finals), "timings": llama_timings(self._finals[-1].timings)}))
        return out + [SSEvent("[DONE]")]


def include_usage(req: SamplingFields) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def register(app: FastAPI, w: Wiring) -> None:
    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request) -> Any:
        s = w.service()
        gen = await s.start_chat(chat_job(req))
        head = s.head("chatcmpl")
        s.live_chats.add(head["id"], gen.handles, armed=req.reasoning_control)
        render = ChatRender(head, gen.requests, s.tokenizer.token_bytes, s.consumer.failure,
                            partial(s.verbose, asked=req.verbose), include_usage(req))
        if req.stream:
            return s.consumer.stream(gen, render, w.ping_interval(req), req.return_progress)
        return render.json(await s.consumer.replies(gen, request.is_disconnected))

    @app.post("/v1/chat/completions/input_tokens")
    @app.post("/chat/completions/input_tokens")
    async def input_tokens(req: ChatCompletionRequest) -> Any:
        """llama-server's count of the prompt's tokens."""
        _, ids = await w.service().chat_prompt(chat_job(req))
        return {"object": "response.input_tokens", "input_tokens": len(ids)}

    @app.post("/v1/chat/completions/control")
    async def chat_control(req: ControlRequest) -> Any:
        return w.service().live_chats.control(req.id, req.action)
