"""llama-server's native completion API: `POST /completion` and `POST /completions`.

As in llama-server, both paths answer in the native shape (only `/v1/completions` is OpenAI's):
`content`, `tokens`, `stop`, `stop_type`, `stopping_word`, `timings`, `generation_settings`, ...
The prompt is a string, token ids, both mixed (`[12, 34, "text", 56]`) or a JSON object
`{"prompt_string": ...}` (one of those); a list of such prompts gives a list of results (one
object when there is one result). `n_cmpl` (or `n`) asks for several completions of each prompt.
Streams send one `data:` object per token and a final object with `stop: true`, with no `[DONE]`
line (llama-server's native stream).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from pydantic import Field, field_validator, model_validator

from hybridmoe.engine.engine import GenerationRequest, PromptProgress
from hybridmoe.server.generation import SSEvent
from hybridmoe.server.jobs import TextJob
from hybridmoe.server.logprob_json import native_probs
from hybridmoe.server.native_result import llama_timings, native_final
from hybridmoe.server.protocol import NO_LIMIT, APIError, SamplingFields, bad_request
from hybridmoe.server.reply import Finished, Reply, ReplyEvent, TokenOut
from hybridmoe.server.service import Service
from hybridmoe.server.wiring import Wiring

PromptPart = int | str
Prompt = str | list[PromptPart] | dict[str, Any]  # dict: llama-server's {"prompt_string": ..., "multimodal_data": ...}
BAD_PROMPT = ('"prompt" elements must be a string, a list of tokens, a JSON object containing a prompt string, '
              'or a list of mixed strings & tokens.')  # llama-server's words


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
    if isinstance(prompt, str | dict):
        return [prompt]
    if not prompt:
        raise bad_request("prompt is empty", param="prompt")
    if any(isinstance(p, int) for p in prompt):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


def prompt_ids(s: Service, prompt: Prompt) -> list[int]:
    """A prompt's ids: text (special tokens parsed), token ids, both mixed, or a JSON object's
    prompt_string (any multimodal_data is refused as llama-server does for a text-only model)."""
    if isinstance(prompt, dict):
        if "multimodal_data" in prompt:
            raise bad_request("Multimodal data provided, but model does not support multimodal requests.",
                              param="prompt")
        inner = prompt.get("prompt_string")
        if not isinstance(inner, str | list):
            raise bad_request(BAD_PROMPT, param="prompt")
        return prompt_ids(s, inner)
    if isinstance(prompt, str):
        return s.encode_prompt(prompt, "prompt")
    ids: list[int] = []
    for part in prompt:
        if isinstance(part, str):
            ids += s.tokenizer.encode(part, allow_special=True)
        elif isinstance(part, int) and not isinstance(part, bool):
            ids += s.check_ids([part], "prompt")
        else:
            raise bad_request(f"prompt parts must be token ids or strings, got {type(part).__name__}", param="prompt")
    return ids


def native_job(s: Service, req: NativeCompletionRequest) -> TextJob:
    limit = req.token_limit()
    return TextJob([prompt_ids(s, p) for p in split_prompts(req.prompt)],  # type: ignore[arg-type]
                   req, NO_LIMIT if limit is not None and limit < 0 else limit, req.probs(), req.copies())


class NativeRender:
    """Native result objects: one per reply, or a stream of per-token objects and a final one
    (`final(request, reply, index, stream)` builds it)."""

    def __init__(self, requests: list[GenerationRequest], req: NativeCompletionRequest,
                 final: Callable[[GenerationRequest, Reply, int, bool], dict[str, Any]],
                 failure: Callable[[Reply], APIError | None], token_bytes: Callable[[int], bytes]) -> None:
        self.requests, self.req, self.final = requests, req, final
        self.failure, self.token_bytes = failure, token_bytes
        self._n_tokens = [0] * len(requests)

    def json(self, replies: list[Reply]) -> dict[str, Any] | list[dict[str, Any]]:
        out = [self.final(self.requests[i], r, i, False) for i, r in enumerate(replies)]
        return out[0] if len(out) == 1 else out

    def opening(self) -> list[SSEvent]:
        return []

    def progress(self, i: int, p: PromptProgress) -> list[SSEvent]:
        return [SSEvent({"index": i, "content": "", "tokens": [], "stop": False, "id_slot": -1, "tokens_predicted": 0,
                         "tokens_evaluated": p.total, "prompt_progress": p.to_json()})]

    def events(self, i: int, events: list[ReplyEvent]) -> list[SSEvent]:
        out = []
        last = any(isinstance(ev, Finished) for ev in events)
        for ev in events:
            if isinstance(ev, TokenOut):
                out += self._token(i, ev, live_timings=not last)
            elif isinstance(ev, Finished):
                failure = self.failure(ev.reply)
                if failure is not None:
                    out.append(SSEvent(failure.body()))
                elif ev.reply.finish_reason != "cancelled":
                    out.append(SSEvent(self.final(self.requests[i], ev.reply, i, True)))
        return out

    def _token(self, i: int, ev: TokenOut, live_timings: bool) -> list[SSEvent]:
        token = ev.token_id if ev.token_id is not None else ev.stop_token_id  # the end token: its own chunk
        self._n_tokens[i] += sum(t is not None for t in (ev.token_id, ev.stop_token_id))
        if token is None and not ev.text:
            return []
        chunk: dict[str, Any] = {
            "index": i, "content": ev.text, "tokens": [token] if token is not None else [], "stop": False,
            "id_slot": -1, "tokens_predicted": self._n_tokens[i],
            "tokens_evaluated": len(self.requests[i].prompt_ids)}
        if ev.logprob is not None and self.req.probs():
            chunk["completion_probabilities"] = native_probs([ev.logprob], self.token_bytes,
                                                             self.req.post_sampling_probs)
        if ev.timings and live_timings:  # timings_per_token (the final object has the last ones)
            chunk["timings"] = llama_timings(ev.timings)
        return [SSEvent(chunk)]

    def closing(self) -> list[SSEvent]:
        return []  # llama-server's native stream has no [DONE] line


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



def register(app: FastAPI, w: Wiring) -> None:
    @app.post("/completion")
    @app.post("/completions")
    async def completion(req: NativeCompletionRequest, request: Request) -> Any:
        s = w.service()
        job = await asyncio.to_thread(native_job, s, req)
        gen = await s.start_text(job)

        def final(r: GenerationRequest, reply: Reply, index: int, stream: bool) -> dict[str, Any]:
            out = native_final(r, reply, index=index, model=s.model_id, n_ctx=s.engine.ctx_size_per_slot,
                               prompt=s.tokenizer.decode(list(r.prompt_ids)), stream=stream,
                               return_tokens=req.return_tokens, post_sampling=req.post_sampling_probs,
                               token_bytes=s.tokenizer.token_bytes, id_slot=reply.slot_id)
            return out if not req.response_fields else pick_fields(out, req.response_fields)

        render = NativeRender(gen.requests, req, final, s.consumer.failure, s.tokenizer.token_bytes)
        if req.stream:
            return s.consumer.stream(gen, render, w.ping_interval(req), req.return_progress)
        return render.json(await s.consumer.replies(gen, request.is_disconnected))
