"""Chat/completions logic: template -> tokenize -> engine -> OpenAI responses (JSON or SSE chunks).

Everything that can be refused is refused before the request reaches the engine, so a streamed
response never starts for a request that will fail.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridmoe import __version__
from hybridmoe.engine.constraints import (
    ConstraintError,
    ConstraintSpec,
    ToolCallSpecs,
    compile_constraint,
    token_table,
    tool_names_spec,
)
from hybridmoe.engine.dry import Breakers, tokenizer_breakers
from hybridmoe.engine.engine import Engine, EngineEvent, GenerationRequest, QueueFullError, RequestHandle
from hybridmoe.engine.reasoning_budget import ReasoningBudget
from hybridmoe.engine.sampling import SamplingParams
from hybridmoe.server.chat_checks import check_messages
from hybridmoe.server.chat_control import LiveChats
from hybridmoe.server.chat_render import ChatRenderer, Rendered
from hybridmoe.server.chat_view import ChatView
from hybridmoe.server.constraint_fields import output_constraint, tool_arguments_spec
from hybridmoe.server.event_streams import Progress, merged_events
from hybridmoe.server.limits import check_template_kwargs, check_tools
from hybridmoe.server.logit_bias import resolve_logit_bias
from hybridmoe.server.metrics import ServerCounters, prometheus_text
from hybridmoe.server.native_result import Collected, llama_timings, native_final
from hybridmoe.server.protocol import (
    APIError,
    ApplyTemplateRequest,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
    Tool,
    bad_request,
)
from hybridmoe.server.shutdown import InFlight
from hybridmoe.settings import SAMPLER_ORDER, SamplerSettings, SamplingDefaults, parse_samplers  # server-wide
from hybridmoe.tokenizer.tokenizer import TokenLimitExceeded


# The start of a harmony tool call's header; tool_choice "required" writes it for the model.
_CALL_HEADER = "<|channel|>commentary to=functions"


@dataclass
class ServingConfig:
    model_path: str
    alias: str | None = None  # one name, or llama-server's comma-separated list (-a a,b,c)
    tags: list[str] = field(default_factory=list)  # --tags: informational, listed by /v1/models
    reasoning_format: str = "auto"  # none | auto | deepseek (same as auto for harmony)
    reasoning: str = "auto"  # --reasoning on | off | auto: the template's enable_thinking
    chat_template: str | None = None  # overrides the GGUF's tokenizer.chat_template
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    seed: int | None = None  # --seed: requests without a seed use it (None/-1: random)
    n_predict: int = -1  # -n: token limit of requests that give none (-1: the context)
    verbose: bool = False  # --verbose: responses carry llama-server's `__verbose` (native result)
    slot_save_path: str | None = None  # --slot-save-path: directory of slot state files
    reasoning_budget: int = -1  # --reasoning-budget: thinking tokens per reply (-1: no limit)
    reasoning_effort: str | None = None  # --reasoning-effort: for chat requests that give none (None: the template's)
    ignore_eos: bool = False  # --ignore-eos: for requests that give no ignore_eos (unconstrained ones)
    cache_prompt: bool = True  # --no-cache-prompt: requests that give no cache_prompt compute the whole prompt
    reasoning_budget_message: str = ""  # --reasoning-budget-message: written before the forced end

    def aliases(self) -> list[str]:
        """llama-server keeps aliases in a sorted set; the first is the model id."""
        return sorted({a.strip() for a in (self.alias or "").split(",") if a.strip()})


Disconnected = Callable[[], Awaitable[bool]]


async def _watch(handle: RequestHandle, disconnected: Disconnected) -> None:
    while True:
        if await disconnected():
            handle.cancel()
            return
        await asyncio.sleep(0.25)


async def events(handle: RequestHandle, disconnected: Disconnected | None) -> AsyncIterator[EngineEvent]:
    """Events of a non-streamed request; a client that goes away cancels it (slot freed)."""
    watch = asyncio.create_task(_watch(handle, disconnected)) if disconnected is not None else None
    try:
        async for ev in handle:
            yield ev
    finally:
        if watch is not None:
            watch.cancel()
        handle.cancel()  # no-op when finished; frees the slot if this handler itself was cancelled


def _include_usage(req: SamplingFields) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def _sse(obj: dict[str, Any] | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


# Request fields that set settings.SamplerSettings (the protocol has one for each)
_CHAIN_FIELDS = tuple(f.name for f in dataclasses.fields(SamplerSettings))


def exceed_context(n_prompt: int, n_ctx: int, param: str, at_least: bool = False) -> APIError:
    """llama-server's error for a prompt longer than a slot's context: clients read n_prompt_tokens
    and n_ctx from it to trim the history (`at_least`: the tokenizer stopped counting early)."""
    count = f"at least {n_prompt}" if at_least else str(n_prompt)
    return APIError(400, f"request ({count} tokens) exceeds the available context size ({n_ctx} tokens), "
                         "try increasing it", type="exceed_context_size_error", param=param,
                    code="context_length_exceeded", extra={"n_prompt_tokens": n_prompt, "n_ctx": n_ctx})


def sampler_order(samplers: list[str] | str) -> tuple[str, ...]:
    """`samplers` as a list of names or a string of letters ("kpmt") -> names; 400 on unknown ones."""
    try:
        return parse_samplers(samplers)
    except ValueError as e:
        raise bad_request(str(e), param="samplers") from None


class Serving:
    """Turns validated protocol requests into engine requests and engine events into responses."""

    def __init__(self, engine: Engine, config: ServingConfig) -> None:
        self.engine = engine
        self.config = config
        self.tokenizer = engine.tokenizer
        self.template = config.chat_template or engine.model_info.chat_template
        if not self.template:
            raise ValueError(f"{config.model_path} has no tokenizer.chat_template; pass --chat-template-file")
        outside = [t for t, _ in config.defaults.logit_bias if t >= self.tokenizer.vocab_size]
        if outside:
            raise ValueError(f"-l/--logit-bias: token id {outside[0]} is outside the vocabulary "
                             f"(0..{self.tokenizer.vocab_size - 1})")
        path = Path(config.model_path)
        # Any model name is served (llama-server serves its one model whatever the client sends).
        self.model_id = (config.aliases() or [path.name])[0]
        self.renderer = ChatRenderer(self.template, self.tokenizer, config.chat_template_kwargs, config.reasoning)
        self.counters = ServerCounters()
        self.created = int(time.time())
        self._tool_specs: dict[str, ConstraintSpec] = {}  # compiled tool-argument constraints by schema
        self._tool_specs_lock = threading.Lock()  # compiled in worker threads
        self.inflight = InFlight()
        self.live_chats = LiveChats()  # for POST /v1/chat/completions/control

    # ---- request preparation ------------------------------------------------------------------
    def _render(self, messages: list[ChatMessage], tools: list[Tool] | None, effort: str | None,
                kwargs: dict[str, Any] | None, add_generation_prompt: bool = True,
                continue_final_message: bool | None = None) -> Rendered:
        check_template_kwargs(kwargs)
        check_tools(tools)
        plan = check_messages(messages, add_generation_prompt, continue_final_message)
        return self.renderer.render(messages, tools, effort, kwargs, plan)

    def _chat_prompt(self, req: ChatCompletionRequest, tools: list[Tool] | None) -> tuple[Rendered, list[int]]:
        r = self._render(req.messages, tools, req.reasoning_effort or self.config.reasoning_effort,
                         req.chat_template_kwargs, req.add_generation_prompt, req.continue_final_message)
        return r, self._encode_prompt(r.prompt, "messages")

    def _encode_prompt(self, text: str, param: str) -> list[int]:
        """Prompt ids, refused as soon as they certainly exceed a slot's context (the tokenizer
        stops early: a huge prompt costs about what a full context costs)."""
        ctx = self.engine.ctx_size_per_slot
        try:
            return self.tokenizer.encode(text, allow_special=True, max_tokens=ctx - 1)
        except TokenLimitExceeded as e:
            raise exceed_context(e.at_least, ctx, param, at_least=True) from None

    def _harmony_prompt(self, prompt_ids: list[int]) -> bool:
        """The rendered prompt ends with harmony's `<|start|>assistant` generation header."""
        start, assistant = self.tokenizer.token_id("<|start|>"), self.tokenizer.encode("assistant", allow_special=False)
        return (self.tokenizer.token_id("<|channel|>") is not None and start is not None
                and prompt_ids[-1 - len(assistant):] == [start, *assistant])

    def _forced_prefix(self, req: ChatCompletionRequest, prompt_ids: list[int], thinking: bool = True) -> list[int]:
        """Tokens written after the prompt's `<|start|>assistant` on the model's behalf.
        tool_choice 'required' / named: a tool call's header, so the reply is a call (the model
        writes the arguments, and for 'required' the function name). JSON mode, or reasoning
        turned off (--reasoning off, enable_thinking false, reasoning_effort "none"), on a harmony
        model: the final channel's header, so the answer comes without the analysis channel.
        [] otherwise."""
        forced = req.forced_tool()
        if forced is not None:
            if not self._harmony_prompt(prompt_ids):
                raise bad_request("tool_choice 'required' or a named function needs a harmony (gpt-oss) chat "
                                  "template whose prompt ends with <|start|>assistant", param="tool_choice")
            header = f"{_CALL_HEADER}.{forced} <|constrain|>json<|message|>" if forced else _CALL_HEADER
            return self.tokenizer.encode(header, allow_special=True)
        if (req.constrained() or not thinking) and self._harmony_prompt(prompt_ids):
            return self.tokenizer.encode("<|channel|>final<|message|>", allow_special=True)
        return []

    def _sampling(self, req: SamplingFields, n_prompt: int, limit: int | None) -> SamplingParams:
        d = self.config.defaults
        room = self.engine.ctx_size_per_slot - n_prompt
        if limit is None and self.config.n_predict >= 0:
            limit = self.config.n_predict
        if limit == 0:
            raise bad_request("n_predict 0 (evaluate the prompt only) is not supported", param="n_predict")
        params = SamplingParams(
            temperature=d.temperature if req.temperature is None else req.temperature,
            top_k=d.top_k if req.top_k is None else req.top_k,
            top_p=d.top_p if req.top_p is None else req.top_p,
            min_p=d.min_p if req.min_p is None else req.min_p,
            seed=req.seed if req.seed is not None else self.config.seed,
            max_tokens=min(limit, room) if limit is not None else room,
            ignore_eos=(req.ignore_eos if req.ignore_eos is not None
                        else self.config.ignore_eos and not req.constrained()),  # a constrained reply must end
            samplers=sampler_order(req.samplers) if req.samplers is not None else d.order,
            chain=self._chain(req),
            logit_bias=d.logit_bias if req.logit_bias is None else resolve_logit_bias(
                req.logit_bias, lambda text: self.tokenizer.encode(text, allow_special=False),
                self.tokenizer.vocab_size),
        )
        try:
            params.validate()
        except ValueError as e:
            field_name = str(e).split(" ", 1)[0]
            raise bad_request(str(e), param=field_name if field_name in _CHAIN_FIELDS else None) from None
        return params

    def _chain(self, req: SamplingFields) -> SamplerSettings:
        """The request's llama.cpp samplers over the server's defaults (its flags)."""
        given = {f: getattr(req, f) for f in _CHAIN_FIELDS if getattr(req, f) is not None}
        if "dry_sequence_breakers" in given:
            given["dry_sequence_breakers"] = tuple(given["dry_sequence_breakers"])
        return dataclasses.replace(self.config.defaults.samplers, **given)

    async def _dry_breakers(self, req: SamplingFields) -> Breakers | None:
        """DRY's sequence breakers as tokens when the request turns DRY on: the first scan of the
        vocabulary for a breaker list takes ~0.1 s, so it runs here, off the engine thread."""
        chain = self._chain(req)
        if chain.dry_multiplier == 0.0:
            return None
        return await asyncio.to_thread(tokenizer_breakers, self.tokenizer, chain.dry_sequence_breakers)

    def _head(self, id_prefix: str) -> dict[str, Any]:
        """Fields every response object and stream chunk of one request shares."""
        return {"id": f"{id_prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.model_id,
                "system_fingerprint": f"hybridmoe-{__version__}"}

    def check_n(self, n: int) -> None:
        if n > self.engine.n_parallel:
            raise bad_request(f"n must be between 1 and the number of slots ({self.engine.n_parallel}), got {n}",
                              param="n")

    async def _constraint(self, req: SamplingFields) -> ConstraintSpec | None:
        """The request's output constraint, compiled off the engine thread (a big schema's build
        then delays only this request); 400 naming the field when refused."""
        call_end = tuple(i for i in (self.tokenizer.token_id("<|call|>"),) if i is not None) or None
        try:
            spec = output_constraint(req, call_end)
            if spec is None:
                return None
            return await asyncio.to_thread(lambda: compile_constraint(spec, token_table(self.tokenizer)))
        except ConstraintError as e:
            raise bad_request(str(e), param=e.param) from None

    async def _tool_calls(self, req: ChatCompletionRequest, prompt_ids: list[int]) -> ToolCallSpecs | None:
        """tool_choice "auto" or "required" with tools on a harmony prompt: each function's arguments
        constraint, applied when the model calls it (llama-server's lazy tool-call grammar).
        Compiled off the engine thread and kept per schema (agents resend the same tools)."""
        if not req.tools or req.tool_choice == "none" or req.forced_tool() or not self._harmony_prompt(prompt_ids):
            return None
        marks = [self.tokenizer.token_id(t) for t in ("<|start|>", "<|end|>", "<|message|>", "<|call|>", "<|return|>")]
        if None in marks:
            return None
        call = marks[3]

        def compiled(i: int) -> ConstraintSpec:  # in a worker thread: the first token table takes seconds
            key = json.dumps(req.tools[i].function.parameters, sort_keys=True)
            with self._tool_specs_lock:
                spec = self._tool_specs.get(key)
            if spec is None:
                spec = compile_constraint(tool_arguments_spec(req, i, (call,)), token_table(self.tokenizer))
                with self._tool_specs_lock:
                    if len(self._tool_specs) >= 256:  # oldest first
                        self._tool_specs.pop(next(iter(self._tool_specs)))
                    self._tool_specs[key] = spec
            return spec

        required = req.forced_tool() == ""

        def names() -> ConstraintSpec:
            return compile_constraint(tool_names_spec([t.function.name for t in req.tools], (marks[2],)),
                                      token_table(self.tokenizer))

        try:
            specs = await asyncio.to_thread(lambda: {t.function.name: compiled(i) for i, t in enumerate(req.tools)})
            name_spec = await asyncio.to_thread(names) if required else None
        except ConstraintError as e:
            raise bad_request(str(e), param=e.param) from None
        header = _CALL_HEADER.encode() if required else b""  # what _forced_prefix wrote
        return ToolCallSpecs(specs, *marks, header=header, names=name_spec)

    def submit_n(self, prompt_ids: list[int], req: SamplingFields, limit: int | None, logprobs_k: int | None,
                 n: int = 1, constraint: ConstraintSpec | None = None, tool_calls: ToolCallSpecs | None = None,
                 dry: Breakers | None = None, budget: ReasoningBudget | None = None) -> list[RequestHandle]:
        """`n` requests for one prompt (n > 1: llama-server's n_cmpl, one slot each); all or none.
        `dry`: the request's DRY breakers (`_dry_breakers`); `budget`: its reasoning budget (chat)."""
        self.check_n(n)
        handles: list[RequestHandle] = []
        try:
            for _ in range(n):
                handles.append(self._submit(prompt_ids, req, limit, logprobs_k, constraint, tool_calls, dry, budget))
        except APIError:
            for h in handles:
                h.cancel()
            raise
        return handles

    def _submit(self, prompt_ids: list[int], req: SamplingFields, limit: int | None, logprobs_k: int | None,
                constraint: ConstraintSpec | None = None, tool_calls: ToolCallSpecs | None = None,
                dry: Breakers | None = None, budget: ReasoningBudget | None = None) -> RequestHandle:
        n, ctx = len(prompt_ids), self.engine.ctx_size_per_slot
        if not -1 <= req.id_slot < self.engine.n_parallel:
            raise bad_request(f"id_slot must be -1 (any) or a slot id 0..{self.engine.n_parallel - 1}, "
                              f"got {req.id_slot}", param="id_slot")
        if n == 0:
            raise bad_request("the prompt is empty", param="prompt")
        if n >= ctx:
            raise exceed_context(n, ctx, "messages")
        gen = GenerationRequest(
            prompt_ids=prompt_ids,
            params=self._sampling(req, n, limit),
            stop=req.stop_list(),
            logprobs=logprobs_k,
            constraint=constraint,
            tool_calls=tool_calls if constraint is None else None,
            cache_prompt=req.cache_prompt if req.cache_prompt is not None else self.config.cache_prompt,
            dry_breakers=dry,
            post_sampling_probs=req.post_sampling_probs,
            id_slot=req.id_slot,
            t_max_predict_ms=req.t_max_predict_ms,
            n_indent=req.n_indent,
            reasoning_budget=budget,
            timings_per_token=req.timings_per_token,
        )
        try:
            return self.inflight.add(self.engine.submit(gen, loop=asyncio.get_running_loop()))
        except QueueFullError as e:
            raise APIError(503, str(e), type="unavailable_error", code="server_busy") from None
        except ValueError as e:
            raise bad_request(str(e)) from None

    def _failure(self, final: EngineEvent) -> APIError | None:
        """The error a final event stands for: a failed generation, or one ended by shutdown."""
        if final.finish_reason == "error":
            return APIError(500, f"generation failed: {final.error}", type="server_error")
        if final.finish_reason == "cancelled" and self.inflight.stopping:
            return APIError(503, f"the server is shutting down; generation stopped after "
                                 f"{final.usage.completion_tokens if final.usage else 0} tokens",
                            type="unavailable_error", code="server_shutting_down")
        return None

    def _usage(self, ev: EngineEvent) -> dict[str, Any]:
        u = ev.usage
        return {
            "prompt_tokens": u.prompt_tokens,
            "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        }

    def logprob_entry(self, lp: Any) -> dict[str, Any]:
        def one(tid: int, val: float) -> dict[str, Any]:
            b = self.tokenizer.token_bytes(tid)
            # `id`: llama-server's addition to OpenAI's entry
            return {"id": tid, "token": b.decode("utf-8", errors="replace"), "logprob": val, "bytes": list(b)}

        return {**one(lp.token, lp.logprob), "top_logprobs": [one(t, v) for t, v in lp.top]}

    def _usage_of(self, events: list[EngineEvent]) -> dict[str, Any]:
        """Usage of one request, or of n choices of one prompt (completion tokens summed)."""
        out = self._usage(events[0])
        if len(events) > 1:
            out["completion_tokens"] = sum(ev.usage.completion_tokens for ev in events)
            out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
        return out

    def _finished(self, ev: EngineEvent) -> None:
        if ev.usage is not None:
            self.counters.record(ev.usage)

    def _verbose(self, handle: RequestHandle, c: Collected, stream: bool) -> dict[str, Any]:
        """llama-server's `__verbose` (with --verbose): the native result of the request."""
        return native_final(handle, c, index=0, model=self.model_id, n_ctx=self.engine.ctx_size_per_slot,
                            prompt=self.tokenizer.decode(list(handle.request.prompt_ids)), stream=stream,
                            return_tokens=True, post_sampling=False, token_bytes=self.tokenizer.token_bytes,
                            decode=self.tokenizer.decode)

    # ---- chat ---------------------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest,
                   disconnected: Disconnected | None = None) -> dict[str, Any] | AsyncIterator[str]:
        handles, views = await self.start_chat_n(req)
        head = self._head("chatcmpl")
        self.live_chats.add(head["id"], handles, armed=req.reasoning_control)
        if req.stream:
            return self._chat_stream(handles, views, head, _include_usage(req), req.return_progress)
        return await self._chat_full(handles, views, head, disconnected)

    async def chat_rendered(self, req: ChatCompletionRequest) -> tuple[Rendered, list[int]]:
        """The rendered prompt and its tokens (checked with llama-server's message rules)."""
        tools = None if req.tool_choice == "none" else req.tools
        # Rendering and tokenizing a long conversation takes a while: keep the event loop free.
        return await asyncio.to_thread(self._chat_prompt, req, tools)

    async def chat_prompt_ids(self, req: ChatCompletionRequest) -> list[int]:
        """The rendered, tokenized prompt of a chat request (also what the token-counting endpoints count)."""
        return (await self.chat_rendered(req))[1]

    async def start_chat(self, req: ChatCompletionRequest) -> tuple[RequestHandle, ChatView]:
        """Render -> tokenize -> submit one chat request; its events go through the returned view.
        Shared by chat completions and the Responses / Messages mappings (which build `req`)."""
        handles, views = await self.start_chat_n(req, 1)
        return handles[0], views[0]

    async def start_chat_n(self, req: ChatCompletionRequest,
                           n: int | None = None) -> tuple[list[RequestHandle], list[ChatView]]:
        """`n` (default: req.n) choices of one chat request, one slot and one view each."""
        n = req.n if n is None else n
        self.check_n(n)
        constraint = await self._constraint(req)
        rendered, ids = await self.chat_rendered(req)
        prefix = self._forced_prefix(req, ids, rendered.enable_thinking)
        context = self.tokenizer.encode(rendered.continuation, allow_special=True) if rendered.continuation else []
        k = req.logprobs_k()
        raw = (req.reasoning_format or self.config.reasoning_format) == "none"
        views = [ChatView(self.tokenizer, raw=raw, stop=req.stop_list(), prefix_ids=prefix, context_ids=context)
                 for _ in range(n)]
        tool_calls = await self._tool_calls(req, ids) if constraint is None else None
        ids = ids + prefix
        budget = self._reasoning_budget(req)
        # Last: nothing may fail after the submit.
        dry = await self._dry_breakers(req)
        return self.submit_n(ids, req, req.token_limit(), k, n, constraint, tool_calls, dry, budget), views

    def _reasoning_budget(self, req: ChatCompletionRequest) -> ReasoningBudget | None:
        """llama-server's reasoning budget on a harmony model: the analysis channel's tokens, then
        the budget message and `<|end|>` written for the model (None: no limit). With
        reasoning_control and no limit, a budget that only closes the thinking when asked."""
        tokens = req.reasoning_budget_tokens if req.reasoning_budget_tokens >= 0 else self.config.reasoning_budget
        tok = self.tokenizer
        if (tokens < 0 and not req.reasoning_control) or tok.token_id("<|channel|>") is None \
                or tok.token_id("<|end|>") is None:
            return None
        message = req.reasoning_budget_message
        message = self.config.reasoning_budget_message if message is None else message
        end = (tok.token_id("<|end|>"),)
        forced = tuple(tok.encode(message, allow_special=False)) + end if message else end
        return ReasoningBudget(tuple(tok.encode("<|channel|>analysis<|message|>", allow_special=True)), end, forced,
                               tokens if tokens >= 0 else None)

    async def _chat_full(self, handles: list[RequestHandle], views: list[ChatView], head: dict[str, Any],
                         disconnected: Disconnected | None) -> dict[str, Any]:
        async def one(handle: RequestHandle, view: ChatView) -> tuple[Collected, list[dict[str, Any]]]:
            c, logprobs = Collected(), []
            async for ev in events(handle, disconnected):
                view.push(ev)
                c.push(ev)
                if ev.logprob is not None:
                    logprobs.append(self.logprob_entry(ev.logprob))
            return c, logprobs

        results = await asyncio.gather(*(one(h, v) for h, v in zip(handles, views)))
        choices = []
        for i, ((c, logprobs), handle, view) in enumerate(zip(results, handles, views)):
            last = c.last
            self._finished(last)
            failure = self._failure(last)
            if failure is not None:
                raise failure
            choices.append({
                "index": i,
                "message": {"role": "assistant", **view.message()},
                "logprobs": {"content": logprobs} if handle.request.logprobs is not None else None,
                "finish_reason": view.finish_reason(last.finish_reason),
            })
        out = {**head, "object": "chat.completion", "choices": choices,
               "usage": self._usage_of([c.last for c, _ in results]), "timings": llama_timings(results[0][0].last.timings)}
        if self.config.verbose:
            out["__verbose"] = self._verbose(handles[0], results[0][0], stream=False)
        return out

    async def _chat_stream(self, handles: list[RequestHandle], views: list[ChatView], head: dict[str, Any],
                           include_usage: bool, progress: bool = False) -> AsyncIterator[str]:
        def chunk(i: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
            return {**head, "object": "chat.completion.chunk",
                    "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

        collected = [Collected() for _ in handles]
        finals: list[EngineEvent] = []
        try:
            for i in range(len(handles)):
                yield _sse(chunk(i, {"role": "assistant", "content": None}))
        except BaseException:
            for h in handles:
                h.cancel()  # client gone before the first token: free the slots
            raise
        async for i, ev in merged_events(handles, self.engine, progress):
            if isinstance(ev, Progress):
                yield _sse({**chunk(i, {"role": "assistant", "content": None}), "prompt_progress": ev.to_json()})
                continue
            view = views[i]
            collected[i].push(ev)
            lp = {"content": [self.logprob_entry(ev.logprob)]} if ev.logprob is not None else None
            deltas = view.push(ev)
            per_token = ev.timings and handles[i].request.timings_per_token
            live = {"timings": llama_timings(ev.timings)} if per_token else {}
            for j, d in enumerate(deltas):
                yield _sse({**chunk(i, d, logprobs=lp if j == 0 else None), **live})
            if lp is not None and not deltas:
                yield _sse(chunk(i, {}, logprobs=lp))
            if ev.finish_reason is None:
                continue
            self._finished(ev)
            failure = self._failure(ev)
            if failure is not None:
                yield _sse(failure.body())
                continue
            finals.append(ev)
            final = chunk(i, {}, view.finish_reason(ev.finish_reason))
            if not include_usage:
                final["timings"] = llama_timings(ev.timings)
            if self.config.verbose and i == 0:
                final["__verbose"] = self._verbose(handles[0], collected[0], stream=True)
            yield _sse(final)
        if include_usage and finals:
            # llama-server puts the timings on the last chunk: the usage chunk (choices: []).
            yield _sse({**head, "object": "chat.completion.chunk", "choices": [],
                        "usage": self._usage_of(finals), "timings": llama_timings(finals[-1].timings)})
        yield _sse("[DONE]")

    # ---- legacy completions ---------------------------------------------------------------------
    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """A prompt as text (special tokens parsed, as llama-server does) or as token ids."""
        if isinstance(prompt, str):
            return self._encode_prompt(prompt, "prompt")
        return self._check_ids(prompt, "prompt")

    async def completion(self, req: CompletionRequest,
                         disconnected: Disconnected | None = None) -> dict[str, Any] | AsyncIterator[str]:
        self.check_n(req.n)
        constraint = await self._constraint(req)
        prompt = req.prompt if isinstance(req.prompt, str) or not isinstance(req.prompt[0], str) else req.prompt[0]
        ids = await asyncio.to_thread(self.prompt_ids, prompt)
        echo = self.tokenizer.decode(ids) if req.echo else ""
        handles = self.submit_n(ids, req, req.token_limit(self.config.n_predict), req.logprobs, req.n, constraint,
                                dry=await self._dry_breakers(req))
        head = self._head("cmpl")
        if req.stream:
            return self._completion_stream(handles, head, _include_usage(req), echo, req.return_progress)
        return await self._completion_full(handles, head, disconnected, echo)

    def _legacy_logprobs(self, lps: list[Any]) -> dict[str, Any]:
        """OpenAI's legacy completion logprobs, plus `content` in the chat form (what llama-server's
        /v1/completions gives instead), so clients of either read theirs."""
        piece = self.tokenizer.token_text
        return {
            "tokens": [piece(lp.token) for lp in lps],
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{piece(t): v for t, v in lp.top} for lp in lps],
            "content": [self.logprob_entry(lp) for lp in lps],
        }

    async def _completion_full(self, handles: list[RequestHandle], head: dict[str, Any],
                               disconnected: Disconnected | None, echo: str) -> dict[str, Any]:
        async def one(handle: RequestHandle) -> Collected:
            c = Collected()
            async for ev in events(handle, disconnected):
                c.push(ev)
            return c

        results = await asyncio.gather(*(one(h) for h in handles))
        choices = []
        for i, (c, handle) in enumerate(zip(results, handles)):
            self._finished(c.last)
            failure = self._failure(c.last)
            if failure is not None:
                raise failure
            choices.append({"index": i, "text": echo + c.content(), "finish_reason": c.last.finish_reason,
                            "logprobs": self._legacy_logprobs(c.logprobs) if handle.request.logprobs is not None
                            else None})
        out = {**head, "object": "text_completion", "choices": choices,
               "usage": self._usage_of([c.last for c in results]), "timings": llama_timings(results[0].last.timings)}
        if self.config.verbose:
            out["__verbose"] = self._verbose(handles[0], results[0], stream=False)
        return out

    async def _completion_stream(self, handles: list[RequestHandle], head: dict[str, Any],
                                 include_usage: bool, echo: str, progress: bool = False) -> AsyncIterator[str]:
        def chunk(i: int, text: str, lp: Any = None, finish: str | None = None) -> dict[str, Any]:
            return {**head, "object": "text_completion",
                    "choices": [{"index": i, "text": text, "logprobs": lp, "finish_reason": finish}]}

        finals: list[EngineEvent] = []
        try:
            for i in range(len(handles) if echo else 0):
                yield _sse(chunk(i, echo))
        except BaseException:
            for h in handles:
                h.cancel()
            raise
        async for i, ev in merged_events(handles, self.engine, progress):
            if isinstance(ev, Progress):
                yield _sse({**chunk(i, ""), "prompt_progress": ev.to_json()})
                continue
            if ev.finish_reason is not None:
                self._finished(ev)
            failure = self._failure(ev) if ev.finish_reason is not None else None
            if failure is not None:
                yield _sse(failure.body())
                continue
            lp = self._legacy_logprobs([ev.logprob]) if ev.logprob is not None else None
            if ev.text or lp or ev.finish_reason:
                c = chunk(i, ev.text, lp, ev.finish_reason)
                if ev.timings and (ev.finish_reason is None or not include_usage):  # per token on request
                    c["timings"] = llama_timings(ev.timings)
                yield _sse(c)
            if ev.finish_reason:
                finals.append(ev)
        if include_usage and finals:
            yield _sse({**head, "object": "text_completion", "choices": [], "usage": self._usage_of(finals),
                        "timings": llama_timings(finals[-1].timings)})
        yield _sse("[DONE]")

    # ---- small endpoints ----------------------------------------------------------------------
    def _check_ids(self, ids: list[int], param: str) -> list[int]:
        n = self.tokenizer.vocab_size
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {n})", param=param)
        return list(ids)

    def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        ids = self.tokenizer.encode(req.content, allow_special=req.parse_special)
        bos = self.tokenizer.bos_id
        if req.add_special and bos is not None and self.tokenizer.token_id("<|start|>") is None:
            ids = [bos, *ids]  # harmony prompts never start with BOS
        if req.with_pieces:
            return {"tokens": [{"id": i, "piece": self.tokenizer.token_text(i)} for i in ids]}
        return {"tokens": ids}

    def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        return {"content": self.tokenizer.decode(self._check_ids(req.tokens, "tokens"))}

    def apply_template(self, req: ApplyTemplateRequest) -> dict[str, Any]:
        r = self._render(req.messages, req.tools, req.reasoning_effort or self.config.reasoning_effort,
                         req.chat_template_kwargs, req.add_generation_prompt, req.continue_final_message)
        return {"prompt": r.prompt}

    def input_tokens(self, req: ChatCompletionRequest) -> dict[str, Any]:
        """llama-server's /v1/chat/completions/input_tokens: the prompt's token count."""
        tools = None if req.tool_choice == "none" else req.tools
        rendered, ids = self._chat_prompt(req, tools)
        return {"object": "response.input_tokens", "input_tokens": len(ids)}

    def models(self) -> dict[str, Any]:
        """OpenAI's list (`data`) with llama-server's additions: `meta`, `architecture`, and the
        Ollama-style `models` list beside it."""
        info = self.engine.model_info
        meta = {"n_vocab": info.vocab_size, "n_ctx": self.engine.ctx_size_per_slot, "n_ctx_train": info.n_ctx_train,
                "n_embd": info.n_embd, "n_params": info.n_params, "size": info.size_bytes}
        if info.vocab_type is not None:
            meta = {"vocab_type": info.vocab_type, **meta}  # llama-server's key order
        if info.ftype is not None:
            meta["ftype"] = info.ftype
        text_only = {"input_modalities": ["text"], "output_modalities": ["text"]}
        ollama = {"name": self.model_id, "model": self.model_id, "modified_at": "", "size": "", "digest": "",
                  "type": "model", "description": "", "tags": list(self.config.tags), "capabilities": ["completion"],
                  "parameters": "", "details": {"parent_model": "", "format": "gguf", "family": "", "families": [],
                                                "parameter_size": "", "quantization_level": ""}}
        return {"models": [ollama], "object": "list",
                "data": [{"id": self.model_id, "aliases": self.config.aliases(), "tags": list(self.config.tags),
                          "object": "model", "architecture": text_only, "created": self.created,
                          "owned_by": "hybridmoe", "meta": meta}]}

    def props(self) -> dict[str, Any]:
        d = self.config.defaults
        return {
            "default_generation_settings": {
                "n_ctx": self.engine.ctx_size_per_slot,
                "params": {"seed": 4294967295 if self.config.seed is None else self.config.seed,
                           "temperature": d.temperature, "top_k": d.top_k, "top_p": d.top_p, "min_p": d.min_p,
                           "n_predict": self.config.n_predict, "max_tokens": self.config.n_predict,
                           "samplers": list(d.order), "reasoning_format": self.config.reasoning_format,
                           **{k: list(v) if isinstance(v, tuple) else v
                              for k, v in dataclasses.asdict(d.samplers).items()},
                           # llama-server's other defaults, as it reports them
                           "ignore_eos": self.config.ignore_eos, "n_probs": 0, "post_sampling_probs": False,
                           "stream": False, "timings_per_token": False, "n_keep": 0, "n_discard": 0, "lora": [],
                           "backend_sampling": False, "chat_format": "Content-only", "generation_prompt": "",
                           "reasoning_in_content": False,
                           "speculative.types": self.engine.speculative.type_name},
            },
            "total_slots": self.engine.n_parallel,
            "model_alias": self.model_id,
            "model_path": self.config.model_path,
            "chat_template": self.template,
            "chat_template_caps": {  # what this server accepts and renders for the harmony template
                "supports_object_arguments": True, "supports_parallel_tool_calls": True,
                "supports_preserve_reasoning": False, "supports_reasoning_effort": True,
                "supports_string_content": True, "supports_system_role": True, "supports_tool_calls": True,
                "supports_tools": True, "supports_typed_content": True},
            "model_ftype": self.engine.model_info.ftype,
            "modalities": {"vision": False, "audio": False},
            "build_info": f"hybridmoe {__version__}",
            "bos_token": self.renderer.special["bos_token"],
            "eos_token": self.renderer.special["eos_token"],
            "is_sleeping": False,
        }

    def slots(self) -> list[dict[str, Any]]:
        """llama-server's /slots fields (for its dashboards and scripts), then our cache counters."""
        out = []
        for s in self.engine.status()["slots"]:
            sp = s.pop("sampling")
            pending, n_max = s.pop("n_prompt_pending"), s.pop("max_tokens")
            params: dict[str, Any] = {"chat_format": "GPT-OSS", "reasoning_format": self.config.reasoning_format,
                                      "n_probs": s.pop("n_probs")}
            if sp is not None:
                params.update(temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, min_p=sp.min_p,
                              seed=4294967295 if sp.seed is None or sp.seed < 0 else sp.seed,
                              n_predict=n_max, max_tokens=n_max, ignore_eos=sp.ignore_eos,
                              samplers=list(sp.samplers or SAMPLER_ORDER),
                              **{k: list(v) if isinstance(v, tuple) else v
                                 for k, v in dataclasses.asdict(sp.chain).items()})
            n_prompt = s["n_prompt_tokens"]
            out.append({
                **s, "params": params,
                "n_prompt_tokens_cache": s["n_prompt_cached"],
                "n_prompt_tokens_processed": max(0, n_prompt - pending - s["n_prompt_cached"]),
                "next_token": [{"has_next_token": s["is_processing"], "has_new_line": False,
                                "n_remain": n_max - s["n_decoded"] if s["is_processing"] else -1,
                                "n_decoded": s["n_decoded"]}],
            })
        return out

    def slot_action(self, id_slot: int, action: str, filename: str | None) -> dict[str, Any]:
        """llama-server's POST /slots/{id}?action=save|restore|erase (blocking: run in a thread)."""
        from hybridmoe.engine.engine import SlotError
        from hybridmoe.engine.slot_files import SlotFileError

        if not self.config.slot_save_path:
            raise APIError(501, "This server does not support slots action. Start it with `--slot-save-path`",
                           type="not_supported_error")
        if action not in ("save", "restore", "erase"):
            raise bad_request(f"action must be save, restore or erase, got {action!r}", param="action")
        try:
            if action == "erase":
                return {"id_slot": id_slot, **self.engine.erase_slot(id_slot)}
            path = self._slot_file(filename)
            if action == "save":
                r = self.engine.save_slot(id_slot, str(path))
                return {"id_slot": id_slot, "filename": filename, "n_saved": r["n_saved"],
                        "n_written": r["n_written"], "timings": {"save_ms": r["save_ms"]}}
            if not path.is_file():
                raise bad_request(f"no slot file named {filename!r} in the slot save path", param="filename")
            r = self.engine.restore_slot(id_slot, str(path))
            return {"id_slot": id_slot, "filename": filename, "n_restored": r["n_restored"],
                    "n_read": r["n_read"], "timings": {"restore_ms": r["restore_ms"]}}
        except (SlotError, SlotFileError) as e:
            raise bad_request(str(e), param="filename" if isinstance(e, SlotFileError) else "id_slot") from None
        except OSError as e:
            raise APIError(500, f"slot file {filename!r}: {e.strerror or e}", type="server_error") from None

    def _slot_file(self, filename: str | None) -> Path:
        """A plain file name inside --slot-save-path: no directories, no hidden or special names."""
        if not isinstance(filename, str) or not filename:
            raise bad_request("filename is required", param="filename")
        if (len(filename.encode("utf-8", "surrogatepass")) > 255 or filename.startswith(".")
                or any(c in filename for c in '/\\:') or any(ord(c) < 32 or 0xD800 <= ord(c) < 0xE000 for c in filename)):
            raise bad_request("Invalid filename", param="filename")
        return Path(self.config.slot_save_path) / filename

    def metrics_text(self) -> str:
        return prometheus_text(self.engine, self.counters)
