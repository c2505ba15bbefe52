"""OpenAI legacy completions (`POST /v1/completions`): the request model, its mapping to a
`TextJob`, and the renderer of raw replies as a `text_completion` object or SSE chunks."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from pydantic import Field, field_validator

from hybridmoe.engine.engine import GenerationRequest, PromptProgress
from hybridmoe.server.chat_completions import include_usage, usage
from hybridmoe.server.generation import SSEvent
from hybridmoe.server.jobs import TextJob
from hybridmoe.server.logprob_json import TokenBytes, legacy_logprobs
from hybridmoe.server.native_result import llama_timings
from hybridmoe.server.protocol import NO_LIMIT, APIError, SamplingFields
from hybridmoe.server.reply import Finished, Reply, ReplyEvent, TokenOut
from hybridmoe.server.service import Service
from hybridmoe.server.wiring import Wiring


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False

    def token_limit(self, server_default: int | None) -> int | None:
        """n_predict (llama-server) > max_tokens > the server's -n > OpenAI's legacy 16;
        -1: no limit (None)."""
        for v in (self.n_predict, self.max_tokens, server_default, 16):
            if v is not None:
                return NO_LIMIT if v < 0 else v
        return NO_LIMIT

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[int] | list[str]) -> str | list[int] | list[str]:
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt is empty")
            if isinstance(v[0], str) and len(v) != 1:
                raise ValueError("only one prompt per request is supported")
        return v


def completion_job(s: Service, req: CompletionRequest) -> TextJob:
    """Tokenizes the prompt (text with special tokens parsed, as llama-server does, or token ids)."""
    prompt = req.prompt if isinstance(req.prompt, str) or not isinstance(req.prompt[0], str) else req.prompt[0]
    ids = s.encode_prompt(prompt, "prompt") if isinstance(prompt, str) else s.check_ids(prompt, "prompt")
    return TextJob([ids], req, req.token_limit(s.config.n_predict), req.logprobs, req.n)


class CompletionRender:
    """One legacy completion's JSON object or stream; `echo`: the prompt's text, sent first."""

    def __init__(self, head: dict[str, Any], requests: list[GenerationRequest], echo: str,
                 token_text: Callable[[int], str], token_bytes: TokenBytes,
                 failure: Callable[[Reply], APIError | None],
                 verbose: Callable[[GenerationRequest, Reply, bool], dict[str, Any] | None],
                 include_usage: bool = False) -> None:
        self.head, self.requests, self.echo = head, requests, echo
        self.token_text, self.token_bytes = token_text, token_bytes
        self.failure, self.verbose, self.include_usage = failure, verbose, include_usage
        self._finals: list[Reply] = []

    def _logprobs(self, lps: list[Any]) -> dict[str, Any]:
        return legacy_logprobs(lps, self.token_text, self.token_bytes)

    def json(self, replies: list[Reply]) -> dict[str, Any]:
        choices = [{"index": i, "text": self.echo + r.text, "finish_reason": r.finish_reason,
                    "logprobs": self._logprobs(r.logprobs) if self.requests[i].logprobs is not None else None}
                   for i, r in enumerate(replies)]
        out = {**self.head, "object": "text_completion", "choices": choices, "usage": usage(replies),
               "timings": llama_timings(replies[0].timings)}
        verbose = self.verbose(self.requests[0], replies[0], False)
        if verbose is not None:
            out["__verbose"] = verbose
        return out

    def _chunk(self, i: int, text: str, lp: Any = None, finish: str | None = None) -> dict[str, Any]:
        return {**self.head, "object": "text_completion",
                "choices": [{"index": i, "text": text, "logprobs": lp, "finish_reason": finish}]}

    def opening(self) -> list[SSEvent]:
        return [SSEvent(self._chunk(i, self.echo)) for i in range(len(self.requests))] if self.echo else []

    def progress(self, i: int, p: PromptProgress) -> list[SSEvent]:
        return [SSEvent({**self._chunk(i, ""), "prompt_progress": p.to_json()})]

    def events(self, i: int, events: list[ReplyEvent]) -> list[SSEvent]:
        tok = next((ev for ev in events if isinstance(ev, TokenOut)), None)
        done = next((ev.reply for ev in events if isinstance(ev, Finished)), None)
        if done is not None:
            failure = self.failure(done)
            if failure is not None:
                return [SSEvent(failure.body())]
            self._finals.append(done)
        text = tok.text if tok is not None else ""
        lp = self._logprobs([tok.logprob]) if tok is not None and tok.logprob is not None else None
        finish = done.finish_reason if done is not None else None
        if not (text or lp or finish):
            return []
        chunk = self._chunk(i, text, lp, finish)
        timings = done.timings if done is not None else tok.timings if tok is not None else None
        if timings and (done is None or not self.include_usage):  # per token when asked; the last one's
            chunk["timings"] = llama_timings(timings)
        # llama-server repeats a partial __verbose on every chunk; the whole result once, at the end, says more
        verbose = self.verbose(self.requests[i], done, True) if done is not None and i == 0 else None
        if verbose is not None:
            chunk["__verbose"] = verbose
        return [SSEvent(chunk)]

    def closing(self) -> list[SSEvent]:
        out = []
        if self.include_usage and self._finals:
            out.append(SSEvent({**self.head, "object": "text_completion", "choices": [], "usage": usage(self._finals),
                                "timings": llama_timings(self._finals[-1].timings)}))
        return out + [SSEvent("[DONE]")]


def register(app: FastAPI, w: Wiring) -> None:
    @app.post("/v1/completions")  # /completion(s) are llama-server's native API: native_completion.py
    async def completions(req: CompletionRequest, request: Request) -> Any:
        s = w.service()
        job = await asyncio.to_thread(completion_job, s, req)
        gen = await s.start_text(job)
        echo = s.tokenizer.decode(job.prompts[0]) if req.echo else ""
        render = CompletionRender(s.head("cmpl"), gen.requests, echo, s.tokenizer.token_text, s.tokenizer.token_bytes,
                                  s.consumer.failure, partial(s.verbose, asked=req.verbose), include_usage(req))
        if req.stream:
            return s.consumer.stream(gen, render, w.ping_interval(req), req.return_progress)
        return render.json(await s.consumer.replies(gen, request.is_disconnected))
