"""Chat/completions logic: template -> tokenize -> engine -> OpenAI responses (JSON or SSE chunks).

Everything that can be refused is refused before the request reaches the engine, so a streamed
response never starts for a request that will fail.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridmoe import __version__
from hybridmoe.engine.constraints import ConstraintError, ConstraintSpec, compile_constraint, token_table
from hybridmoe.engine.engine import Engine, EngineEvent, GenerationRequest, QueueFullError, RequestHandle
from hybridmoe.engine.sampling import SamplingParams
from hybridmoe.server.chat_view import ChatView
from hybridmoe.server.constraint_fields import output_constraint
from hybridmoe.server.limits import check_template_kwargs, check_tools
from hybridmoe.server.metrics import prometheus_text
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
from hybridmoe.tokenizer.chat_template import ChatTemplateError, render_chat
from hybridmoe.tokenizer.tokenizer import TokenLimitExceeded


@dataclass
class SamplingDefaults:
    """Server-wide defaults (`--temp/--top-k/--top-p/--min-p`; llama-server's values)."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05


@dataclass
class ServingConfig:
    model_path: str
    alias: str | None = None
    reasoning_format: str = "auto"  # none | auto | deepseek (same as auto for harmony)
    chat_template: str | None = None  # overrides the GGUF's tokenizer.chat_template
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    test_hooks: bool = False  # honour `test_forced_output` (see GenerationRequest.forced_tokens)
    slot_save_path: str | None = None  # --slot-save-path: directory of slot state files


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


class Serving:
    """Turns validated protocol requests into engine requests and engine events into responses."""

    def __init__(self, engine: Engine, llm: Any, config: ServingConfig) -> None:
        self.engine = engine
        self.llm = llm
        self.config = config
        self.tokenizer = llm.tokenizer
        self.template = config.chat_template or llm.chat_template
        if not self.template:
            raise ValueError(f"{config.model_path} has no tokenizer.chat_template; pass --chat-template-file")
        path = Path(config.model_path)
        self.model_id = config.alias or path.name
        self._names = {self.model_id, config.model_path, path.name, path.stem}
        self.created = int(time.time())
        self.inflight = InFlight()

    # ---- request preparation ------------------------------------------------------------------
    def _check_model(self, name: str | None) -> None:
        if name and name not in self._names:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{self.model_id}`",
                           param="model", code="model_not_found")

    def _render(self, messages: list[ChatMessage], tools: list[Tool] | None, effort: str | None,
                kwargs: dict[str, Any] | None) -> str:
        check_template_kwargs(kwargs)
        check_tools(tools)
        extra = {**self.config.chat_template_kwargs, **(kwargs or {})}
        if effort is not None:
            extra["reasoning_effort"] = effort
        tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
        try:
            return render_chat(self.template, [m.for_template() for m in messages], tools=tool_dicts,
                               add_generation_prompt=True, **extra)
        except ChatTemplateError as e:  # raise_exception in the template, bad roles: the request's fault
            raise bad_request(f"chat template failed: {e}", param="messages") from None

    def _chat_prompt_ids(self, messages: list[ChatMessage], tools: list[Tool] | None, effort: str | None,
                         kwargs: dict[str, Any] | None) -> list[int]:
        return self._encode_prompt(self._render(messages, tools, effort, kwargs), "messages")

    def _encode_prompt(self, text: str, param: str) -> list[int]:
        """Prompt ids, refused as soon as they certainly exceed a slot's context (the tokenizer
        stops early: a huge prompt costs about what a full context costs)."""
        ctx = self.engine.ctx_size_per_slot
        try:
            return self.tokenizer.encode(text, allow_special=True, max_tokens=ctx - 1)
        except TokenLimitExceeded as e:
            raise bad_request(f"the request has at least {e.at_least} prompt tokens, more than the context of "
                              f"a slot ({ctx} tokens)", param=param, code="context_length_exceeded") from None

    def _harmony_prompt(self, prompt_ids: list[int]) -> bool:
        """The rendered prompt ends with harmony's `<|start|>assistant` generation header."""
        start, assistant = self.tokenizer.token_id("<|start|>"), self.tokenizer.encode("assistant", allow_special=False)
        return (self.tokenizer.token_id("<|channel|>") is not None and start is not None
                and prompt_ids[-1 - len(assistant):] == [start, *assistant])

    def _forced_prefix(self, req: ChatCompletionRequest, prompt_ids: list[int]) -> list[int]:
        """Tokens written after the prompt's `<|start|>assistant` on the model's behalf.
        tool_choice 'required' / named: a tool call's header, so the reply is a call (the model
        writes the arguments, and for 'required' the function name). JSON mode on a harmony model:
        the final channel's header, so the constrained JSON is the answer. Both skip the analysis
        channel. [] otherwise."""
        forced = req.forced_tool()
        if forced is not None:
            if not self._harmony_prompt(prompt_ids):
                raise bad_request("tool_choice 'required' or a named function needs a harmony (gpt-oss) chat "
                                  "template whose prompt ends with <|start|>assistant", param="tool_choice")
            header = f"<|channel|>commentary to=functions.{forced} <|constrain|>json<|message|>" if forced else \
                "<|channel|>commentary to=functions"
            return self.tokenizer.encode(header, allow_special=True)
        if req.constrained() and self._harmony_prompt(prompt_ids):
            return self.tokenizer.encode("<|channel|>final<|message|>", allow_special=True)
        return []

    def _sampling(self, req: SamplingFields, n_prompt: int, limit: int | None, logprobs_k: int | None) -> SamplingParams:
        d = self.config.defaults
        room = self.engine.ctx_size_per_slot - n_prompt
        params = SamplingParams(
            temperature=d.temperature if req.temperature is None else req.temperature,
            top_k=d.top_k if req.top_k is None else req.top_k,
            top_p=d.top_p if req.top_p is None else req.top_p,
            min_p=d.min_p if req.min_p is None else req.min_p,
            seed=req.seed,
            max_tokens=min(limit, room) if limit is not None else room,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs_k or 0,
        )
        try:
            params.validate()
        except ValueError as e:
            raise bad_request(str(e)) from None
        return params

    def _head(self, id_prefix: str) -> dict[str, Any]:
        """Fields every response object and stream chunk of one request shares."""
        return {"id": f"{id_prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.model_id,
                "system_fingerprint": f"hybridmoe-{__version__}"}

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

    def _submit(self, prompt_ids: list[int], req: SamplingFields, limit: int | None,
                logprobs_k: int | None, constraint: ConstraintSpec | None = None) -> RequestHandle:
        n, ctx = len(prompt_ids), self.engine.ctx_size_per_slot
        if n == 0:
            raise bad_request("the prompt is empty", param="prompt")
        if n >= ctx:
            raise bad_request(f"the request has {n} prompt tokens, more than the context of a slot "
                              f"({ctx} tokens)", param="messages", code="context_length_exceeded")
        gen = GenerationRequest(
            prompt_ids=prompt_ids,
            params=self._sampling(req, n, limit, logprobs_k),
            stop=req.stop_list(),
            logprobs=logprobs_k,
            forced_tokens=self._forced(req),
            constraint=constraint,
        )
        try:
            return self.inflight.add(self.engine.submit(gen, loop=asyncio.get_running_loop()))
        except QueueFullError as e:
            raise APIError(503, str(e), type="unavailable_error", code="server_busy") from None
        except ValueError as e:
            raise bad_request(str(e)) from None

    def _forced(self, req: SamplingFields) -> list[int] | None:
        if req.test_forced_output is None:
            return None
        if not self.config.test_hooks:
            raise bad_request("test_forced_output needs a server started with --test-hooks",
                              param="test_forced_output")
        return self.tokenizer.encode(req.test_forced_output, allow_special=True)

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

    def _logprob_entry(self, lp: Any) -> dict[str, Any]:
        def one(tid: int, val: float) -> dict[str, Any]:
            b = self.tokenizer.token_bytes(tid)
            return {"token": b.decode("utf-8", errors="replace"), "logprob": val, "bytes": list(b)}

        return {**one(lp.token, lp.logprob), "top_logprobs": [one(t, v) for t, v in lp.top]}

    # ---- chat ---------------------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest,
                   disconnected: Disconnected | None = None) -> dict[str, Any] | AsyncIterator[str]:
        handle, view = await self.start_chat(req)
        head = self._head("chatcmpl")
        if req.stream:
            return self._chat_stream(handle, view, head, _include_usage(req))
        return await self._chat_full(handle, view, head, disconnected)

    async def chat_prompt_ids(self, req: ChatCompletionRequest) -> list[int]:
        """The rendered, tokenized prompt of a chat request (also what the token-counting endpoints count)."""
        self._check_model(req.model)
        tools = None if req.tool_choice == "none" else req.tools
        # Rendering and tokenizing a long conversation takes a while: keep the event loop free.
        return await asyncio.to_thread(self._chat_prompt_ids, req.messages, tools, req.reasoning_effort,
                                       req.chat_template_kwargs)

    async def start_chat(self, req: ChatCompletionRequest) -> tuple[RequestHandle, ChatView]:
        """Render -> tokenize -> submit one chat request; its events go through the returned view.
        Shared by chat completions and the Responses / Messages mappings (which build `req`)."""
        constraint = await self._constraint(req)
        ids = await self.chat_prompt_ids(req)
        prefix = self._forced_prefix(req, ids)
        k = (req.top_logprobs or 0) if req.logprobs else None
        view = ChatView(self.tokenizer, raw=(req.reasoning_format or self.config.reasoning_format) == "none",
                        stop=req.stop_list(), prefix_ids=prefix)
        ids = ids + prefix
        # Last: nothing may fail after the submit.
        handle = self._submit(ids, req, req.token_limit(), k, constraint)
        return handle, view

    async def _chat_full(self, handle: RequestHandle, view: ChatView, head: dict[str, Any],
                         disconnected: Disconnected | None) -> dict[str, Any]:
        logprobs: list[dict[str, Any]] = []
        async for ev in events(handle, disconnected):
            view.push(ev)
            if ev.logprob is not None:
                logprobs.append(self._logprob_entry(ev.logprob))
            last = ev
        failure = self._failure(last)
        if failure is not None:
            raise failure
        message = {"role": "assistant", **view.message()}
        return {
            **head,
            "object": "chat.completion",
            "choices": [{
                "index": 0,
                "message": message,
                "logprobs": {"content": logprobs} if handle.request.logprobs is not None else None,
                "finish_reason": view.finish_reason(last.finish_reason),
            }],
            "usage": self._usage(last),
            "timings": last.timings,
        }

    async def _chat_stream(self, handle: RequestHandle, view: ChatView, head: dict[str, Any],
                           include_usage: bool) -> AsyncIterator[str]:
        def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
            return {**head, "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

        try:
            yield _sse(chunk({"role": "assistant", "content": None}))
            async for ev in handle:
                lp = {"content": [self._logprob_entry(ev.logprob)]} if ev.logprob is not None else None
                deltas = view.push(ev)
                for i, d in enumerate(deltas):
                    yield _sse(chunk(d, logprobs=lp if i == 0 else None))
                if lp is not None and not deltas:
                    yield _sse(chunk({}, logprobs=lp))
                if ev.finish_reason is None:
                    continue
                failure = self._failure(ev)
                if failure is not None:
                    yield _sse(failure.body())
                else:
                    final = chunk({}, view.finish_reason(ev.finish_reason))
                    final["timings"] = ev.timings
                    yield _sse(final)
                    if include_usage:
                        yield _sse({**head, "object": "chat.completion.chunk", "choices": [],
                                    "usage": self._usage(ev)})
                yield _sse("[DONE]")
        finally:
            handle.cancel()  # client gone mid-stream: the engine frees the slot at its next step

    # ---- legacy completions ---------------------------------------------------------------------
    async def completion(self, req: CompletionRequest,
                         disconnected: Disconnected | None = None) -> dict[str, Any] | AsyncIterator[str]:
        self._check_model(req.model)
        constraint = await self._constraint(req)
        if isinstance(req.prompt, str) or isinstance(req.prompt[0], str):
            text = req.prompt if isinstance(req.prompt, str) else req.prompt[0]
            ids = await asyncio.to_thread(self._encode_prompt, text, "prompt")
        else:
            ids = self._check_ids(req.prompt, "prompt")
        echo = self.tokenizer.decode(ids) if req.echo else ""
        handle = self._submit(ids, req, req.max_tokens, req.logprobs, constraint)
        head = self._head("cmpl")
        if req.stream:
            return self._completion_stream(handle, head, _include_usage(req), echo)
        return await self._completion_full(handle, head, disconnected, echo)

    def _legacy_logprobs(self, lps: list[Any]) -> dict[str, Any]:
        piece = self.tokenizer.token_text
        return {
            "tokens": [piece(lp.token) for lp in lps],
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{piece(t): v for t, v in lp.top} for lp in lps],
        }

    async def _completion_full(self, handle: RequestHandle, head: dict[str, Any],
                               disconnected: Disconnected | None, echo: str) -> dict[str, Any]:
        text, lps = [echo], []
        async for ev in events(handle, disconnected):
            text.append(ev.text)
            if ev.logprob is not None:
                lps.append(ev.logprob)
            last = ev
        failure = self._failure(last)
        if failure is not None:
            raise failure
        return {
            **head,
            "object": "text_completion",
            "choices": [{"index": 0, "text": "".join(text), "finish_reason": last.finish_reason,
                         "logprobs": self._legacy_logprobs(lps) if handle.request.logprobs is not None else None}],
            "usage": self._usage(last),
            "timings": last.timings,
        }

    async def _completion_stream(self, handle: RequestHandle, head: dict[str, Any],
                                 include_usage: bool, echo: str) -> AsyncIterator[str]:
        try:
            if echo:
                yield _sse({**head, "object": "text_completion",
                            "choices": [{"index": 0, "text": echo, "logprobs": None, "finish_reason": None}]})
            async for ev in handle:
                failure = self._failure(ev)
                if failure is not None:
                    yield _sse(failure.body())
                    break
                lp = self._legacy_logprobs([ev.logprob]) if ev.logprob is not None else None
                if ev.text or lp or ev.finish_reason:
                    c = {**head, "object": "text_completion",
                         "choices": [{"index": 0, "text": ev.text, "logprobs": lp, "finish_reason": ev.finish_reason}]}
                    if ev.finish_reason:
                        c["timings"] = ev.timings
                    yield _sse(c)
                if ev.finish_reason and include_usage:
                    yield _sse({**head, "object": "text_completion", "choices": [], "usage": self._usage(ev)})
            yield _sse("[DONE]")
        finally:
            handle.cancel()

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
        return {"prompt": self._render(req.messages, req.tools, req.reasoning_effort, req.chat_template_kwargs)}

    def models(self) -> dict[str, Any]:
        cfg = self.llm.config
        path = Path(self.config.model_path)
        meta = {
            "n_vocab": cfg.vocab_size,
            "n_ctx_train": cfg.context_length,
            "n_embd": cfg.hidden,
            "n_params": getattr(self.llm, "n_params", None),
            "size": path.stat().st_size if path.exists() else None,
        }
        return {"object": "list", "data": [{"id": self.model_id, "object": "model", "created": self.created,
                                            "owned_by": "hybridmoe", "meta": meta}]}

    def props(self) -> dict[str, Any]:
        d = self.config.defaults
        return {
            "default_generation_settings": {
                "n_ctx": self.engine.ctx_size_per_slot,
                "params": {"temperature": d.temperature, "top_k": d.top_k, "top_p": d.top_p, "min_p": d.min_p,
                           "n_predict": -1, "reasoning_format": self.config.reasoning_format},
            },
            "total_slots": self.engine.n_parallel,
            "model_alias": self.model_id,
            "model_path": self.config.model_path,
            "chat_template": self.template,
            "chat_template_caps": {"supports_tools": True, "supports_system_role": True},
            "modalities": {"vision": False, "audio": False},
            "build_info": f"hybridmoe {__version__}",
        }

    def slots(self) -> list[dict[str, Any]]:
        out = []
        for s in self.engine.status()["slots"]:
            s["params"] = {"chat_format": "GPT-OSS", "reasoning_format": self.config.reasoning_format}
            out.append(s)
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
        return prometheus_text(self.engine)
