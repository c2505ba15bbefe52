"""Jobs -> engine requests: the model's template and chat format, prompt checks, output
constraints, sampling, reasoning budgets; then the consumer (server/generation.py) submits them.

Everything that can be refused is refused here, before the engine sees the request, so a streamed
response never starts for a request that will fail.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Sequence
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
from hybridmoe.engine.dry import Breakers
from hybridmoe.engine.engine import Engine, GenerationRequest
from hybridmoe.engine.reasoning_budget import ReasoningBudget
from hybridmoe.server.chat_checks import check_messages
from hybridmoe.server.chat_control import LiveChats
from hybridmoe.server.chat_render import ChatRenderer, Rendered
from hybridmoe.server.constraint_fields import output_constraint, tool_arguments_spec
from hybridmoe.server.generation import Consumer, Generation
from hybridmoe.server.jobs import ChatJob, TextJob
from hybridmoe.server.limits import check_template_kwargs, check_tools
from hybridmoe.server.metrics import ServerCounters
from hybridmoe.server.protocol import APIError, ChatMessage, SamplingFields, Tool, bad_request
from hybridmoe.server.native_result import native_final
from hybridmoe.server.reply import Reply, ReplyBuilder
from hybridmoe.server.sampling_params import ServerSampling, dry_breakers, sampling_params
from hybridmoe.settings import SamplingDefaults
from hybridmoe.tokenizer.formats import choose_format
from hybridmoe.tokenizer.tokenizer import TokenLimitExceeded

TOOL_SPEC_CACHE = 256  # compiled tool-argument constraints kept (agents resend the same tools)


@dataclass
class ServiceConfig:
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


def exceed_context(n_prompt: int, n_ctx: int, param: str, at_least: bool = False) -> APIError:
    """llama-server's error for a prompt longer than a slot's context: clients read n_prompt_tokens
    and n_ctx from it to trim the history (`at_least`: the tokenizer stopped counting early)."""
    count = f"at least {n_prompt}" if at_least else str(n_prompt)
    return APIError(400, f"request ({count} tokens) exceeds the available context size ({n_ctx} tokens), "
                         "try increasing it", type="exceed_context_size_error", param=param,
                    code="context_length_exceeded", extra={"n_prompt_tokens": n_prompt, "n_ctx": n_ctx})


class Service:
    """The model being served, and what every API needs to run a job on it."""

    def __init__(self, engine: Engine, config: ServiceConfig) -> None:
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
        # Any model name is served (llama-server serves its one model whatever the client sends).
        self.model_id = (config.aliases() or [Path(config.model_path).name])[0]
        self.format = choose_format(self.template, self.tokenizer)
        self.renderer = ChatRenderer(self.template, self.tokenizer, config.chat_template_kwargs, config.reasoning,
                                     self.format)
        self.sampling = ServerSampling(config.defaults, config.seed, config.n_predict, config.ignore_eos)
        self.counters = ServerCounters()
        self.consumer = Consumer(engine, self.counters)
        self.live_chats = LiveChats()  # for POST /v1/chat/completions/control
        self.created = int(time.time())
        self._tool_specs: dict[str, ConstraintSpec] = {}  # compiled tool-argument constraints by schema
        self._tool_specs_lock = threading.Lock()  # compiled in worker threads

    def head(self, id_prefix: str) -> dict[str, Any]:
        """Fields every OpenAI response object and stream chunk of one request shares."""
        return {"id": f"{id_prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.model_id,
                "system_fingerprint": f"hybridmoe-{__version__}"}

    def verbose(self, req: GenerationRequest, reply: Reply, stream: bool, *,
                asked: bool | None) -> dict[str, Any] | None:
        """llama-server's `__verbose` (the request's `verbose`, else --verbose): the native result."""
        if not (self.config.verbose if asked is None else asked):
            return None
        return native_final(req, reply, index=0, model=self.model_id, n_ctx=self.engine.ctx_size_per_slot,
                            prompt=self.tokenizer.decode(list(req.prompt_ids)), stream=stream, return_tokens=True,
                            post_sampling=False, token_bytes=self.tokenizer.token_bytes)

    # ---- prompts ------------------------------------------------------------------------------
    def encode_prompt(self, text: str, param: str) -> list[int]:
        """Prompt ids, refused as soon as they certainly exceed a slot's context (the tokenizer
        stops early: a huge prompt costs about what a full context costs)."""
        ctx = self.engine.ctx_size_per_slot
        try:
            return self.tokenizer.encode(text, allow_special=True, max_tokens=ctx - 1)
        except TokenLimitExceeded as e:
            raise exceed_context(e.at_least, ctx, param, at_least=True) from None

    def check_ids(self, ids: Sequence[int], param: str) -> list[int]:
        n = self.tokenizer.vocab_size
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {n})", param=param)
        return list(ids)

    def render(self, messages: list[ChatMessage], tools: list[Tool] | None, effort: str | None,
               kwargs: dict[str, Any] | None, add_generation_prompt: bool = True,
               continue_final_message: bool | None = None) -> Rendered:
        """The conversation through the template, checked with llama-server's message rules."""
        check_template_kwargs(kwargs)
        check_tools(tools)
        plan = check_messages(messages, add_generation_prompt, continue_final_message)
        return self.renderer.render(messages, tools, effort or self.config.reasoning_effort, kwargs, plan)

    def _chat_prompt(self, job: ChatJob) -> tuple[Rendered, list[int]]:
        r = self.render(job.messages, job.tools, job.reasoning_effort, job.chat_template_kwargs,
                        job.add_generation_prompt, job.continue_final_message)
        return r, self.encode_prompt(r.prompt, "messages")

    async def chat_prompt(self, job: ChatJob) -> tuple[Rendered, list[int]]:
        """The rendered prompt and its tokens; rendering a long conversation takes a while, so it
        runs in a worker thread."""
        return await asyncio.to_thread(self._chat_prompt, job)

    # ---- jobs -> generations ------------------------------------------------------------------
    def _check_n(self, n: int) -> None:
        if n > self.engine.n_parallel:
            raise bad_request(f"n must be between 1 and the number of slots ({self.engine.n_parallel}), got {n}",
                              param="n")

    async def start_chat(self, job: ChatJob) -> Generation:
        """Render -> tokenize -> constrain -> submit `job.n` choices, each with its reply builder."""
        self._check_n(job.n)
        constraint = await self._constraint(job.sampling, job.tools, job.forced_tool)
        rendered, ids = await self.chat_prompt(job)
        prefix = self._forced_prefix(job, ids, rendered.enable_thinking)
        context = self.tokenizer.encode(rendered.continuation, allow_special=True) if rendered.continuation else []
        tool_calls = await self._tool_calls(job, ids) if constraint is None else None
        budget = self._reasoning_budget(job)
        dry = await dry_breakers(job.sampling, self.config.defaults, self.tokenizer)
        raw = (job.reasoning_format or self.config.reasoning_format) == "none"
        requests = [self._request(ids + prefix, job.sampling, job.token_limit, job.logprobs, constraint, tool_calls,
                                  dry, budget) for _ in range(job.n)]
        builders = [ReplyBuilder(None, prefix_text=self.tokenizer.decode(prefix)) if raw else
                    ReplyBuilder(self.format.parser(), stop=job.sampling.stop_list(), prefix_ids=prefix,
                                 context_ids=context, is_special=self.tokenizer.is_special) for _ in range(job.n)]
        return self.consumer.submit(requests, builders)  # last: nothing may fail after the submit

    async def start_text(self, job: TextJob) -> Generation:
        """`job.n` raw replies for each prompt, in order."""
        self._check_n(job.n)
        constraint = await self._constraint(job.sampling)
        dry = await dry_breakers(job.sampling, self.config.defaults, self.tokenizer)
        requests = [self._request(ids, job.sampling, job.token_limit, job.logprobs, constraint, None, dry, None)
                    for ids in job.prompts for _ in range(job.n)]
        return self.consumer.submit(requests, [ReplyBuilder(None) for _ in requests])

    def _request(self, prompt_ids: list[int], fields: SamplingFields, limit: int | None, logprobs: int | None,
                 constraint: ConstraintSpec | None, tool_calls: ToolCallSpecs | None, dry: Breakers | None,
                 budget: ReasoningBudget | None) -> GenerationRequest:
        n, ctx = len(prompt_ids), self.engine.ctx_size_per_slot
        if not -1 <= fields.id_slot < self.engine.n_parallel:
            raise bad_request(f"id_slot must be -1 (any) or a slot id 0..{self.engine.n_parallel - 1}, "
                              f"got {fields.id_slot}", param="id_slot")
        if n == 0:
            raise bad_request("the prompt is empty", param="prompt")
        if n >= ctx:
            raise exceed_context(n, ctx, "messages")
        return GenerationRequest(
            prompt_ids=prompt_ids,
            params=sampling_params(fields, self.sampling, self.tokenizer, ctx - n, limit),
            stop=fields.stop_list(),
            logprobs=logprobs,
            constraint=constraint,
            tool_calls=tool_calls if constraint is None else None,
            cache_prompt=fields.cache_prompt if fields.cache_prompt is not None else self.config.cache_prompt,
            dry_breakers=dry,
            post_sampling_probs=fields.post_sampling_probs,
            id_slot=fields.id_slot,
            t_max_predict_ms=fields.t_max_predict_ms,
            n_indent=fields.n_indent,
            reasoning_budget=budget,
            timings_per_token=fields.timings_per_token,
        )

    # ---- what the chat format writes or constrains --------------------------------------------
    def _forced_prefix(self, job: ChatJob, prompt_ids: list[int], thinking: bool) -> list[int]:
        """Tokens written after the prompt on the model's behalf. A forced tool_choice: a call's
        header, so the reply is a call (the model writes the arguments, and for 'required' the
        function name). JSON mode, or reasoning turned off (--reasoning off, enable_thinking
        false, reasoning_effort "none"): the format's direct-answer header. [] otherwise."""
        at_reply = self.format.ends_in_generation_prompt(prompt_ids)
        if job.forced_tool is not None:
            text = self.format.forced_call(job.forced_tool or None) if at_reply else None
            if text is None:
                raise bad_request(f"tool_choice 'required' or a named function needs a chat format that can force a "
                                  f"call (this template's is {self.format.name}; harmony templates can) and a prompt "
                                  "that ends with the generation prompt", param="tool_choice")
            return self.tokenizer.encode(text, allow_special=True)
        text = self.format.forced_answer() if (job.sampling.constrained() or not thinking) and at_reply else None
        return self.tokenizer.encode(text, allow_special=True) if text else []

    async def _constraint(self, fields: SamplingFields, tools: list[Tool] | None = None,
                          forced: str | None = None) -> ConstraintSpec | None:
        """The output constraint, compiled in a worker thread (a big schema's build then delays only
        this request); 400 naming the field when refused."""
        try:
            spec = output_constraint(fields, tools, forced, self.format.call_end_ids())
            if spec is None:
                return None
            return await asyncio.to_thread(lambda: compile_constraint(spec, token_table(self.tokenizer)))
        except ConstraintError as e:
            raise bad_request(str(e), param=e.param) from None

    async def _tool_calls(self, job: ChatJob, prompt_ids: list[int]) -> ToolCallSpecs | None:
        """Tools offered, no named function forced: each function's arguments constraint, applied
        when the model calls it (llama-server's lazy tool-call grammar); for 'required', the
        function names too. Compiled in worker threads and kept per schema."""
        marks = self.format.tool_call_marks()
        tools = job.tools
        if not tools or job.forced_tool or marks is None or not self.format.ends_in_generation_prompt(prompt_ids):
            return None

        def compiled(i: int) -> ConstraintSpec:  # in a worker thread: the first token table takes seconds
            key = json.dumps(tools[i].function.parameters, sort_keys=True)
            with self._tool_specs_lock:
                spec = self._tool_specs.get(key)
            if spec is None:
                spec = compile_constraint(tool_arguments_spec(tools, i, (marks.call,)), token_table(self.tokenizer))
                with self._tool_specs_lock:
                    if len(self._tool_specs) >= TOOL_SPEC_CACHE:  # oldest first
                        self._tool_specs.pop(next(iter(self._tool_specs)))
                    self._tool_specs[key] = spec
            return spec

        required = job.forced_tool == ""

        def names() -> ConstraintSpec:
            return compile_constraint(tool_names_spec([t.function.name for t in tools], (marks.message,)),
                                      token_table(self.tokenizer))

        try:
            specs = await asyncio.to_thread(lambda: {t.function.name: compiled(i) for i, t in enumerate(tools)})
            name_spec = await asyncio.to_thread(names) if required else None
        except ConstraintError as e:
            raise bad_request(str(e), param=e.param) from None
        header = self.format.call_header() if required else b""  # what _forced_prefix wrote
        return ToolCallSpecs(specs, marks.start, marks.end, marks.message, marks.call, marks.ret, header=header,
                             names=name_spec)

    def _reasoning_budget(self, job: ChatJob) -> ReasoningBudget | None:
        """llama-server's reasoning budget: the thinking's tokens, then the budget message and the
        thinking's end written for the model (None: no limit). With reasoning_control and no
        limit, a budget that only closes the thinking when asked."""
        tokens = job.reasoning_budget_tokens if job.reasoning_budget_tokens >= 0 else self.config.reasoning_budget
        marks = self.format.budget_marks()
        if (tokens < 0 and not job.reasoning_control) or marks is None:
            return None
        message = job.reasoning_budget_message
        message = self.config.reasoning_budget_message if message is None else message
        forced = tuple(self.tokenizer.encode(message, allow_special=False)) + marks.end if message else marks.end
        return ReasoningBudget(marks.start, marks.end, forced, tokens if tokens >= 0 else None)
