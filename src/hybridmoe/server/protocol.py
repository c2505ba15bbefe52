"""Request models for the OpenAI subset we serve (plus llama-server's extras), and the error type.

The pieces every API shares: the error type, chat messages and tools as templates read them, the
sampling fields (OpenAI's and llama-server's), tool_choice rules and tagged-union validation. Each
API's own request models live in its module. Unknown fields are ignored (as llama-server does)
so clients that send extras keep working.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.extra = extra or {}  # more fields of the error object (llama-server's n_prompt_tokens, n_ctx)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code,
                          **self.extra}}


NO_LIMIT = 2**31 - 1  # a token limit of -1 (llama-server's "infinity"): the context is the limit


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


class Lenient(BaseModel):
    """Request models ignore fields they do not know, as llama-server and the OpenAI/Anthropic
    servers do (clients send vendor extras)."""

    model_config = ConfigDict(extra="ignore")


class TextPart(Lenient):
    type: str
    text: str | None = None


class FunctionCall(Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    thinking: str | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, v: str | list[TextPart] | None) -> str | list[TextPart] | None:
        if isinstance(v, list):
            for part in v:
                if part.type != "text" or part.text is None:
                    raise ValueError(f"content part of type {part.type!r} is not supported; only 'text'")
        return v

    def text(self) -> str | None:
        if isinstance(self.content, list):
            return "".join(p.text or "" for p in self.content)
        return self.content

    def for_template(self) -> dict[str, Any]:
        """The dict shape HF chat templates expect (content as a plain string)."""
        msg: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_calls:
            msg["tool_calls"] = [
                {"id": tc.id, "type": "function", "function": {"name": tc.function.name, "arguments": tc.function.arguments}}
                for tc in self.tool_calls
            ]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        thinking = self.reasoning_content or self.thinking
        if thinking:
            msg["thinking"] = thinking  # the gpt-oss template reads `thinking`
        return msg


class FunctionDef(Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class StreamOptions(Lenient):
    include_usage: bool = False


class SamplingFields(Lenient):
    """Fields shared by chat and legacy completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)  # llama-server: no upper bound
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)  # the generator takes 64 bits; < 0: random
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1)  # at most --parallel, checked at submit (llama-server's limit)
    n_predict: int | None = Field(default=None, ge=-1)  # llama-server's name; wins over max_tokens
    samplers: list[str] | str | None = None  # llama-server: sampler order (names, or letters "kpmt")
    return_progress: bool = False  # llama-server: prompt_progress chunks while the prompt is processed
    cache_prompt: bool | None = None  # llama-server: reuse a cached prefix (None: --cache-prompt, on by default)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None  # llama-server extra (None: the server's --ignore-eos)
    # llama.cpp's other samplers (settings.SamplerSettings has their meaning and ranges; None: the
    # server's default) and the logit bias (server/logit_bias.py reads both its forms).
    repeat_penalty: float | None = Field(default=None, allow_inf_nan=False)
    repeat_last_n: int | None = None
    presence_penalty: float | None = Field(default=None, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, allow_inf_nan=False)
    dry_multiplier: float | None = Field(default=None, allow_inf_nan=False)
    dry_base: float | None = Field(default=None, allow_inf_nan=False)
    dry_allowed_length: int | None = None
    dry_penalty_last_n: int | None = None
    dry_sequence_breakers: list[str] | None = Field(default=None, min_length=1, max_length=64)  # each scans the vocab
    top_n_sigma: float | None = Field(default=None, allow_inf_nan=False)
    typical_p: float | None = Field(default=None, allow_inf_nan=False)
    xtc_probability: float | None = Field(default=None, allow_inf_nan=False)
    xtc_threshold: float | None = Field(default=None, allow_inf_nan=False)
    min_keep: int | None = None
    dynatemp_range: float | None = Field(default=None, allow_inf_nan=False)
    dynatemp_exponent: float | None = Field(default=None, allow_inf_nan=False)
    mirostat: int | None = None
    mirostat_tau: float | None = Field(default=None, allow_inf_nan=False)
    mirostat_eta: float | None = Field(default=None, allow_inf_nan=False)
    adaptive_target: float | None = Field(default=None, allow_inf_nan=False)
    adaptive_decay: float | None = Field(default=None, allow_inf_nan=False)
    logit_bias: Any = None  # checked by server/logit_bias.py, whose errors name the entry
    # llama-server: report probabilities after the sampler chain (what the draw saw), not the model's
    post_sampling_probs: bool = False
    id_slot: int = -1  # llama-server: run in this slot, waiting for it if busy (-1: the best free one)
    t_max_predict_ms: int = Field(default=0, ge=0)  # llama-server: a time limit on the reply, once past a newline
    n_indent: int = Field(default=0, ge=0)  # llama-server: lines after the first need this much indentation
    sse_ping_interval: float | None = None  # llama-server: seconds of silence before a stream pings (-1: never)
    timings_per_token: bool = False  # llama-server: `timings` on every streamed chunk
    verbose: bool | None = None  # llama-server: `__verbose` in OpenAI-shaped replies; None: --verbose decides
    # Constrained output (one at most; see server/constraint_fields.py): llama-server's GBNF
    # `grammar` and `json_schema` fields, OpenAI's response_format.
    grammar: str | None = None
    json_schema: Any = None
    response_format: dict[str, Any] | None = None

    # max_completion_tokens exists on chat requests only (check_fields=False lets one rule serve both).
    @field_validator("max_tokens", "max_completion_tokens", check_fields=False)
    @classmethod
    def _positive(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and v <= 0:
            raise ValueError(f"{info.field_name} must be at least 1, got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError(f"at most 4 stop sequences are allowed, got {len(v)}")
        return v

    @model_validator(mode="after")
    def _one_constraint(self) -> SamplingFields:
        given = [f for f, v in (("grammar", self.grammar), ("json_schema", self.json_schema)) if v is not None]
        if self.json_mode():
            given.append("response_format")
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)} both constrain the output; send only one")
        if given and self.ignore_eos:
            raise ValueError(f"{given[0]} ends the reply when the constrained text is complete; ignore_eos "
                             "contradicts that")
        return self

    def json_mode(self) -> bool:
        """True for response_format {"type": "json_object"} or "json_schema"; ValueError for other formats."""
        rf = self.response_format
        kind = "text" if rf is None else rf.get("type", "text")
        if kind not in ("text", "json_object", "json_schema"):
            raise ValueError(f"response_format type {kind!r} is not supported; use 'text', 'json_object' "
                             "or 'json_schema'")
        return kind != "text"

    def constrained(self) -> bool:
        """The output must match a grammar or a JSON schema (a named tool_choice aside)."""
        return self.grammar is not None or self.json_schema is not None or self.json_mode()

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


def forced_tool(tool_choice: str | dict[str, Any] | None) -> str | None:
    """None: the model may answer in text; "": it must call one of the tools ('required'); a
    name: it must call that function. ValueError on a malformed tool_choice."""
    tc = tool_choice
    if tc is None or tc in ("none", "auto"):
        return None
    if tc == "required":
        return ""
    if isinstance(tc, str):
        raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or an object, got {tc!r}")
    fn = tc.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if tc.get("type") != "function" or not isinstance(name, str) or not name:
        raise ValueError('tool_choice object must be {"type": "function", "function": {"name": "..."}}, '
                         f"got {tc!r}")
    return name


def check_forced_tool(forced: str | None, tools: list[Tool] | None, constrained: bool) -> None:
    """ValueError when a forced call names no declared tool or meets another output constraint."""
    if forced is None:
        return
    if constrained:
        raise ValueError("a forced tool_choice constrains the reply to a call; grammar, json_schema and "
                         "response_format cannot be combined with it")
    names = [t.function.name for t in tools or []]
    if not names:
        raise ValueError("tool_choice 'required' or a named function needs a non-empty 'tools' list")
    if forced and forced not in names:
        raise ValueError(f"tool_choice names function {forced!r}, which is not in 'tools' ({names})")


def validate_tagged(obj: Any, kinds: dict[str, type[BaseModel]], what: str, default: str | None = None) -> Any:
    """Validate one `{"type": ...}` object with the model its type names (`default` when it has no
    type). ValueError naming `what` and the type otherwise: lists of typed parts (Responses input
    items, Anthropic content blocks) answer "input[3] has type 'x'" rather than a union's noise."""
    if not isinstance(obj, dict):
        raise ValueError(f"{what} must be an object, got {type(obj).__name__}")
    kind = obj.get("type", default)
    model = kinds.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise ValueError(f"{what} has type {kind!r}, which this server does not support "
                         f"(supported: {', '.join(kinds)})")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        msg = str(err["msg"]).removeprefix("Value error, ")
        raise ValueError(f"{what} ({kind}): {loc + ': ' if loc else ''}{msg}") from None
