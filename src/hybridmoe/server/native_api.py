"""llama-server's native completion API: `POST /completion` and `POST /completions`.

As in llama-server, both paths answer in the native shape (only `/v1/completions` is OpenAI's):
`content`, `tokens`, `stop`, `stop_type`, `stopping_word`, `timings`, `generation_settings`, ...
The prompt is a string, token ids, or both mixed (`[12, 34, "text", 56]`); a list of such prompts
gives a list of results (one object when there is one result). `n_cmpl` (or `n`) asks for several
completions of each prompt. Streams send one `data:` object per token and a final object with
`stop: true`, with no `[DONE]` line (llama-server's native stream).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from pydantic import Field, field_validator, model_validator

from hybridmoe.engine.engine import RequestHandle
from hybridmoe.server.event_streams import Progress, merged_events
from hybridmoe.server.native_result import Collected, llama_timings, native_final, probs_json
from hybridmoe.server.protocol import NO_LIMIT, APIError, ChatCompletionRequest, SamplingFields, bad_request

PromptPart = int | str
Prompt = str | list[PromptPart]


class NativeCompletionRequest(SamplingFields):
    """The request body of llama-server's /completion (fields it documents; unknown ones ignored)."""

    prompt: Prompt | list[Prompt] | None = None
    max_completion_tokens: int | None = None
    n_cmpl: int | None = Field(default=None, ge=1)
    n_probs: int | None = Field(default=None, ge=0, le=100)
    logprobs: int | None = Field(default=None, ge=0, le=100)  # alias of n_probs, as llama-server reads it
    return_tokens: bool = False
    temperature: float | None = Field(default=None, ge=0.0)
    # only these fields of the final result; "a/b" reaches into an object, under the key "a/b"
    response_fields: list[str] | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        return v  # llama-server puts no limit on the number of stop strings

    @field_validator("max_tokens", "max_completion_tokens")
    @classmethod
    def _positive(cls, v: int | None) -> int | None:  # overrides SamplingFields': -1 means no limit here
        if v is not None and v < -1:
            raise ValueError(f"must be -1 (no limit) or more, got {v}")
        return v

    @model_validator(mode="after")
    def _check(self) -> NativeCompletionRequest:
        if self.prompt is None:
            raise ValueError('"prompt" is required')
        return self

    def copies(self) -> int:
        return self.n_cmpl if self.n_cmpl is not None else self.n

    def token_limit(self) -> int | None:
        """n_predict, else its aliases max_tokens / max_completion_tokens; None: the server's -n."""
        for v in (self.n_predict, self.max_tokens, self.max_completion_tokens):
            if v is not None:
                return v
        return None

    def probs(self) -> int:
        return self.n_probs if self.n_probs is not None else (self.logprobs or 0)


def split_prompts(prompt: Prompt | list[Prompt]) -> list[Prompt]:
    """llama-server's rule: a string, or a list holding a token id anywhere at its top level, is one
    prompt; otherwise a list is several prompts (strings or token/string lists)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt is empty", param="prompt")
    if any(isinstance(p, int) for p in prompt):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


class NativeCompletions:
    """Serves /completion through `Serving` (same engine, sampling defaults and prompt checks)."""

    def __init__(self, serving: Any) -> None:
        self.s = serving

    def _ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.s.prompt_ids(prompt)
        ids: list[int] = []
        for part in prompt:
            if isinstance(part, str):
                ids += self.s.tokenizer.encode(part, allow_special=True)
            elif isinstance(part, int) and not isinstance(part, bool):
                ids += self.s.prompt_ids([part])
            else:
                raise bad_request(f"prompt parts must be token ids or strings, got {type(part).__name__}",
                                  param="prompt")
        return ids

    async def handle(self, req: NativeCompletionRequest, request: Request) -> Any:
        prompts = split_prompts(req.prompt)  # type: ignore[arg-type]
        id_lists = await asyncio.to_thread(lambda: [self._ids(p) for p in prompts])
        constraint = await self.s._constraint(req)  # grammar / json_schema: the engine's constraint
        dry = await self.s._dry_breakers(req)
        n = req.copies()
        self.s.check_n(n)
        limit = req.token_limit()
        handles: list[RequestHandle] = []
        try:
            for ids in id_lists:
                handles += self.s.submit_n(ids, req, NO_LIMIT if limit is not None and limit < 0 else limit,
                                           req.probs(), n, constraint, dry=dry)
        except APIError:
            for h in handles:
                h.cancel()
            raise
        if req.stream:
            return self._stream(handles, req)
        results = await self._full(handles, req, request)
        return results[0] if len(results) == 1 else results

    def _final(self, handle: RequestHandle, c: Collected, index: int, req: NativeCompletionRequest,
               stream: bool, id_slot: int) -> dict[str, Any]:
        tk = self.s.tokenizer
        out = native_final(handle, c, index=index, model=self.s.model_id, n_ctx=self.s.engine.ctx_size_per_slot,
                           prompt=tk.decode(list(handle.request.prompt_ids)), stream=stream,
                           return_tokens=req.return_tokens, post_sampling=req.post_sampling_probs,
                           token_bytes=tk.token_bytes, decode=tk.decode, id_slot=id_slot)
        return out if not req.response_fields else pick_fields(out, req.response_fields)

    async def _full(self, handles: list[RequestHandle], req: NativeCompletionRequest,
                    request: Request) -> list[dict[str, Any]]:
        collected = [Collected() for _ in handles]
        watch = asyncio.create_task(_cancel_on_disconnect(handles, request))
        try:
            async for i, ev in merged_events(handles):
                collected[i].push(ev)
                if ev.finish_reason is not None:
                    self.s._finished(ev)
        finally:
            watch.cancel()
        out = []
        for i, (h, c) in enumerate(zip(handles, collected)):
            failure = self.s._failure(c.last) if c.last is not None else None
            if failure is not None:
                raise failure
            if c.last is None or c.last.finish_reason == "cancelled":
                raise APIError(500, "generation was cancelled", type="server_error")
            out.append(self._final(h, c, i, req, stream=False, id_slot=h.slot_id))
        return out

    async def _stream(self, handles: list[RequestHandle], req: NativeCompletionRequest) -> AsyncIterator[str]:
        collected = [Collected() for _ in handles]
        tk = self.s.tokenizer
        async for i, ev in merged_events(handles, self.s.engine, req.return_progress):
            if isinstance(ev, Progress):
                yield _sse({"index": i, "content": "", "tokens": [], "stop": False, "id_slot": -1,
                            "tokens_predicted": 0, "tokens_evaluated": ev.total, "prompt_progress": ev.to_json()})
                continue
            c = collected[i]
            c.push(ev)
            token = ev.token_id if ev.token_id is not None else ev.stop_token_id  # the end token: its own chunk
            if token is not None or ev.text:
                chunk: dict[str, Any] = {
                    "index": i, "content": ev.text, "tokens": [token] if token is not None else [],
                    "stop": False, "id_slot": -1, "tokens_predicted": len(c.tokens),
                    "tokens_evaluated": len(handles[i].request.prompt_ids)}
                if ev.logprob is not None and req.probs():
                    chunk["completion_probabilities"] = probs_json([ev.logprob], tk.token_bytes,
                                                                   req.post_sampling_probs)
                if ev.timings and ev.finish_reason is None:  # timings_per_token
                    chunk["timings"] = llama_timings(ev.timings)
                yield _sse(chunk)
            if ev.finish_reason is None:
                continue
            self.s._finished(ev)
            if (failure := self.s._failure(ev)) is not None:
                yield _sse(failure.body())
            elif ev.finish_reason != "cancelled":
                yield _sse(self._final(handles[i], c, i, req, stream=True, id_slot=handles[i].slot_id))


def pick_fields(result: dict[str, Any], paths: list[str]) -> dict[str, Any]:
    """llama-server's `response_fields`: each path that exists, as a top-level key (paths that
    do not exist are left out, without an error)."""
    out: dict[str, Any] = {}
    for path in paths:
        cur: Any = result
        for key in path.split("/"):
            if not isinstance(cur, dict) or key not in cur:
                break
            cur = cur[key]
        else:
            out[path] = cur
    return out


async def _cancel_on_disconnect(handles: list[RequestHandle], request: Request) -> None:
    while True:
        if await request.is_disconnected():
            for h in handles:
                h.cancel()
            return
        await asyncio.sleep(0.25)


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def register_routes(app: FastAPI, serving: Any, respond: Any) -> None:
    """Native completion routes and token counting; `serving()` returns the live `Serving` (or raises
    503 while loading); `respond(result, req)` makes a stream an SSE response (app.py)."""

    @app.post("/completion")
    @app.post("/completions")
    async def completion(req: NativeCompletionRequest, request: Request) -> Any:
        result = await NativeCompletions(serving()).handle(req, request)
        if isinstance(result, (dict, list)):
            return result
        return respond(result, req)

    @app.post("/v1/chat/completions/input_tokens")
    @app.post("/chat/completions/input_tokens")
    def input_tokens(req: ChatCompletionRequest) -> Any:
        return serving().input_tokens(req)
