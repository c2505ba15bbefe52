"""Request limits and checks that the pydantic models cannot express, each failing as a 400 that
names the field (OpenAI error shape) instead of a 500 deep inside the template or the tokenizer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridmoe.server.protocol import bad_request
from hybridmoe.settings import ServerLimits
from hybridmoe.tokenizer.chat_template import RESERVED_TEMPLATE_VARS

# Nesting of a tool's JSON-schema `parameters`: the gpt-oss template renders them with a
# recursive macro (Python's recursion limit breaks near 300 levels); real schemas nest < 10.
MAX_TOOL_NESTING = 64
DEFAULT_MAX_BODY_BYTES = ServerLimits().max_body_bytes  # --max-body-size's default (hybridmoe.settings)


def check_template_kwargs(kwargs: Mapping[str, Any] | None, param: str = "chat_template_kwargs") -> None:
    """400 if a key names a template variable the renderer sets from the request itself."""
    clash = sorted(RESERVED_TEMPLATE_VARS.intersection(kwargs or {}))
    if clash:
        raise bad_request(f"{param}.{clash[0]}: this key is reserved (the template receives it from the request "
                          f"itself); reserved keys: {', '.join(sorted(RESERVED_TEMPLATE_VARS))}",
                          param=f"{param}.{clash[0]}")


def nesting_depth(value: Any, stop_at: int) -> int:
    """Depth of nested lists/dicts in `value` (a scalar is 0), counting no further than `stop_at`.
    Iterative: the point is to refuse values too deep for recursive code."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (list, dict)):
            d += 1
            if d > deepest:
                deepest = d
                if deepest > stop_at:
                    return deepest
            stack.extend((x, d) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def check_tools(tools: list[Any] | None, param: str = "tools") -> None:
    """400 if a tool's `parameters` nest deeper than MAX_TOOL_NESTING."""
    for i, tool in enumerate(tools or []):
        params = tool.function.parameters
        if params is not None and nesting_depth(params, MAX_TOOL_NESTING) > MAX_TOOL_NESTING:
            raise bad_request(f"{param}.{i}.function.parameters: nested deeper than {MAX_TOOL_NESTING} levels",
                              param=f"{param}.{i}.function.parameters")
