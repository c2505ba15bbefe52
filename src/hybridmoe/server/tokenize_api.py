"""llama-server's token and template routes: `/tokenize`, `/detokenize`, `/apply-template`.
They run no generation; plain `def` routes, so FastAPI runs them in its thread pool."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from pydantic import Field

from hybridmoe.server.protocol import ChatMessage, Lenient, Tool
from hybridmoe.server.wiring import Wiring


class TokenizeRequest(Lenient):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(Lenient):
    tokens: list[int]


class ApplyTemplateRequest(Lenient):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    reasoning_effort: Literal["none", "low", "medium", "high"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool | None = None


def register(app: FastAPI, w: Wiring) -> None:
    @app.post("/tokenize")
    def tokenize(req: TokenizeRequest) -> Any:
        s = w.service()
        tok = s.tokenizer
        ids = tok.encode(req.content, allow_special=req.parse_special)
        if req.add_special and tok.bos_id is not None and s.format.add_bos:
            ids = [tok.bos_id, *ids]
        if req.with_pieces:
            return {"tokens": [{"id": i, "piece": tok.token_text(i)} for i in ids]}
        return {"tokens": ids}

    @app.post("/detokenize")
    def detokenize(req: DetokenizeRequest) -> Any:
        s = w.service()
        return {"content": s.tokenizer.decode(s.check_ids(req.tokens, "tokens"))}

    @app.post("/apply-template")
    def apply_template(req: ApplyTemplateRequest) -> Any:
        r = w.service().render(req.messages, req.tools, req.reasoning_effort, req.chat_template_kwargs,
                               req.add_generation_prompt, req.continue_final_message)
        return {"prompt": r.prompt}
