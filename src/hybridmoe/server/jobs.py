"""What the server runs, whichever API asked: each API maps its request to one of these plain jobs
(server/service.py turns a job into engine requests and reply builders)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridmoe.server.protocol import ChatMessage, SamplingFields, Tool


@dataclass
class ChatJob:
    """A conversation to answer: rendered with the chat template, its reply parsed by the chat format."""

    messages: list[ChatMessage]
    sampling: SamplingFields  # sampling, stop strings, output constraint, llama-server's extras
    tools: list[Tool] | None = None  # offered to the model
    forced_tool: str | None = None  # None: the model may answer in text; "": it must call a tool; NAME: that one
    token_limit: int | None = None  # None: the server's -n; protocol.NO_LIMIT: up to the context
    logprobs: int | None = None  # alternatives per token (None: no logprobs)
    n: int = 1  # choices, one slot each
    reasoning_effort: str | None = None  # None: the server's --reasoning-effort
    reasoning_format: str | None = None  # none (raw text) | auto | deepseek; None: the server's
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool | None = None
    reasoning_budget_tokens: int = -1  # -1: the server's --reasoning-budget
    reasoning_budget_message: str | None = None  # None: the server's
    reasoning_control: bool = False  # the thinking may be ended while it runs (chat control)


@dataclass
class TextJob:
    """Prompts to continue as they are (legacy and native completions): raw text replies."""

    prompts: list[list[int]]  # token ids of each prompt; every prompt gets `n` replies
    sampling: SamplingFields
    token_limit: int | None = None
    logprobs: int | None = None
    n: int = 1
