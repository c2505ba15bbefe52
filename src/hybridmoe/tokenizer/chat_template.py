"""Render Hugging Face-style Jinja chat templates (`tokenizer.chat_template`) in a sandbox.

The environment matches what HF templates expect: trim_blocks/lstrip_blocks, loop controls,
`raise_exception`, `strftime_now`, a `tojson` that takes json.dumps' arguments and does not
HTML-escape, and a no-op `{% generation %}` block.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The chat template failed to compile or render (message says where and why)."""


class _TemplateRaised(Exception):
    """Raised by the template's own `raise_exception(...)`."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: Sequence[str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Not Markup-escaped: chat prompts are not HTML, and '<' must stay '<'.
    seps = tuple(separators) if separators is not None else None
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=seps, sort_keys=sort_keys)


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` (HF marks assistant spans for training): render the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _make_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", _GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _make_env()


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    try:
        return _ENV.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template syntax error at line {e.lineno}: {e.message}") from None


def _plain(obj: Any) -> Any:
    """pydantic models -> dicts, so templates can use `m["role"]` and `m.role` alike."""
    if hasattr(obj, "model_dump"):
        return obj.model_dump(exclude_none=True)
    return obj


# The template variables render_chat sets from its own arguments; extra_vars may not name them.
RESERVED_TEMPLATE_VARS = frozenset({"messages", "tools", "add_generation_prompt"})


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    extra_vars: Mapping[str, object] | None = None,
) -> str:
    """Render `messages` (OpenAI-style dicts) with a chat template; returns the prompt text.

    `extra_vars` are further template variables (reasoning_effort, bos_token, a request's
    chat_template_kwargs, ...). Raises ChatTemplateError for bad inputs and for any failure
    inside the template.
    """
    if not isinstance(template, str) or not template.strip():
        raise ChatTemplateError("chat template is empty")
    clash = sorted(RESERVED_TEMPLATE_VARS.intersection(extra_vars or {}))
    if clash:
        raise ChatTemplateError(f"template variable {clash[0]!r} is set from render_chat's own arguments")
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"messages must be a list of message objects, got {type(messages).__name__}")
    messages = [_plain(m) for m in messages]
    for k, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"messages[{k}] must be an object, got {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise ChatTemplateError(f"messages[{k}] has no string 'role'")
    if tools is not None:
        tools = [_plain(t) for t in tools]
    compiled = _compile(template)
    try:
        return compiled.render(
            {**(extra_vars or {}), "messages": messages, "tools": tools, "add_generation_prompt": add_generation_prompt}
        )
    except _TemplateRaised as e:
        raise ChatTemplateError(f"chat template rejected the request: {e}") from None
    except jinja2.exceptions.SecurityError as e:
        raise ChatTemplateError(f"chat template attempted an unsafe operation: {e}") from None
    except RecursionError:  # e.g. a recursive macro over deeply nested tool parameters
        raise ChatTemplateError("chat template failed to render: the input nests too deeply") from None
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
        raise ChatTemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from None
